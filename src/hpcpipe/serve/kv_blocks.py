"""One replica's pool of KV blocks: which block each sequence holds, which are free, cached or shared.

No MPI and no compute: the replica's scheduler (its first stage) decides here, and every stage of the
replica (every tp rank too) is told the resulting block tables in the work items, so they all agree which
KV blocks a sequence writes and reads (hpcpipe.nn.core.kv_pages holds the arrays). Roughly::

    free    never used, or released without a prefix hash           taken first
    cached  released, keyed by the hash of their token prefix       kept for later requests, least recently
            (hpcpipe.serve.prefix_cache), no sequence holds them     used evicted when free runs out
    held    ref-counted: 1 sequence, or several sharing a prefix     back to cached / free at refs 0

A request is admitted only when the pool can give it every block it may ever write (its prompt plus
max_tokens, speculation included): ``reserve`` counts them against free + cached blocks, so a running
sequence never runs out and nothing needs preempting; a request that does not fit waits in the queue.
Blocks are taken from the reservation as the sequence grows (``take``), so blocks a sequence has not
reached yet stay cached for others meanwhile.
"""

from __future__ import annotations

from collections import OrderedDict, deque


class BlockPool:
    """``n`` KV blocks, each free, cached (evictable, keyed by a prefix hash) or held by one or more sequences."""

    def __init__(self, n: int):
        if n < 1:
            raise ValueError(f"a KV-block pool needs at least one block, got {n}")
        self.n = n
        self.free: deque[int] = deque(range(n))
        self.refs = [0] * n
        self.cached: OrderedDict[int, None] = OrderedDict()   # refs 0 and hashed, least recently used first
        self.hash_of: dict[int, bytes] = {}
        self.by_hash: dict[bytes, int] = {}
        self.reserved = 0        # blocks promised to admitted sequences and not taken yet
        self.dirty: set[int] = set()   # blocks a failed sequence left (NaN?): zeroed on every stage before reuse
        self.evictions = 0

    @property
    def available(self) -> int:
        """Blocks a new reservation may count on: free and cached, less those already promised."""
        return len(self.free) + len(self.cached) - self.reserved

    @property
    def in_use(self) -> int:
        """Blocks held by at least one sequence."""
        return sum(1 for r in self.refs if r > 0)

    @property
    def shared(self) -> int:
        """Blocks held by more than one sequence (a prefix computed once, read by several)."""
        return sum(1 for r in self.refs if r > 1)

    def reserve(self, count: int, hits: list[int] = ()) -> bool:
        """Promise ``count`` new blocks and hold the cached blocks ``hits``; False (nothing done) if they do not fit.

        A hit that sits among the cached blocks stops being evictable, so it counts against the pool too.
        """
        idle_hits = sum(1 for b in hits if self.refs[b] == 0)
        if count + idle_hits > self.available:
            return False
        for block in hits:
            self.hold(block)
        self.reserved += count
        return True

    def unreserve(self, count: int) -> None:
        """Give back ``count`` promised blocks that were never taken."""
        self.reserved -= count

    def take(self) -> int:
        """A block from the reservation: a free one, else the least recently used cached one (its hash dropped)."""
        if self.free:
            block = self.free.popleft()
        else:
            block, _ = self.cached.popitem(last=False)
            self.forget(block)
            self.evictions += 1
        self.reserved -= 1
        self.refs[block] = 1
        return block

    def hold(self, block: int) -> None:
        """One more sequence holds ``block`` (a prefix hit)."""
        if self.refs[block] == 0:
            self.cached.pop(block, None)
        self.refs[block] += 1

    def release(self, block: int) -> None:
        """One sequence less holds ``block``; unheld, it is cached (hashed: most recently used) or free."""
        self.refs[block] -= 1
        if self.refs[block] > 0:
            return
        if block in self.hash_of:
            self.cached[block] = None
        else:
            self.free.append(block)

    def register(self, block: int, key: bytes) -> None:
        """Key a full, computed block by the hash of its token prefix (the first block with that key stays)."""
        if key not in self.by_hash and block not in self.hash_of:
            self.by_hash[key] = block
            self.hash_of[block] = key

    def lookup(self, key: bytes) -> int | None:
        """The block keyed ``key``, or None."""
        return self.by_hash.get(key)

    def forget(self, block: int) -> None:
        """Drop ``block``'s key: no later request reuses it."""
        key = self.hash_of.pop(block, None)
        if key is not None:
            del self.by_hash[key]
