"""The tensor-parallel ranks of one stage as the layers use them: in-place sums and maxima over tp_comm.

The layers (:mod:`hpcpipe.nn.core.tensor_parallel`) call ``sum_`` after a row-parallel product, for a
column-parallel input gradient and in the vocabulary-parallel lookup and loss; every call is on the
critical path of its micro-batch, so each is timed (``seconds``, reported as ``tp_comm_s``) and, with
tracing on, recorded. MPI is reached through :mod:`hpcpipe.runtime.comm`; waiting polls, never spins.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from hpcpipe.runtime.comm import MPI, Poller
from hpcpipe.runtime.prompt_wait import PromptWait
from hpcpipe.runtime.wire import WireBytes

if TYPE_CHECKING:
    from mpi4py.MPI import Comm

    from hpcpipe.runtime.backend import Backend

# a tp collective's partners are normally computing the same layer: poll by yielding the core this long, plus
# twice the collective's learnt transfer time (runtime.prompt_wait), before sleeping (measured on 2 ranks, 576
# floats: sleeping polls 0.9 ms, yielding 0.1-0.4 ms a collective)
YIELD_S = 0.0005


class TPGroup:
    """In-place reductions over the tp ranks of a stage (comm), timed."""

    def __init__(self, comm: Comm, backend: Backend, poller: Poller, wire: WireBytes | None = None):
        self.comm, self.backend, self.poller = comm, backend, poller
        self.prompt = PromptWait(poller, YIELD_S)    # polled promptly while a transfer of that size may run
        self.wire = wire if wire is not None else WireBytes()    # the bytes of every reduction (ring model)
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        self.seconds = 0.0       # spent in reductions since the last reset (the step's tp_comm_s)
        self.calls = 0
        self.host_device_bytes = 0   # on the GPU: arrays staged through host memory (both ways)
        # (start, end, thread CPU seconds) of each reduction when tracing: the CPU is its polling, which the
        # planner's calibration takes out of the compute around it (plan.engine_calibration)
        self.events: list[tuple[float, float, float]] | None = None

    def _reduce(self, x: Any, op: Any) -> Any:
        if self.size == 1:
            return x
        start, cpu = time.perf_counter(), time.thread_time()
        on_gpu = self.backend.on_gpu and not isinstance(x, np.ndarray)
        if on_gpu:
            self.backend.synchronize()
            wire = x.get()       # staged through the host: the PyPI MPI wheels are not CUDA-aware
        else:
            wire = x if x.flags.c_contiguous else np.ascontiguousarray(x)
        self.prompt.wait([self.comm.Iallreduce(MPI.IN_PLACE, wire, op=op)], ("reduce", wire.nbytes))
        self.wire.allreduce(self.comm, wire.nbytes)
        if on_gpu:
            x[...] = self.backend.xp.asarray(wire)
            self.host_device_bytes += 2 * x.nbytes
        elif wire is not x:
            x[...] = wire
        end = time.perf_counter()
        self.seconds += end - start
        self.calls += 1
        if self.events is not None:
            self.events.append((start, end, time.thread_time() - cpu))
        return x

    def sum_(self, x: Any) -> Any:
        """Replace x with its element-wise sum over the tp ranks; return x."""
        return self._reduce(x, MPI.SUM)

    def max_(self, x: Any) -> Any:
        """Replace x with its element-wise maximum over the tp ranks; return x."""
        return self._reduce(x, MPI.MAX)

    def gather_columns(self, x: Any, widths: list[int]) -> Any:
        """Return the tp ranks' column blocks of x (rows, widths[rank]) side by side on tp rank 0, None elsewhere.

        A vocabulary-parallel head's logits: rank r holds the columns of token ids [lo_r, hi_r), in rank order.
        """
        host = np.ascontiguousarray(self.backend.to_host(x))
        if self.backend.on_gpu:
            self.host_device_bytes += host.nbytes
        if self.size == 1:
            return host
        start = time.perf_counter()
        rows = host.shape[0]
        counts = [rows * w for w in widths]
        offsets = list(np.cumsum([0] + counts[:-1]))
        flat = np.empty(sum(counts), dtype=host.dtype) if self.rank == 0 else None
        self.prompt.wait([self.comm.Igatherv(host, [flat, (counts, offsets)] if flat is not None else None, root=0)],
                         ("gather", host.nbytes))
        if self.rank:
            self.wire.p2p(self.comm, 0, host.nbytes)
        self.seconds += time.perf_counter() - start
        if flat is None:
            return None
        return np.concatenate([flat[o:o + c].reshape(rows, w) for o, c, w in zip(offsets, counts, widths, strict=True)],
                              axis=1)

    def gather(self, obj: Any) -> list | None:
        """Return every tp rank's obj on tp rank 0 (None elsewhere): saving assembles whole tensors from parts."""
        return self.comm.gather(obj, root=0)

    def take_seconds(self) -> float:
        """Return the seconds spent in reductions since the last call, and start counting again."""
        spent, self.seconds = self.seconds, 0.0
        return spent
