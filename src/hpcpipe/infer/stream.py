"""Forward-only streaming of micro-batches through one pipeline stage: fill, steady state, drain.

Each rank runs its stage's layers over its replica's micro-batches in order.
No activation is stashed and no gradient exists, so a stage keeps only S
slot buffers (infer.buffers, default 2) per side and every array is
allocated before the first micro-batch: the matmuls write with ``out=``,
activations work in place, sends and receives are persistent requests on
the slot buffers (:class:`hpcpipe.runtime.comm.StreamLink`).

Roughly, for micro-batch k of this rank (slot = k mod S)::

    input:   first stage reads its rows from HDF5 into in[slot];
             others wait for the receive into in[slot] (posted S micro-batches ago)
    reuse:   wait until the send of micro-batch k - S has left out[slot]
    compute: layers in[slot] -> ... -> out[slot], letting MPI progress between layers
    repost:  start the receive of micro-batch k + S into in[slot]
    output:  start the send of out[slot] (it overlaps the compute of k + 1),
             or, on the last stage, write the rows to the output file

Stage s starts its first micro-batch once s stages have each computed one
(fill), then every stage computes while its neighbours' messages move
(steady state), and the last stage finishes the pp - 1 micro-batch-stages
after the first stage has stopped (drain). A stage runs ahead of the next by
at most S micro-batches.
Per micro-batch the loop records five timestamps (see EVENT_FIELDS) into a
preallocated array for the report and the trace.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from hpcpipe.infer.rows import RowReader, RowWriter, micro_batch_rows
from hpcpipe.nn.core.activations import Activation
from hpcpipe.runtime.stop_notice import StreamStopped, cancel_receive
from hpcpipe.runtime.stream_link import StreamLink

if TYPE_CHECKING:
    from mpi4py.MPI import Comm

# per micro-batch: input started, input ready, output slot free (compute start), compute end, output done
EVENT_FIELDS = ("input_start", "input_end", "compute_start", "compute_end", "output_end")


class ForwardChain:
    """One stage's layers, forward only, computing from in_bufs[slot] into out_bufs[slot] without allocating.

    ``layers`` is [(weight, bias or None, activation)] in order. For every
    slot and for the full and partial row counts the chain of views is built
    once, so :meth:`compute` only calls kernels.
    """

    def __init__(self, layers: list[tuple[np.ndarray, np.ndarray | None, Activation]], batch: int,
                 tail_rows: int, in_bufs: list[np.ndarray], out_bufs: list[np.ndarray], dtype: Any):
        # parameters in the buffers' dtype: a mixed-dtype matmul would allocate a temporary every call
        layers = [(np.ascontiguousarray(w, dtype=dtype), None if b is None else np.ascontiguousarray(b, dtype=dtype),
                   act) for w, b, act in layers]
        widths = [w.shape[1] for w, _, _ in layers]
        inner = max(widths[:-1], default=0)
        scratch_width = max(widths) if any(act.name == "gelu" for _, _, act in layers) else 0
        self.inter = [np.zeros(batch * inner, dtype=dtype) for _ in range(2 if len(layers) > 2 else 1)] \
            if len(layers) > 1 else []
        self.scratch = np.zeros(batch * scratch_width, dtype=dtype)
        # biases repeated over the rows once: adding a broadcast (out,) vector makes NumPy allocate an
        # iteration buffer on every call, adding a same-shape array does not
        self.bias_rows = [None if b is None else np.ascontiguousarray(np.broadcast_to(b, (batch, b.shape[0])))
                          for _, b, _ in layers]
        row_counts = {batch} | ({tail_rows} if 0 < tail_rows < batch else set())
        self.plans: dict[tuple[int, int], list[tuple]] = {}
        for slot in range(len(in_bufs)):
            for rows in row_counts:
                steps = []
                x = in_bufs[slot][:rows]
                for j, (w, b, act) in enumerate(layers):
                    width = w.shape[1]
                    if j == len(layers) - 1:
                        z = out_bufs[slot][:rows]
                    else:
                        z = self.inter[j % 2][:rows * width].reshape(rows, width)
                    sc = self.scratch[:rows * width].reshape(rows, width) if scratch_width else None
                    steps.append((x, w, None if b is None else self.bias_rows[j][:rows], act, z, sc))
                    x = z
                self.plans[(slot, rows)] = steps

    def compute(self, slot: int, rows: int, progress: Callable[[], None]) -> None:
        """Run every layer on the first `rows` rows of in_bufs[slot] into out_bufs[slot]."""
        for x, w, b, act, z, sc in self.plans[(slot, rows)]:
            np.matmul(x, w, out=z)
            if b is not None:
                z += b
            act.apply_(np, z, sc)
            progress()


class StreamStage:
    """One rank's share of a streamed inference: its stage's layers over its replica's micro-batches."""

    def __init__(self, *, layers: list[tuple[np.ndarray, np.ndarray | None, Activation]], micro_batches: list[int],
                 n_rows: int, batch: int, slots: int, dtype: Any, in_width: int, out_width: int,
                 reader: RowReader | None, writer: RowWriter | None, pp_comm: Comm, prev: int, next: int,
                 poller: Any):
        self.mbs = micro_batches
        self.n_rows, self.batch = n_rows, batch
        # no more slots than micro-batches: each stage of a replica has the same list, so both ends of a
        # link agree, and 1e8 buffers over a 300-row input allocate one (the memory check counts infer.buffers)
        self.slots = slots = max(1, min(slots, len(micro_batches)))
        self.reader, self.writer = reader, writer
        self.rows = [micro_batch_rows(m, n_rows, batch) for m in micro_batches]
        # buffers as large as this replica's largest micro-batch, not infer.micro_batch_size:
        # 5e6-row micro-batches over a 300-row input must not allocate gigabytes
        cap = max((rows for _, rows in self.rows), default=0)
        tail = n_rows % batch if n_rows % batch < cap else 0
        self.in_bufs = [np.zeros((cap, in_width), dtype=dtype) for _ in range(slots)]
        self.out_bufs = [np.zeros((cap, out_width), dtype=dtype) for _ in range(slots)]
        self.chain = ForwardChain(layers, cap, tail, self.in_bufs, self.out_bufs, dtype)
        # tags: one stream per pipeline link, named by the sending stage
        self.recv = StreamLink(pp_comm, prev, self.in_bufs, 100 + prev, False, poller) if prev >= 0 else None
        self.send = StreamLink(pp_comm, next, self.out_bufs, 100 + pp_comm.Get_rank(), True, poller) \
            if next >= 0 else None
        links = [link for link in (self.recv, self.send) if link is not None]
        if len(links) == 2:
            recv_progress, send_progress = self.recv.progress, self.send.progress

            def progress() -> None:
                recv_progress()
                send_progress()
            self.progress: Callable[[], None] = progress
        elif links:
            self.progress = links[0].progress
        else:
            self.progress = lambda: None
        self.out_views = {rows: [buf[:rows] for buf in self.out_bufs] for _, rows in self.rows}
        self.events = np.zeros((len(micro_batches), len(EVENT_FIELDS)), dtype=np.float64)
        self.end_time = 0.0
        self.cpu_s = 0.0       # CPU seconds this process used while streaming (shows contention for cores)
        self.fault_at = -1     # test hook: raise before this rank's k-th micro-batch (HPCPIPE_FAULT)
        self.stopped: Callable[[], bool] = lambda: False   # a stop signal here or on any rank (StopNotice.check)

    def run(self) -> np.ndarray:
        """Stream every micro-batch of this rank; return the (K, 5) event timestamps (perf_counter seconds)."""
        clock = time.perf_counter
        cpu0 = time.process_time()
        n, slots = len(self.mbs), self.slots
        ev = self.events
        recv, send, reader, writer = self.recv, self.send, self.reader, self.writer
        in_bufs, compute, progress, stopped = self.in_bufs, self.chain.compute, self.progress, self.stopped
        if recv is not None:
            for k in range(min(slots, n)):
                recv.start(k)
        for k in range(n):
            slot = k % slots
            start, rows = self.rows[k]
            if k == self.fault_at:
                raise RuntimeError(f"injected fault before micro-batch {self.mbs[k]} (HPCPIPE_FAULT)")
            if stopped():
                raise StreamStopped(f"stopped before micro-batch {self.mbs[k]}")
            row = ev[k]
            row[0] = clock()
            if reader is not None:
                reader.read(start, rows, in_bufs[slot])
            else:
                recv.wait(slot)
            row[1] = clock()
            if send is not None:
                send.wait(slot)
            row[2] = clock()
            compute(slot, rows, progress)
            row[3] = clock()
            if recv is not None and k + slots < n:
                recv.start(slot)
            if send is not None:
                send.start(slot)
            else:
                writer.write(start, self.out_views[rows][slot])
            row[4] = clock()
        if send is not None:
            send.wait_all()
        self.end_time = clock()
        self.cpu_s = time.process_time() - cpu0
        return ev

    def waits(self) -> tuple[float, float]:
        """Return (seconds waiting for received inputs, seconds waiting for send slots to free)."""
        return (self.recv.waited_s if self.recv else 0.0, self.send.waited_s if self.send else 0.0)

    def close(self) -> None:
        """Release the persistent requests and close the input and output files (flushing the output)."""
        for link in (self.recv, self.send):
            if link is not None:
                link.free()
        if self.reader is not None:
            self.reader.close()
        if self.writer is not None:
            self.writer.close()

    def abandon(self) -> None:
        """After a stop: withdraw the pending receives and close the files, never waiting for a neighbour.

        Sends still in flight are left alone: their receiver has stopped too, and
        MPI forgets them at the end of the process (cancelling a send crashed MPICH).
        """
        if self.recv is not None:
            for slot, active in enumerate(self.recv.active):
                if active:
                    cancel_receive(self.recv.requests[slot])
                    self.recv.active[slot] = False
        if self.reader is not None:
            self.reader.close()
        if self.writer is not None:
            self.writer.abandon()
