"""Stopping a streamed inference on SIGTERM/SIGUSR1: every rank leaves the stream, agrees, and nothing is committed.

The stream has no per-micro-batch collective to carry a stop flag (training
has its step decision), and a rank that stops on its own would leave its
pipeline neighbours waiting for it forever. So a rank that sees a stop
signal tells every other rank with a one-integer message on a communicator
of its own (:class:`StopNotice`); every rank checks for it once per
micro-batch and while it waits for a neighbour (:class:`StoppablePoller`),
and leaves the stream with :class:`StreamStopped`. After the stream every
rank, finished or not, takes part in one small agreement (:meth:`StopNotice.agree`):
if any rank left early, all of them discard the output together.

A signal that arrives once this rank's stream is over lets the run finish.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from hpcpipe.errors import EXIT_PREEMPTED, AgreedError
from hpcpipe.runtime.comm import Poller, gather_everyone

NOTICE_TAG = 7575
CANCEL_WAIT_S = 5.0     # a receive that cannot be cancelled completes once its sender moves on; never wait for ever


class StreamStopped(Exception):
    """This rank left the stream early: a stop signal arrived here or on another rank."""


class StopRequested(AgreedError):
    """Every rank agreed to stop on a signal: nothing is committed; the command exits EXIT_PREEMPTED."""

    def __init__(self, message: str):
        super().__init__(message, EXIT_PREEMPTED)


class StoppablePoller(Poller):
    """A Poller whose waits give up with StreamStopped once ``stopped()`` says so (checked between polls)."""

    def __init__(self, min_us: float, max_us: float, stopped: Callable[[], bool]):
        super().__init__(min_us, max_us)
        # loaded by runtime.comm already; bound once for the polling loop
        from mpi4py import MPI
        self._testall = MPI.Request.Testall
        self.stopped = stopped

    def wait(self, requests: list) -> None:
        """Return once every request has completed; raise StreamStopped if a stop comes first."""
        if not requests or self._testall(requests):
            return
        start = time.perf_counter()
        delay = self.min_s
        try:
            while not self._testall(requests):
                if self.stopped():
                    raise StreamStopped
                time.sleep(delay)
                delay = min(delay * 2.0, self.max_s)
        finally:
            self.waited_s += time.perf_counter() - start


class StopNotice:
    """Spreads one rank's stop signal to every rank of comm without a collective (collective to create)."""

    def __init__(self, comm: Any, stop: Any):
        from mpi4py import MPI
        self.comm = comm.Dup()    # a context of its own: the notice never matches a stream message
        self.stop = stop
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.heard_from = np.zeros(1, dtype=np.int64)
        self.inbox = self.comm.Irecv(self.heard_from, MPI.ANY_SOURCE, NOTICE_TAG) if self.size > 1 else None
        self.told: list[Any] = []
        self.heard = False

    def check(self) -> bool:
        """True once this rank got a stop signal (then it tells the others, once) or heard of one (cheap)."""
        self.stop.check_interrupt()   # a Ctrl-C whose KeyboardInterrupt a finalizer swallowed
        if self.stop.requested and not self.told and self.size > 1:
            mine = np.array([self.stop.received], dtype=np.int64)
            self.told = [self.comm.Isend(mine, r, NOTICE_TAG) for r in range(self.size) if r != self.rank]
            self.told.append(mine)   # the buffer lives as long as its sends
        if not self.heard and self.inbox is not None and self.inbox.Test():
            self.heard = True
        return self.heard or self.stop.requested

    def agree(self, poller: Poller, left_early: bool) -> list[tuple[bool, int]]:
        """Return every rank's (left the stream early, signal it received or 0), the same on every rank."""
        return gather_everyone(self.comm, poller, (left_early, int(self.stop.received or 0)))

    def close(self) -> None:
        """Withdraw the unanswered receive and release the communicator (sends of a notice are tiny: left be)."""
        if self.inbox is not None and not self.heard:
            cancel_receive(self.inbox)
        self.comm.Free()


def cancel_receive(request: Any) -> None:
    """Cancel a receive unless it completed, and wait (a bounded time) until MPI has let go of its buffer."""
    if request.Test():   # completed already (a progress call may have finished it): nothing to withdraw
        return
    request.Cancel()
    deadline = time.monotonic() + CANCEL_WAIT_S
    while not request.Test() and time.monotonic() < deadline:
        time.sleep(0.001)


def stop_message(every: list[tuple[bool, int]], output: str, earlier: bool) -> str:
    """The one line rank 0 prints after an agreed stop."""
    signals = [s for _, s in every if s]
    name = signal.Signals(signals[0]).name if signals else "a stop signal"
    kept = "; the earlier file there is unchanged" if earlier else ""
    return (f"hpcpipe: stopped by {name} (received on {len(signals)} of {len(every)} ranks) before the last row: "
            f"nothing written at {output!r}{kept}, the temporary output removed; exit status {EXIT_PREEMPTED} "
            f"(inference keeps no checkpoint: rerun the command to infer again)")
