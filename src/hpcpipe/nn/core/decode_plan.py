"""Where the new tokens of one decode-stage call sit among its rows, checked: rows, positions, slots, attention batch.

A call carries the new tokens of several sequences (:class:`Segment`: slot, start, length) as consecutive
rows; :func:`plan_call` checks them and builds every index the stage needs once per call (on the host and,
for the NumPy attention, as xp arrays): each row's position and slot, the last row of each segment, the
prefill segments (:class:`Prefill`: where their keys go, which KV blocks they read) and the decode rows'
batched attention (:class:`DecodeBatch`). The cache is paged (hpcpipe.nn.core.kv_pages): a row's key goes to
KV block ``tables[slot, position // page]``, and attention reads a sequence's KV blocks in table order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Segment:
    """The new tokens of one sequence in a forward call."""

    slot: int     # KV-cache row of this sequence, 0 <= slot < slots
    start: int    # position of the first new token (= tokens already in the cache for this slot)
    length: int   # new tokens (1 for a decode step, the prompt length for a prefill)


@dataclass
class Prefill:
    """A segment longer than one token: its rows' KV blocks and offsets, and the KV blocks it attends over."""

    first: int          # its first row in the call
    segment: Segment
    blocks: Any         # xp int64 (length,): the KV block of each new token
    offsets: Any        # xp int64 (length,): its offset in that block
    pages: Any          # xp int64: the sequence's KV blocks holding positions [0, start + length)


@dataclass
class DecodeBatch:
    """The decode (length-1) segments of a forward call: one batched attention over their KV blocks.

    Their sequences' KV blocks (``npages`` each, enough for the longest) are gathered into a scratch buffer
    the stage reuses, ``keys = npages x page`` positions per sequence, the positions after each token hidden.
    """

    rows: Any        # xp int64 rows of the decode tokens in the call, or None when they are all the rows
    blocks: Any      # xp int64 (n,) the KV block of each token
    offsets: Any     # xp int64 (n,) its offset in that block
    n: int
    keys: int        # positions attended over per sequence: npages x page (the padding hidden)
    gather: Any      # xp int64 (n * npages,): the KV blocks of each sequence, in order
    future: Any      # xp bool (n, 1, 1, keys): True where a key is after the query
    row_positions: Any = None   # xp int64 (n,): the query position of each row (a window's start)
    strided: tuple[int, int] | None = None   # (first KV block, blocks between sequences) when the table is a grid


@dataclass
class CallPlan:
    """Where the segments of one forward call sit among its rows, on the host and as xp index arrays."""

    n_rows: int
    positions: np.ndarray                # host int64 (n_rows,): each row's position in its sequence
    row_slots: np.ndarray                # host int64 (n_rows,): each row's slot
    last_rows: Any                       # xp int64 (n_segments,), or None when every row is a segment's last
    prefill: list[Prefill]               # each segment longer than 1
    decode: DecodeBatch | None
    dev_positions: Any = None            # xp copy of positions, made on first use (see DecodeStage._positions)


def all_rows(rows: Any) -> Any:
    """Index of the given rows, or of all rows when None."""
    return slice(None) if rows is None else rows


def plan_call(segments: list[Segment], paged: Any, xp: Any, attention: bool = True) -> CallPlan:
    """Check the segments and build the row and cache indices one forward call needs (``paged``: the stage's
    hpcpipe.nn.core.kv_pages.PagedLayout; ``attention`` False: the NumPy attention's indices are not planned,
    for a compiled stage that attends in C)."""
    slots, seq_len = paged.slots, paged.seq_len
    if not segments:
        raise ValueError("decode stage: forward needs at least one segment")
    seen = set()
    for seg in segments:
        for name in ("slot", "start", "length"):
            value = getattr(seg, name)
            if not isinstance(value, int | np.integer) or isinstance(value, bool):
                raise ValueError(f"decode stage: segment {name} must be an integer, got {value!r}")
        if not 0 <= seg.slot < slots:
            raise ValueError(f"decode stage: segment slot {seg.slot} out of range 0..{slots - 1}")
        if seg.start < 0 or seg.length < 1:
            raise ValueError(f"decode stage: segment start {seg.start} must be >= 0 and length {seg.length} >= 1")
        if seg.start + seg.length > seq_len:
            raise ValueError(f"decode stage: segment start {seg.start} + length {seg.length} = "
                             f"{seg.start + seg.length} exceeds seq_len {seq_len} (slot {seg.slot})")
        if seg.slot in seen:
            raise ValueError(f"decode stage: slot {seg.slot} appears in two segments of one forward call")
        seen.add(seg.slot)
    lengths = np.array([s.length for s in segments], dtype=np.int64)
    starts = np.array([s.start for s in segments], dtype=np.int64)
    firsts = np.cumsum(lengths) - lengths
    n_rows = int(lengths.sum())
    positions = np.arange(n_rows, dtype=np.int64) + np.repeat(starts - firsts, lengths)
    row_slots = np.repeat(np.array([s.slot for s in segments], dtype=np.int64), lengths)
    is_dec = lengths == 1
    all_last = bool(is_dec.all())
    prefill, decode = [], None
    if attention:
        blocks, offsets = paged.where(row_slots, positions)
        for i in np.flatnonzero(~is_dec):
            seg, rows = segments[i], slice(int(firsts[i]), int(firsts[i] + lengths[i]))
            prefill.append(Prefill(int(firsts[i]), seg, xp.asarray(blocks[rows]), xp.asarray(offsets[rows]),
                                   xp.asarray(paged.pages_of(seg.slot, seg.start + seg.length))))
        if is_dec.any():
            at = firsts[is_dec]
            decode = decode_batch(None if all_last else at, row_slots[at], starts[is_dec], blocks[at], offsets[at],
                                  paged, xp)
    else:
        prefill = [Prefill(int(firsts[i]), segments[i], None, None, None) for i in np.flatnonzero(~is_dec)]
    last_rows = None if all_last else xp.asarray(firsts + lengths - 1)
    return CallPlan(n_rows, positions, row_slots, last_rows, prefill, decode)


def decode_batch(rows: np.ndarray | None, slots: np.ndarray, positions: np.ndarray, blocks: np.ndarray,
                 offsets: np.ndarray, paged: Any, xp: Any) -> DecodeBatch:
    """Plan the batched attention of the decode tokens at ``rows`` (host arrays) of a forward call.

    The mask (key after query) is made for these rows and keys only: a (seq_len, seq_len) table kept for it
    took 64 MiB at a context of 8192 (and as much again while built).
    """
    n = slots.size
    npages = int(positions.max()) // paged.page + 1          # KV blocks of the longest sequence
    keys = npages * paged.page
    dev_pos = xp.asarray(positions)
    table = paged.tables[slots, :npages]
    gather = table.reshape(-1)
    future = xp.arange(keys)[None, :] > dev_pos[:, None]
    return DecodeBatch(None if rows is None else xp.asarray(rows), xp.asarray(blocks), xp.asarray(offsets), n,
                       keys, xp.asarray(gather), future.reshape(n, 1, 1, keys), dev_pos, block_grid(table))


def block_grid(table: np.ndarray) -> tuple[int, int] | None:
    """``(first, step)`` when sequence i's KV blocks are ``first + i * step + (0, 1, ...)`` (any sign), else None.

    Then the sequences' keys are one strided view of the cache and need no copy: the layout of a cache whose
    slots own their blocks (generate, one sequence, a pool handing out consecutive blocks).
    """
    n, npages = table.shape
    first = int(table[0, 0])
    step = int(table[1, 0]) - first if n > 1 else 0
    expected = first + step * np.arange(n, dtype=np.int64)[:, None] + np.arange(npages, dtype=np.int64)[None, :]
    return (first, step) if np.array_equal(table, expected) else None
