"""The KV blocks of each sequence of a replica: admission by reservation, growth, prefix hits, release.

The scheduler's bookkeeping between its sequences and the replica's :class:`~hpcpipe.serve.kv_blocks.BlockPool`
(no MPI, no compute). Roughly, per sequence::

    admit:    hits = the cached blocks of the prompt's prefix (hpcpipe.serve.prefix_cache), at most those
              before the block of the last prompt token; reserve every other block the sequence may
              write (prompt + max_tokens, capped by the context), or wait in the queue
    grow:     before a work item writes positions up to ``end``, take blocks from the reservation
              -> the table update (slot, first block index, block ids) every stage applies
    computed: once positions [0, cached) are in every stage's cache, key the full blocks among them
    release:  give back the untaken reservation and the blocks (hashed ones stay cached, LRU)
    fail:     a failed sequence's own blocks may hold NaN: unkeyed, and zeroed before their next use
    trim:     under a sliding window on every block, once positions [0, cached) are computed, the blocks wholly
              before position cached - window + 1 (the oldest key a later query sees) go back to the pool
              (hashed ones stay cached), their table entries then name a block the sequence still holds

With a window a sequence commits at most ``span`` blocks (:func:`hpcpipe.nn.core.kv_pages.held_pages`): held +
reserved stays min(span, blocks it has yet to drop or write), a trimmed block's place in the reservation is
promised again, and a work item writes no further than ``room`` (the scheduler cuts a prompt chunk there and
waits for its items in flight): the pool never runs short and a sequence of any length fits ``span`` blocks.

A model mixing windowed and full-attention blocks (``ring``: the windowed blocks' window) keeps every block of
the pool (its full blocks read them all), while its windowed blocks keep their keys in a ring of ``ring_span``
blocks per slot (hpcpipe.nn.core.kv_pages.ring_layout): ``room`` then stops a work item at the ring's end, so no
write lands on a ring block a query still reads. A ring holds one sequence's keys only, so such a model finds no
prefix hits (a hit's windowed keys are in another slot's ring).
"""

from __future__ import annotations

from typing import Any

from hpcpipe.nn.core.kv_pages import held_pages
from hpcpipe.serve.kv_blocks import BlockPool
from hpcpipe.serve.prefix_cache import PrefixStats, prefix_keys

TableUpdate = tuple[int, int, list[int]]      # (slot, first block index, KV block ids)


class KVLedger:
    """Block tables of one replica's sequences over a pool of ``blocks`` KV blocks of ``page`` positions."""

    def __init__(self, blocks: int, page: int, seq_len: int, prefix_cache: bool = True, window: int = 0,
                 ahead: int = 0, ring: int = 0, ring_span: int = 0):
        self.span = held_pages(seq_len, page, window, ahead)      # blocks one sequence holds at most at once
        # a ring's blocks per slot: as the stages allocate it (hpcpipe.nn.memory.ring_pages), at least the window's
        self.ring, self.ring_span = ring, max(ring_span, held_pages(seq_len, page, ring, ahead)) if ring else 0
        if blocks < self.span:
            what = f"one context of {seq_len} tokens" if not window else \
                f"one sequence's {window}-token sliding window ({self.span} blocks)"
            raise ValueError(f"{blocks} KV blocks of {page} positions cannot hold {what}")
        self.pool = BlockPool(blocks)
        self.page, self.seq_len, self.window = page, seq_len, window
        self.prefix_cache = prefix_cache and not ring
        self.stats = PrefixStats()

    def blocks_for(self, positions: int) -> int:
        """KV blocks holding ``positions`` positions."""
        return -(-positions // self.page)

    def admit(self, seq: Any, extra: int = 0) -> bool:
        """Give ``seq`` its prefix hits and reserve the rest of its blocks; False: it does not fit now (it waits).

        ``extra``: positions speculation may write past the last token the sequence keeps.
        """
        request = seq.request
        prompt = list(request.prompt)
        limit = min(self.seq_len, len(prompt) + max(request.max_new, 0) + extra)
        keys: list[bytes] = []
        hits: list[int] = []
        # echo with logprobs needs every prompt row's logits: nothing of its prompt may be skipped
        if self.prefix_cache and not request.params.prompt_logprobs:
            for key in prefix_keys(prompt, self.page, (len(prompt) - 1) // self.page):
                block = self.pool.lookup(key)
                if block is None:
                    break
                keys.append(key)
                hits.append(block)
        # hits wholly before the first new token's window are never read: not held (their keys still chain)
        dropped = self._before_window(len(hits) * self.page)
        need = min(self.blocks_for(limit) - dropped, self.span) - (len(hits) - dropped)
        if not self.pool.reserve(need, hits[dropped:]):
            return False
        seq.blocks, seq.keys, seq.reserved, seq.dropped = hits, keys, need, dropped
        seq.limit = limit
        seq.cached = seq.sent = len(hits) * self.page
        self.stats.count(len(prompt), seq.cached)
        return True

    def _before_window(self, cached: int, window: int | None = None) -> int:
        """Blocks wholly before the window of a query at position ``cached`` (0 without a window)."""
        window = self.window if window is None else window
        return max(0, (cached - window + 1) // self.page) if window else 0

    def room(self, seq: Any) -> int:
        """Positions [0, room) ``seq`` may write now without holding more than ``span`` blocks (nor writing past
        its ring, on a ring block the next query still reads)."""
        room = self.seq_len if not self.window else (seq.dropped + self.span) * self.page
        if self.ring:
            room = min(room, (self._before_window(seq.cached, self.ring) + self.ring_span) * self.page)
        return room

    def trim(self, seq: Any) -> None:
        """Give back the blocks of ``seq`` wholly before the window of its next query (position ``seq.cached``),
        and promise their places in its reservation again while it has blocks left to write."""
        drop = min(self._before_window(seq.cached), len(seq.blocks))
        if drop <= seq.dropped:
            return
        for block in seq.blocks[seq.dropped:drop]:
            self.pool.release(block)
        seq.dropped = drop
        seq.retable = True
        reserved = min(self.blocks_for(seq.limit) - drop, self.span) - (len(seq.blocks) - drop)
        self.pool.reserved += reserved - seq.reserved
        seq.reserved = reserved

    def redirect(self, seq: Any) -> TableUpdate | None:
        """After a trim: the update pointing the dropped blocks' table entries at the first block ``seq`` holds
        (they are masked, but must never name a block another sequence may fill with NaN); else None."""
        if not seq.retable or seq.dropped >= len(seq.blocks):
            return None
        seq.retable = False
        return (seq.slot, 0, [seq.blocks[seq.dropped]] * seq.dropped)

    def grow(self, seq: Any, end: int) -> TableUpdate | None:
        """Take blocks so that ``seq`` holds positions [0, end); the table update, or None when it already does."""
        want = self.blocks_for(end)
        have = len(seq.blocks)
        if want <= have:
            return None
        if want - have > seq.reserved:
            raise RuntimeError(f"sequence {seq.request.id} writes position {end - 1} past its reservation "
                               f"({have + seq.reserved} blocks)")
        new = [self.pool.take() for _ in range(want - have)]
        seq.reserved -= len(new)
        seq.blocks.extend(new)
        return (seq.slot, have, new)

    def first_table(self, seq: Any) -> TableUpdate | None:
        """The table update naming every block ``seq`` holds now (its prefix hits) when it starts, or None
        (entries of blocks dropped before the window name its first held block)."""
        if seq.dropped >= len(seq.blocks):
            return None
        seq.retable = False
        return (seq.slot, 0, [seq.blocks[seq.dropped]] * seq.dropped + seq.blocks[seq.dropped:])

    def computed(self, seq: Any) -> None:
        """Key the full blocks of ``seq`` whose positions every stage has computed (``seq.cached``)."""
        if not self.prefix_cache:
            return
        full = min(seq.cached, len(seq.tokens)) // self.page
        if full <= len(seq.keys):
            return
        start = len(seq.keys)
        keys = prefix_keys(seq.tokens, self.page, full, seq.keys[-1] if seq.keys else b"", start)
        for i, key in enumerate(keys, start):
            self.pool.register(seq.blocks[i], key)
        seq.keys.extend(keys)

    def release(self, seq: Any) -> None:
        """Give back everything ``seq`` holds and was promised."""
        self.pool.unreserve(seq.reserved)
        seq.reserved = 0
        for block in seq.blocks[seq.dropped:]:
            self.pool.release(block)
        seq.blocks, seq.dropped = [], 0

    def fail(self, seq: Any) -> None:
        """``seq`` failed (non-finite logits): its unshared blocks are unkeyed and zeroed before their next use."""
        for block in seq.blocks[seq.dropped:]:
            if self.pool.refs[block] == 1:
                self.pool.forget(block)
                self.pool.dirty.add(block)

    def to_clear(self, update: TableUpdate | None) -> list[int]:
        """The blocks of a table update that a failed sequence left dirty (to be zeroed first), now clean."""
        if update is None:
            return []
        dirty = [b for b in update[2] if b in self.pool.dirty]
        self.pool.dirty.difference_update(dirty)
        return dirty

    def numbers(self) -> tuple[int, ...]:
        """The pool's and the prefix cache's numbers, in the order of hpcpipe.serve.engine_stats.STATS."""
        pool, stats = self.pool, self.stats
        return (pool.n, pool.in_use, pool.shared, len(pool.hash_of), pool.evictions, stats.queries, stats.hits,
                stats.queried_tokens, stats.cached_tokens)
