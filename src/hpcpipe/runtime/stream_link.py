"""Persistent point-to-point requests that stream inference micro-batches through fixed buffers (runtime layer)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from hpcpipe.runtime.comm import MPI, Poller

if TYPE_CHECKING:
    from mpi4py.MPI import Comm


class StreamLink:
    """Persistent requests streaming micro-batches through fixed slot buffers to or from one pipeline neighbour.

    Inference moves every micro-batch through the same few buffers, so each
    slot gets one persistent request (``Send_init`` / ``Recv_init``) made
    once; :meth:`start` restarts it and :meth:`wait` completes it, with no
    allocation per micro-batch. Messages between one pair of ranks on one tag
    are non-overtaking, so slot k carries micro-batches k, k+S, k+2S, ...
    Buffers must be host (NumPy) arrays.

    Roughly, a sender::

        wait(slot)            # the send of micro-batch i - S has left this slot
        compute into buffers[slot]
        start(slot)           # Isend of micro-batch i overlaps the compute of i + 1
    """

    def __init__(self, comm: Comm, peer: int, buffers: list[np.ndarray], tag: int, send: bool, poller: Poller):
        for buf in buffers:
            if not isinstance(buf, np.ndarray) or not buf.flags.c_contiguous:
                raise TypeError("StreamLink buffers must be C-contiguous NumPy arrays")
        self.buffers = buffers
        self.poller = poller
        init = comm.Send_init if send else comm.Recv_init
        self.requests = [init(buf, peer, tag) for buf in buffers]
        self._one = [[r] for r in self.requests]      # preallocated argument lists for Poller.wait
        self.active = [False] * len(buffers)
        self.waited_s = 0.0

    def start(self, slot: int) -> None:
        """Start the transfer of buffers[slot] (a send, or a receive into it)."""
        self.requests[slot].Start()
        self.active[slot] = True

    def wait(self, slot: int) -> float:
        """Complete the transfer on slot (no-op when none is active); return the seconds spent waiting."""
        if not self.active[slot]:
            return 0.0
        before = self.poller.waited_s
        self.poller.wait(self._one[slot])
        self.active[slot] = False
        waited = self.poller.waited_s - before
        self.waited_s += waited
        return waited

    def progress(self) -> None:
        """Let MPI move data of active transfers (call between compute kernels; never blocks)."""
        MPI.Request.Testall(self.requests)
        # Testall completes all or none; a completed persistent request is inactive and waits instantly

    def wait_all(self) -> None:
        """Complete every active transfer."""
        for slot in range(len(self.requests)):
            self.wait(slot)

    def free(self) -> None:
        """Complete, then release the persistent requests."""
        self.wait_all()
        for r in self.requests:
            r.Free()
        self.requests = []
