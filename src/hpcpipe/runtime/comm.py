"""The one module that moves data over MPI: point-to-point activations, allreduces, abort (and runtime.stop_notice).

Waiting polls non-blocking requests with an exponential sleep (run.poll_min_us .. run.poll_max_us) instead
of MPI's blocking calls, which busy-spin: with more ranks than cores, a spinning waiter steals the core a
computing rank needs. On CuPy arrays the current stream is synchronised before a buffer is handed to MPI;
when the MPI library is not CUDA-aware, device buffers are staged through host copies.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np
from mpi4py import MPI

from hpcpipe.errors import AgreedError, HpcpipeError
from hpcpipe.runtime.backend import Backend
from hpcpipe.runtime.wire import WireBytes

if TYPE_CHECKING:
    from mpi4py.MPI import Comm


def cuda_aware() -> bool:
    """Return True when the MPI library reports CUDA support (mpi4py's query; False when unknown)."""
    query = getattr(MPI, "Query_cuda_support", None)
    if query is None:      # mpi4py without the binding: ask the MPI library that is loaded
        from hpcpipe.runtime.mpix import library_cuda_support
        return bool(library_cuda_support())
    try:
        return bool(query())
    except Exception:  # libraries without the MPIX extension
        return False


# a poll that moves a piece of a transfer over TCP takes 9-20 us, an idle one 1.3-2.8 us (2 emulated nodes)
PROGRESS_RATIO = 4.0


class Poller:
    """Waits for MPI requests by polling with an exponentially growing sleep."""

    def __init__(self, min_us: float = 20.0, max_us: float = 1000.0):
        self.min_s = min_us * 1e-6
        self.max_s = max_us * 1e-6
        self.waited_s = 0.0   # total time spent waiting (for traces and metrics)
        self.rearms = 0       # times a sleeping wait went back to yielding: a poll of it moved data

    def wait(self, requests: list, yield_s: float = 0.0) -> None:
        """Return once every request has completed, sleeping between polls.

        ``yield_s``: first poll for that long giving the core away between polls (sched_yield) instead of
        sleeping, for collectives on a critical path whose partners are about to arrive: a sleep costs at
        least the timer's slack (60 us idle, 1 ms on a loaded machine), a yield only what other ranks use.
        With ``yield_s``, once the waiter sleeps, a poll that used over PROGRESS_RATIO times the CPU time of
        the cheapest poll after a sleep in this wait moved data (its partners are here): the waiter yields for
        ``yield_s`` again, once a wait (on 8 ranks over 2 busy cores idle polls vary enough to look like
        that some 40 times a second: re-arming each time spent a fifth of a core). CPU time, not
        wall time: a poll descheduled on an oversubscribed core is not one that moved data; compared with
        polls after a sleep only: those start with cold caches, a few times dearer than back-to-back ones.
        """
        if not requests or MPI.Request.Testall(requests):
            return
        start = time.perf_counter()
        deadline, cheapest, slept, rearmed = start + yield_s, float("inf"), False, False
        delay = self.min_s
        while True:
            before = time.thread_time()
            if MPI.Request.Testall(requests):
                break
            cost = time.thread_time() - before
            now = time.perf_counter()
            if slept:
                if yield_s > 0.0 and not rearmed and cost > PROGRESS_RATIO * cheapest:
                    # MPI moves a collective's pieces only inside its calls: sleeping now would stretch the
                    # transfer by a sleep a piece (a 1 MiB sum over TCP: 15 ms instead of 0.7 ms)
                    deadline, rearmed = now + yield_s, True
                    self.rearms += 1
                cheapest = min(cheapest, cost)
            if now < deadline:
                slept = False
                os.sched_yield()
                continue
            slept = True
            self.between_polls()
            time.sleep(delay)
            delay = min(delay * 2.0, self.max_s)
        self.waited_s += time.perf_counter() - start

    def between_polls(self) -> None:
        """Runs between two polls of a wait; a subclass may raise here to give the wait up (runtime.stop_notice)."""


class PipeComm:
    """Activation/gradient exchange along one pipeline and gradient averaging across replicas."""

    def __init__(self, pp_comm: Comm, dp_comm: Comm, world: Comm, backend: Backend, poller: Poller,
                 gpu_direct: bool | None = None, tp_comm: Comm | None = None, expert_dp_comm: Comm | None = None,
                 wire: WireBytes | None = None):
        self.pp_comm, self.dp_comm, self.world = pp_comm, dp_comm, world
        # expert parallelism: the replicas holding the same experts as this rank (their gradients' average)
        self.expert_dp_comm = expert_dp_comm
        # tensor parallel: an activation every tp rank holds travels once per stage, a share from each rank
        self.tp_comm = tp_comm if tp_comm is not None and tp_comm.Get_size() > 1 else None
        self.backend = backend
        self.poller = poller
        self.stage_through_host = backend.on_gpu and not (cuda_aware() if gpu_direct is None else gpu_direct)
        self.tag_ub = int(pp_comm.Get_attr(MPI.TAG_UB) or 32767)   # the bound of the communicator the tags travel on
        self._sends: list = []      # (request, buffer) pairs kept alive until completion
        self.bytes_sent = 0
        self.host_device_bytes = 0
        self.wire = wire if wire is not None else WireBytes()    # every message's bytes, and those leaving the node

    def tag(self, direction: int, stage: int, mb: int, n_micro: int) -> int:
        """Return the MPI tag of a message (direction 0 = activation, 1 = gradient, 2 and 3: what travels beside
        them, e.g. a mixture's router statistics forward and their gradient back)."""
        return ((stage * n_micro + mb) * 4 + direction) % self.tag_ub

    def _wire(self, buf: Any) -> Any:
        if not self.backend.on_gpu or isinstance(buf, np.ndarray):
            return buf
        self.backend.synchronize()
        if self.stage_through_host:
            self.host_device_bytes += buf.nbytes
            return buf.get()
        return buf

    def _share(self, n: int) -> tuple[slice, list[int], list[int]]:
        """This tp rank's share of n elements, and every rank's counts and offsets (near-equal parts)."""
        size, rank = self.tp_comm.Get_size(), self.tp_comm.Get_rank()
        bounds = [n * r // size for r in range(size + 1)]
        counts = [bounds[r + 1] - bounds[r] for r in range(size)]
        return slice(bounds[rank], bounds[rank + 1]), counts, bounds[:-1]

    def isend(self, buf: Any, dest: int, tag: int, share: bool = False) -> None:
        """Start sending buf to pipeline rank dest; the buffer is kept until the send completes.

        ``share``: every tp rank of the stage holds the same buf; each sends only its share of the elements
        (the receiving stage's ranks gather them, :meth:`recv`), so the activation crosses the link once.
        """
        if share and self.tp_comm is not None:
            flat = self.backend.xp.ascontiguousarray(buf).reshape(-1)
            buf = flat[self._share(flat.size)[0]]
        wire = self._wire(buf)
        self._sends.append((self.pp_comm.Isend(wire, dest=dest, tag=tag), wire))
        self.bytes_sent += buf.nbytes
        self.wire.p2p(self.pp_comm, dest, buf.nbytes)
        if len(self._sends) > 64:
            self._reap()

    def _reap(self) -> None:
        self._sends = [(r, b) for r, b in self._sends if not r.Test()]

    def recv(self, shape: tuple[int, ...], dtype: Any, source: int, tag: int, share: bool = False) -> Any:
        """Receive an array of the given shape from pipeline rank source (polling, not spinning).

        ``share``: this tp rank receives its share of the elements, then the stage's tp ranks gather theirs.
        """
        if share and self.tp_comm is not None:
            return self._recv_shared(shape, dtype, source, tag)
        xp = self.backend.xp
        if self.stage_through_host:
            host = np.empty(shape, dtype=dtype)
            self.poller.wait([self.pp_comm.Irecv(host, source=source, tag=tag)])
            self.host_device_bytes += host.nbytes
            return xp.asarray(host)
        buf = xp.empty(shape, dtype=dtype)
        self.backend.synchronize()
        self.poller.wait([self.pp_comm.Irecv(buf, source=source, tag=tag)])
        return buf

    def _recv_shared(self, shape: tuple[int, ...], dtype: Any, source: int, tag: int) -> Any:
        """Receive this rank's share of a stage-wide activation and gather the other tp ranks' into it."""
        full = np.empty(shape, dtype=dtype)
        flat = full.reshape(-1)
        mine, counts, offsets = self._share(flat.size)
        self.poller.wait([self.pp_comm.Irecv(flat[mine], source=source, tag=tag)])
        self.poller.wait([self.tp_comm.Iallgatherv(MPI.IN_PLACE, [flat, (counts, offsets)])])
        self.wire.allgather(self.tp_comm, full.nbytes)
        if self.backend.on_gpu:
            self.host_device_bytes += full.nbytes
        return self.backend.xp.asarray(full)

    def wait_sends(self) -> None:
        """Complete every outstanding send."""
        self.poller.wait([r for r, _ in self._sends])
        self._sends.clear()

    def _allreduce_inplace(self, buf: Any, comm: Comm) -> None:
        if comm.Get_size() == 1:
            return
        wire = self._wire(buf)
        self.poller.wait([comm.Iallreduce(MPI.IN_PLACE, wire, op=MPI.SUM)])
        self.wire.allreduce(comm, buf.nbytes)
        if wire is not buf:
            buf[...] = self.backend.xp.asarray(wire)
            self.host_device_bytes += buf.nbytes

    def average_over_dp(self, buf: Any, experts_from: int | None = None) -> None:
        """Replace buf with its mean over the data-parallel replicas of this stage.

        ``experts_from`` (expert parallelism): buf[experts_from:] holds this rank's experts' gradients, which
        already sum the rows of every ep peer (they came through the all-to-all); those are summed over the
        dp / ep replicas holding the same experts only, and divided by dp like the rest.
        """
        n = self.dp_comm.Get_size()
        if n == 1:
            return
        if experts_from is None or self.expert_dp_comm is None:
            self._allreduce_inplace(buf, self.dp_comm)
        else:
            self._allreduce_inplace(buf[:experts_from], self.dp_comm)
            self._allreduce_inplace(buf[experts_from:], self.expert_dp_comm)
        buf /= n

    def reduce_scatter_dp(self, parts: list[tuple[Any, Any, list[int]]]) -> None:
        """ZeRO's gradient exchange: for each (buf, out, counts), out = this replica's block of buf summed over the
        data-parallel replicas (blocks of counts[r] elements, in replica order); all parts in flight at once."""
        if self.dp_comm.Get_size() == 1:
            for buf, out, _ in parts:
                out[...] = buf
            return
        wires = [(self._wire(buf), self._wire(out)) for buf, out, _ in parts]
        self.poller.wait([self.dp_comm.Ireduce_scatter(w_in, w_out, counts, op=MPI.SUM)
                          for (w_in, w_out), (_, _, counts) in zip(wires, parts, strict=True)])
        for buf, _, _ in parts:      # a ring reduce-scatter sends (r - 1) / r of the buffer, as an allgather does
            self.wire.allgather(self.dp_comm, buf.nbytes)
        for (_, w_out), (_, out, _) in zip(wires, parts, strict=True):
            if w_out is not out:
                out[...] = self.backend.xp.asarray(w_out)
                self.host_device_bytes += out.nbytes

    def allgather_dp(self, parts: list[tuple[Any, list[int]]]) -> None:
        """ZeRO's parameter exchange, in place: each replica's block of every buf (counts[r] elements in replica
        order) to every replica; all parts in flight at once."""
        if self.dp_comm.Get_size() == 1:
            return
        wires = [self._wire(buf) for buf, _ in parts]
        requests = []
        for wire, (_, counts) in zip(wires, parts, strict=True):
            displs = [sum(counts[:r]) for r in range(len(counts))]
            requests.append(self.dp_comm.Iallgatherv(MPI.IN_PLACE, [wire, (counts, displs)]))
            self.wire.allgather(self.dp_comm, wire.nbytes)
        self.poller.wait(requests)
        for wire, (buf, _) in zip(wires, parts, strict=True):
            if wire is not buf:
                buf[...] = self.backend.xp.asarray(wire)
                self.host_device_bytes += buf.nbytes

    def gather_dp(self, parts: list[tuple[Any, Any, list[int]]]) -> None:
        """For each (block, whole, counts): every replica's block into whole on data-parallel rank 0 (whole None
        elsewhere); ZeRO's optimizer state for a checkpoint."""
        if self.dp_comm.Get_size() == 1:
            for block, whole, _ in parts:
                whole[...] = block
            return
        root = self.dp_comm.Get_rank() == 0
        requests, copies = [], []
        for block, whole, counts in parts:
            displs = [sum(counts[:r]) for r in range(len(counts))]
            host = np.empty(whole.shape, whole.dtype) if root and self.backend.on_gpu else whole
            requests.append(self.dp_comm.Igatherv(self.backend.to_host(block) if self.backend.on_gpu else block,
                                                  [host, (counts, displs)] if root else None, root=0))
            copies.append((host, whole))
        self.poller.wait(requests)
        for host, whole in copies:
            if root and host is not whole:
                whole[...] = self.backend.xp.asarray(host)

    def sum_with_pp_peer(self, buf: Any, peer: int) -> None:
        """Add a same-shaped array of pipeline rank peer into buf, which peer receives in turn (tied embeddings).

        Both ranks end with a + b (addition commutes, so bit for bit the same sum).
        The tag is the communicator's last one, which no activation uses at that point
        of a step; between one pair of ranks MPI delivers in send order anyway.
        """
        xp = self.backend.xp
        tag = self.tag_ub - 1
        mine = self._wire(buf.copy())
        theirs = np.empty(buf.shape, dtype=buf.dtype) if self.stage_through_host else xp.empty_like(buf)
        self.backend.synchronize()
        self.poller.wait([self.pp_comm.Isend(mine, dest=peer, tag=tag),
                          self.pp_comm.Irecv(theirs, source=peer, tag=tag)])
        self.bytes_sent += buf.nbytes
        self.wire.p2p(self.pp_comm, peer, buf.nbytes)
        if self.stage_through_host:
            self.host_device_bytes += buf.nbytes      # their copy back to the device
        buf += xp.asarray(theirs)

    def sum_over_world(self, values: np.ndarray) -> np.ndarray:
        """Return the element-wise sum of a small host array over every rank."""
        out = np.array(values, dtype=np.float64)
        self._allreduce_inplace(out, self.world)
        return out


def broadcast(comm: Comm, obj: Any, root: int = 0) -> Any:
    """Return root's picklable object on every rank (setup only, never the hot path)."""
    return comm.bcast(obj, root=root)


def gather_to_root(comm: Comm, obj: Any, root: int = 0) -> list | None:
    """Gather a picklable object from every rank (setup and tests only, never the hot path)."""
    return comm.gather(obj, root=root)


def gather_everyone(comm: Comm, poller: Poller, obj: Any, timeout_s: float | None = None) -> list | None:
    """Return every rank's small object on every rank, waiting asleep for the last; None after timeout_s (setup)."""
    if comm.Get_size() == 1:
        return [obj]
    arrived, start = comm.Ibarrier(), time.monotonic()   # a rank still setting up keeps its core: wait asleep
    while not arrived.Test():
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            return None    # the caller aborts: the missing rank may be stuck in a file system for ever
        time.sleep(poller.max_s)
    return comm.allgather(obj)


def barrier(comm: Comm, poller: Poller) -> None:
    """A barrier that sleeps while it waits."""
    poller.wait([comm.Ibarrier()])


def agree(comm: Comm, poller: Poller, error: str | None) -> str | None:
    """Return, on every rank, the error of the lowest rank that reported one, or None if none did.

    Collective: one small polled allreduce says who failed, so nobody proceeds or hangs before all know.
    """
    size = comm.Get_size()
    first = np.array([comm.Get_rank() if error is not None else size], dtype=np.int64)
    if size > 1:
        poller.wait([comm.Iallreduce(MPI.IN_PLACE, first, op=MPI.MIN)])
    owner = int(first[0])
    if owner == size:
        return None
    return comm.bcast(error if comm.Get_rank() == owner else None, root=owner) if size > 1 else error


@contextmanager
def together(comm: Comm, poller: Poller, code: int, describe: Callable[[Exception], str] | None = None,
             on_failure: Callable[[], None] | None = None) -> Iterator[None]:
    """Every rank of comm runs the block; if it failed on any rank, every rank raises the same AgreedError.

    Roughly::

        with together(world, poller, code=1, describe=lambda e: f"cannot write {path!r}: {e}"):
            write_my_part()          # may fail on some ranks only
        # here: it worked everywhere, or AgreedError(first failing rank's message, code) on every rank

    The block must hold no collective (a rank that fails early would skip it). An hpcpipe error's own
    message is used as it is; any other exception is put into words by ``describe`` (default: its type
    and text). ``on_failure`` runs on every rank before the AgreedError is raised (e.g. rank 0 removes a
    temporary directory). KeyboardInterrupt and SystemExit are not agreed on: they propagate, and the
    command's abort path ends the job.
    """
    error = None
    try:
        yield
    except HpcpipeError as exc:
        error = str(exc)
    except Exception as exc:  # noqa: BLE001 - any failure on one rank must be agreed on, never hang the others
        error = describe(exc) if describe else f"{type(exc).__name__}: {exc}"
    message = agree(comm, poller, error)
    if message is not None:
        if on_failure is not None:
            on_failure()
        raise AgreedError(message, code) from None


ABORT_GRACE_S = 0.5


def abort(comm: Comm, code: int) -> None:
    """End every rank of the job now (MPI_Abort), so one failing rank never hangs the others."""
    # The launcher's proxy forwards our stderr asynchronously and kills everything once the abort reaches it;
    # without a short grace period the failing rank's own error line was sometimes lost on a loaded node.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    time.sleep(ABORT_GRACE_S)
    comm.Abort(code)
