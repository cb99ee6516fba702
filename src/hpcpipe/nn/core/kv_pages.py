"""A paged KV cache's geometry: fixed-size KV blocks from one pool per stage, a block table per sequence slot.

Per layer block of a stage the cache holds keys and values of shape ``(n_kv_heads, pages, page, head_dim)``:
``pages`` KV blocks of ``page`` positions each, shared by every sequence of the stage. A sequence (a slot)
holds a list of KV blocks, its row of ``tables``: position t of the sequence lives in KV block
``tables[slot, t // page]`` at offset ``t % page``. Who owns which KV block is decided elsewhere (the
serving scheduler, hpcpipe.serve.kv_blocks); every stage of a pipeline (and every tp rank of a stage) is told
the same tables, so the stages agree which KV blocks a sequence reads (a prefix another sequence computed,
hpcpipe.serve.prefix_cache). Without a pool size the cache holds every slot's whole context, and each slot
starts with its own KV blocks (slot s: blocks s * max_pages ..), which is today's contiguous cache cut in
pages: callers that never set a table keep working.

Under a sliding window on every block (Mistral v0.1) a sequence's blocks wholly before its next token's window
are never read again: the scheduler gives them back to the pool and points their table entries at a block the
sequence still holds (finite values, masked), so a sequence holds :func:`held_pages` blocks at most.

A model mixing windowed and full-attention blocks (Qwen2's max_window_layers, layer_types) keeps its full blocks'
keys in the pool and its windowed blocks' in a ring per slot (:func:`ring_layout`): ``ring`` KV blocks of their
own, block i of a sequence in the slot's ring block ``i % ring``, a fixed table no one updates. The scheduler
never lets a work item write past the ring's room (hpcpipe.serve.kv_ledger.room), so a block a query still reads
is never overwritten; those layers then hold ``slots x ring`` blocks, not ``slots`` whole contexts.

A host (NumPy) cache is reserved, not filled: its memory is anonymous pages the kernel commits on the first
write, so a rank holds the KV blocks its sequences have written, not the whole context's (a 32-token run of a
30-block model with an 8192-position context: ~1.4 MB of 377 MB). NumPy's own large arrays ask for huge pages
(2 MiB), and one written position per (layer, key/value, head) then committed the whole cache.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hpcpipe.kernels.mapped import mapped_zeros


class PagedLayout:
    """KV blocks of ``page`` positions, ``pages`` of them in the pool, a table of ``max_pages`` per slot."""

    def __init__(self, slots: int, seq_len: int, page: int = 16, pages: int | None = None):
        for name, value in (("slots", slots), ("seq_len", seq_len), ("KV block size", page)):
            if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 1:
                raise ValueError(f"decode stage {name} must be a positive integer, got {value!r}")
        self.slots, self.seq_len, self.page = int(slots), int(seq_len), int(page)
        self.max_pages = -(-self.seq_len // self.page)            # KV blocks one whole context needs
        whole = self.slots * self.max_pages
        self.pages = whole if pages is None else pages
        if not isinstance(self.pages, int | np.integer) or isinstance(self.pages, bool) or self.pages < 1:
            raise ValueError(f"decode stage KV blocks must be a positive integer, got {pages!r}")
        self.pages = int(self.pages)
        # each slot owns its own blocks when the pool can hold them all (a caller that never sets a table)
        self.tables = np.zeros((self.slots, self.max_pages), dtype=np.int64)
        if self.pages >= whole:
            self.tables[:] = np.arange(whole, dtype=np.int64).reshape(self.slots, self.max_pages)

    def allocate(self, xp: Any, dtype: Any, n_blocks: int, kv: int, head_dim: int) -> Any:
        """The zeroed cache of ``n_blocks`` layer blocks: (n_blocks, 2, kv, pages, page, head_dim)."""
        shape = (n_blocks, 2, kv, self.pages, self.page, head_dim)
        return mapped_zeros(shape, dtype, huge=False) if xp is np else xp.zeros(shape, dtype=dtype)

    def set_pages(self, slot: int, first: int, pages: list[int]) -> None:
        """Give ``slot`` the KV blocks ``pages`` as its blocks ``first``, ``first + 1``, ..., checked."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"decode stage: slot {slot} out of range 0..{self.slots - 1}")
        if first < 0 or first + len(pages) > self.max_pages:
            raise ValueError(f"decode stage: KV blocks {first}..{first + len(pages) - 1} of slot {slot} exceed the "
                             f"{self.max_pages} a sequence of {self.seq_len} positions holds")
        ids = np.asarray(pages, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.pages):
            raise ValueError(f"decode stage: KV block {int(ids.min() if ids.min() < 0 else ids.max())} out of range "
                             f"0..{self.pages - 1}")
        self.tables[slot, first:first + ids.size] = ids

    def where(self, slots: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The KV block and offset of each (slot, position) pair (host int64 arrays)."""
        return self.tables[slots, positions // self.page], positions % self.page

    def pages_of(self, slot: int, end: int) -> np.ndarray:
        """The KV blocks holding positions [0, end) of ``slot`` (host int64)."""
        return self.tables[slot, :-(-end // self.page)]


def sequence_window(model: Any) -> int:
    """The sliding window every block of ``model`` attends within (the largest of them), or 0 when some block
    sees the whole context: only then may a sequence's KV blocks before the window go back to the pool."""
    windows = [model.window(i) for i in range(1, model.shape.n_blocks + 1)]
    return max(windows) if windows and min(windows) > 0 else 0


def joint_window(*windows: int) -> int:
    """The window of models sharing one block table (a model and its draft): 0 when any sees the whole context."""
    return max(windows) if windows and min(windows) > 0 else 0


def held_pages(seq_len: int, page: int, window: int = 0, ahead: int = 0) -> int:
    """KV blocks one sequence holds at most at once: its whole context, or under a sliding ``window`` (every
    block's) the blocks of ``window + ahead`` positions and two more (the block a window starts in, the block a
    new token opens), ``ahead``: tokens a verified speculation writes past the next one."""
    whole = -(-seq_len // page)
    return whole if not window else min(whole, -(-(window + ahead) // page) + 2)


def mixed_window(model: Any) -> int:
    """The window of the windowed blocks of a model that also has full-attention blocks (their keys then go in
    per-slot rings: :func:`ring_layout`), or 0 (no window, or a window on every block: :func:`sequence_window`)."""
    windows = [model.window(i) for i in range(1, model.shape.n_blocks + 1)]
    return max(windows) if windows and min(windows) == 0 else 0


def ring_layout(slots: int, seq_len: int, page: int, ring: int) -> PagedLayout:
    """The fixed layout of the windowed blocks' rings: slot s's block i in KV block ``s * ring + i % ring``."""
    layout = PagedLayout(slots, seq_len, page, slots * ring)
    layout.tables[:] = np.arange(slots, dtype=np.int64)[:, None] * ring + \
        np.arange(layout.max_pages, dtype=np.int64)[None, :] % ring
    return layout


def stage_rings(kv_ring: int, windows: list[int], slots: int, seq_len: int, page: int) -> PagedLayout | None:
    """A decode stage's ring layout for its windowed blocks (``windows``: each local block's window, 0 for none)
    when ``kv_ring`` asks for one and the stage has such a block (None otherwise), checked: a ring holds at least the
    KV blocks one window's keys span and the block a new token opens."""
    if not isinstance(kv_ring, int | np.integer) or isinstance(kv_ring, bool) or kv_ring < 0:
        raise ValueError(f"decode stage: kv_ring must be a non-negative integer, got {kv_ring!r}")
    window = max(windows, default=0)
    if not kv_ring or not window:
        return None
    least = held_pages(seq_len, page, window)
    if kv_ring < least:
        raise ValueError(f"decode stage: a ring of {kv_ring} KV blocks of {page} positions cannot hold "
                         f"a {window}-token sliding window (at least {least} blocks)")
    return ring_layout(slots, seq_len, page, int(kv_ring))
