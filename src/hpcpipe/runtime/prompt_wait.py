"""How long a collective on the critical path is polled promptly: a yield window that grows with its transfer time.

MPI advances a nonblocking collective only inside its calls. Over TCP a large sum moves in many pieces, each
needing a call on both ranks; once a waiter sleeps between polls (:class:`hpcpipe.runtime.comm.Poller`), every
piece waits for its wake-up (bench/bench_tp_collectives.py, 2 emulated nodes at 10 Gbit/s, 1 MiB: 15.4 ms polled
against 0.71 ms polled by yielding only). So a waiter yields the core between polls for ``yield_s`` (its partners
are about to arrive) plus twice the fastest time this group's earlier collectives of the same size took, which
is their transfer time once every rank is there, at most :data:`MAX_LEARNT_S` (on oversubscribed cores the
fastest wait is a scheduling delay, not a transfer: 8 ranks on 2 cores learnt 10-47 ms windows, which is spinning);
a rank whose partner is later than that ends up sleeping, so waiting ranks never spin for long.
"""

from __future__ import annotations

import time
from collections.abc import Hashable

from hpcpipe.runtime.comm import Poller

# twice a 1 MiB sum's transfer across 10 Gbit/s (0.7-0.8 ms, bench/bench_tp_collectives.py) fits; slower links'
# transfers past it are caught by the poller's re-arm (a poll that moved data yields for the window again)
MAX_LEARNT_S = 0.002


class PromptWait:
    """Waits for one group's collectives through ``poller``, yielding for a window learnt per message size."""

    def __init__(self, poller: Poller, yield_s: float):
        self.poller = poller
        self.yield_s = yield_s
        self.fastest: dict[Hashable, float] = {}   # a collective's kind and bytes -> the shortest wait seen

    def window(self, key: Hashable) -> float:
        """Return the seconds a collective (key: its kind and bytes) is polled by yielding before the waiter sleeps."""
        fastest = self.fastest.get(key)
        # twice the transfer time: room for the partner's arrival within a transfer's length, and for jitter
        return self.yield_s + (min(2.0 * fastest, MAX_LEARNT_S) if fastest is not None else 0.0)

    def record(self, key: Hashable, seconds: float) -> None:
        """Remember that a collective (key: its kind and bytes) took seconds (the fastest is its transfer time)."""
        fastest = self.fastest.get(key)
        if fastest is None or seconds < fastest:
            self.fastest[key] = seconds

    def wait(self, requests: list, key: Hashable) -> None:
        """Return once requests (this rank's part of one collective; key: its kind and bytes) completed; learn
        from how long it took."""
        start = time.perf_counter()
        self.poller.wait(requests, self.window(key))
        self.record(key, time.perf_counter() - start)
