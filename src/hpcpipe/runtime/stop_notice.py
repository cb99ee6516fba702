"""Telling every rank of a communicator that one of them got a stop signal, without a collective.

A streamed inference has no per-micro-batch collective to carry a stop flag
(training has its step decision), and a rank that stopped on its own would
leave its pipeline neighbours waiting for it forever. So a rank that sees a
stop signal sends a one-integer notice to every other rank on a communicator
of its own (:class:`StopNotice`); every rank checks for it between units of
work and while it waits for a neighbour (:class:`StoppablePoller`), leaving
with :class:`StreamStopped`. Afterwards every rank, finished or not, takes
part in one small agreement (:meth:`StopNotice.agree`). The MPI calls live
here, in the runtime layer; :mod:`hpcpipe.infer.stop_outcome` uses them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from hpcpipe.runtime.comm import Poller, gather_everyone

if TYPE_CHECKING:
    from mpi4py.MPI import Comm

NOTICE_TAG = 7575
CANCEL_WAIT_S = 5.0     # a receive that cannot be cancelled completes once its sender moves on; never wait for ever


class StreamStopped(Exception):
    """This rank left the stream early: a stop signal arrived here or on another rank."""


class StoppablePoller(Poller):
    """A Poller whose waits give up with StreamStopped once ``stopped()`` says so (checked between polls)."""

    def __init__(self, min_us: float, max_us: float, stopped: Callable[[], bool]):
        super().__init__(min_us, max_us)
        self.stopped = stopped

    def between_polls(self) -> None:
        """Raise StreamStopped if a stop signal came here or on another rank."""
        if self.stopped():
            raise StreamStopped


class StopNotice:
    """Spreads one rank's stop signal to every rank of comm without a collective (collective to create)."""

    def __init__(self, comm: Comm, stop: Any):
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
