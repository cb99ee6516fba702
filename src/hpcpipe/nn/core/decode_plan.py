"""Where the new tokens of one decode-stage call sit among its rows, checked: rows, positions, slots, attention batch.

A call carries the new tokens of several sequences (:class:`Segment`: slot, start, length) as consecutive
rows; :func:`plan_call` checks them and builds every index the stage needs once per call (on the host and,
for the NumPy attention, as xp arrays): each row's position and slot, the last row of each segment, the
prefill segments, and the decode rows' batched attention (:class:`DecodeBatch`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

# decode slots spread over at most this many times their count are read in place, wider ones gathered
_IN_PLACE_SPAN = 1.5


@dataclass(frozen=True)
class Segment:
    """The new tokens of one sequence in a forward call."""

    slot: int     # KV-cache row of this sequence, 0 <= slot < slots
    start: int    # position of the first new token (= tokens already in the cache for this slot)
    length: int   # new tokens (1 for a decode step, the prompt length for a prefill)


@dataclass
class DecodeBatch:
    """The decode (length-1) segments of a forward call: one batched attention over their slots' caches.

    When their slots lie in a span at most _IN_PLACE_SPAN times their count, attention reads that span of the
    cache in place (a view: no copy) with the queries spread over the span's rows; otherwise it gathers their
    slots' keys and values into a scratch buffer the stage reuses.
    """

    rows: Any        # xp int64 rows of the decode tokens in the call, or None when they are all the rows
    slots: Any       # xp int64 (n,) their slots
    positions: Any   # xp int64 (n,) their tokens' positions
    n: int
    keys: int        # keys attended over: max(position) + 1
    span: slice | None   # the cache rows read in place, or None: gather ``slots``
    gather: Any      # xp int64 (n * kv * keys,) rows of the cache seen as (slots * kv * seq_len, hd) rows, or None
    order: Any       # xp int64 (n,) each token's row in the span, or None when row i is token i
    future: Any      # xp bool (rows attended, 1, 1, keys): True where a key is after the query
    row_positions: Any = None   # xp int64 (rows attended,): the query position of each row (a window's start)


@dataclass
class CallPlan:
    """Where the segments of one forward call sit among its rows, on the host and as xp index arrays."""

    n_rows: int
    positions: np.ndarray                # host int64 (n_rows,): each row's position in its sequence
    row_slots: np.ndarray                # host int64 (n_rows,): each row's slot
    last_rows: Any                       # xp int64 (n_segments,), or None when every row is a segment's last
    prefill: list[tuple[int, Segment]]   # (first row, segment) of each segment longer than 1
    decode: DecodeBatch | None
    dev_positions: Any = None            # xp copy of positions, made on first use (see DecodeStage._positions)


def all_rows(rows: Any) -> Any:
    """Index of the given rows, or of all rows when None."""
    return slice(None) if rows is None else rows


def plan_call(segments: list[Segment], slots: int, seq_len: int, xp: Any, future: Any, n_kv: int,
              attention: bool = True) -> CallPlan:
    """Check the segments and build the row and cache indices one forward call needs (``attention`` False: the
    NumPy attention's batch is not planned, for a compiled stage that attends in C)."""
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
    prefill = [(int(firsts[i]), segments[i]) for i in np.flatnonzero(~is_dec)]
    decode = None
    if is_dec.any() and attention:
        decode = decode_batch(None if all_last else firsts[is_dec], row_slots[firsts[is_dec]], starts[is_dec], xp,
                              future, n_kv, seq_len)
    last_rows = None if all_last else xp.asarray(firsts + lengths - 1)
    return CallPlan(n_rows, positions, row_slots, last_rows, prefill, decode)


def decode_batch(rows: np.ndarray | None, slots: np.ndarray, positions: np.ndarray, xp: Any, future_mask: Any,
                 kv: int, t: int) -> DecodeBatch:
    """Plan the batched attention of the decode tokens at ``rows`` (host arrays) of a forward call."""
    n = slots.size
    keys = int(positions.max()) + 1
    low, span = int(slots.min()), int(slots.max() - slots.min()) + 1
    dev_slots, dev_pos = xp.asarray(slots), xp.asarray(positions)
    future = future_mask[dev_pos, :keys]
    if span > _IN_PLACE_SPAN * n:
        # every (slot, kv head) pair's first ``keys`` positions, as rows of head_dim values: one take per array
        gather = (((slots[:, None] * kv + np.arange(kv))[:, :, None] * t) + np.arange(keys)).reshape(-1)
        return DecodeBatch(None if rows is None else xp.asarray(rows), dev_slots, dev_pos, n, keys, None,
                           xp.asarray(gather), None, future.reshape(n, 1, 1, keys), dev_pos)
    order, row_positions = None, dev_pos
    if span != n or (slots != np.arange(low, low + span)).any():
        order = xp.asarray(slots - low)
        row_positions = xp.zeros(span, dtype=np.int64)      # rows without a query: position 0, key 0 only
        row_positions[order] = dev_pos
        # the span's rows without a query attend to key 0 only: finite, and dropped afterwards
        spread = xp.ones((span, keys), dtype=bool)
        spread[:, 0] = False
        spread[order] = future
        future = spread
    return DecodeBatch(None if rows is None else xp.asarray(rows), dev_slots, dev_pos, n, keys,
                       slice(low, low + span), None, order, future.reshape(span, 1, 1, keys), row_positions)
