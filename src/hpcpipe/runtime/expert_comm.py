"""The expert-parallel ranks of one stage as the sparse layers use them: all-to-all of token rows over ep_comm.

A mixture-of-experts layer sends each token row to the rank owning its expert and the results back
(:mod:`hpcpipe.nn.core.expert_parallel`). Per exchange the rows' counts go first (``exchange_counts``, an
Alltoall of small integers) so that every rank can size its receive buffer, then the rows themselves
(``exchange_rows``, an Alltoallv). Both are non-blocking calls waited on by the poller (a waiting rank
sleeps, never spins: 8 ranks may share 2 cores); both are on the micro-batch's critical path, so each is
timed (``seconds``: the step's ``ep_comm_s``) and, with tracing on, recorded. CuPy arrays are staged through
host memory (the PyPI MPI wheels are not CUDA-aware).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from hpcpipe.runtime.comm import MPI, Poller
from hpcpipe.runtime.prompt_wait import PromptWait

if TYPE_CHECKING:
    from mpi4py.MPI import Comm

    from hpcpipe.runtime.backend import Backend

# the ep peers compute the same layer of the same micro-batch: poll by yielding the core this long first
YIELD_S = 0.0005


def size_class(nbytes: int) -> int:
    """The power of two at or above nbytes: exchanges whose sizes vary with the routing learn one window per class."""
    return 1 << max(int(nbytes) - 1, 0).bit_length()


class ExpertGroup:
    """The ep ranks of a stage (comm): timed all-to-all exchanges of counts and of token rows."""

    def __init__(self, comm: Comm, backend: Backend, poller: Poller, wire: Any = None):
        self.comm, self.backend, self.poller = comm, backend, poller
        self.prompt = PromptWait(poller, YIELD_S)     # polled promptly while a transfer of that size may run
        self.wire = wire      # a runtime.wire.WireBytes counting every message (the metrics' sent_bytes), or None
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        self.seconds = 0.0        # spent in exchanges since the last reset (the step's ep_comm_s)
        self.calls = 0
        self.bytes_sent = 0
        self.host_device_bytes = 0
        self.events: list[tuple[float, float]] | None = None    # (start, end) of each exchange when tracing

    def _timed(self, start: float) -> None:
        end = time.perf_counter()
        self.seconds += end - start
        self.calls += 1
        if self.events is not None:
            self.events.append((start, end))

    def exchange_counts(self, counts: np.ndarray) -> np.ndarray:
        """Send row r of ``counts`` (size, m) int64 to ep rank r; return (size, m): row s what rank s sent here."""
        start = time.perf_counter()
        send = np.ascontiguousarray(counts, dtype=np.int64)
        recv = np.empty_like(send)
        self.prompt.wait([self.comm.Ialltoall(send, recv)], ("counts", send.nbytes))
        self._timed(start)
        return recv

    def exchange_rows(self, rows: Any, send_rows: list[int], recv_rows: list[int]) -> Any:
        """Send ``rows`` (n, width), the first send_rows[0] to rank 0, the next send_rows[1] to rank 1, ...; return
        the (sum(recv_rows), width) rows received, rank 0's first (an Alltoallv)."""
        start = time.perf_counter()
        xp = self.backend.xp
        on_gpu = self.backend.on_gpu and not isinstance(rows, np.ndarray)
        if on_gpu:
            self.backend.synchronize()
            wire = rows.get()
            self.host_device_bytes += wire.nbytes
        else:
            wire = np.ascontiguousarray(rows)
        width = int(np.prod(wire.shape[1:])) if wire.ndim > 1 else 1
        out = np.empty((sum(recv_rows), *wire.shape[1:]), dtype=wire.dtype)
        send_counts = [n * width for n in send_rows]
        recv_counts = [n * width for n in recv_rows]
        send_displs = np.concatenate([[0], np.cumsum(send_counts)[:-1]]).astype(int).tolist()
        recv_displs = np.concatenate([[0], np.cumsum(recv_counts)[:-1]]).astype(int).tolist()
        self.prompt.wait([self.comm.Ialltoallv([wire.reshape(-1), (send_counts, send_displs)],
                                               [out.reshape(-1), (recv_counts, recv_displs)])],
                         ("rows", size_class(max(wire.nbytes, out.nbytes))))
        self.bytes_sent += wire.nbytes - send_rows[self.rank] * width * wire.itemsize
        if self.wire is not None:
            for peer, n in enumerate(send_rows):
                if peer != self.rank and n:
                    self.wire.p2p(self.comm, peer, n * width * wire.itemsize)
        if on_gpu:
            self.host_device_bytes += out.nbytes
            out = xp.asarray(out)
        self._timed(start)
        return out

    def agree(self, values: Any) -> np.ndarray:
        """Return the element-wise sums of a small host vector over the ep ranks (serving's lockstep: which replicas
        launch work this step, which are done); every ep rank calls it once a step."""
        out = np.array(values, dtype=np.float64)
        self.poller.wait([self.comm.Iallreduce(MPI.IN_PLACE, out, op=MPI.SUM)])
        return out

    def gather(self, obj: Any) -> list | None:
        """Every ep rank's picklable object on ep rank 0 (None elsewhere): checkpoints and tests, not the hot path."""
        return self.comm.gather(obj, root=0)

    def take_seconds(self) -> float:
        """Return the seconds spent in exchanges since the last reset, and start counting again."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds
