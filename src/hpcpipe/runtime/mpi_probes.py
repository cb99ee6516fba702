"""Measuring the MPI a job runs on: clock offsets between nodes, the library's description, the planner's probes.

Setup-time and planner-time exchanges only, never on a step's path: blocking
calls are fine here. MPI itself is loaded by :mod:`hpcpipe.runtime.comm`, the
one module that imports mpi4py; this module reaches it through there.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from hpcpipe.runtime.comm import MPI, Poller

if TYPE_CHECKING:
    from mpi4py.MPI import Comm


def clock_offset(comm: Comm, poller: Poller, root: int = 0, rounds: int = 8) -> float:
    """Return what to add to this rank's ``time.perf_counter()`` to read root's clock (collective, setup only).

    Ranks on root's node share its monotonic clock: their offset is 0. Each
    rank on another node does ``rounds`` ping-pongs with root and keeps the
    one with the shortest round trip (Cristian's algorithm), so a rank
    descheduled during one exchange does not skew the estimate.
    """
    hosts = comm.allgather(MPI.Get_processor_name())
    rank = comm.Get_rank()
    remote = [r for r, host in enumerate(hosts) if host != hosts[root]]
    stamp = np.zeros(1, dtype=np.float64)
    if rank == root:
        for peer in remote:
            for _ in range(rounds):
                poller.wait([comm.Irecv(stamp, source=peer, tag=7)])
                stamp[0] = time.perf_counter()
                comm.Send(stamp, dest=peer, tag=7)
        return 0.0
    if rank not in remote:
        return 0.0
    best_rtt, offset = float("inf"), 0.0
    ping = np.zeros(1, dtype=np.float64)
    for _ in range(rounds):
        reply = comm.Irecv(stamp, source=root, tag=7)
        t0 = time.perf_counter()
        comm.Send(ping, dest=root, tag=7)
        poller.wait([reply])
        t1 = time.perf_counter()
        if t1 - t0 < best_rtt:
            best_rtt, offset = t1 - t0, float(stamp[0]) - (t0 + t1) / 2
    return offset


def library_line(comm: Comm) -> str:
    """Return the run's one-line MPI description: library, the libmpi file loaded, mpi4py build, rank count."""
    import mpi4py

    from hpcpipe.runtime import runenv
    try:
        config = mpi4py.get_config()
    except Exception:  # noqa: BLE001 - a description must never stop a run
        config = {}
    build = runenv.mpi4py_build(getattr(MPI, "__file__", "") or "", config, mpi4py.__version__)
    return runenv.mpi_line(MPI.Get_library_version(), comm.Get_size(), runenv.self_libmpi(), build)


# Probes for the planner (hpcpipe.plan.probe): they time a quiet exchange.
PROBE_WARMUP, PROBE_TAG = 3, 11


def pingpong_seconds(comm: Comm, peer: int, nbytes: int, repeats: int) -> float:
    """Return the median one-way time (half a round trip) of an nbytes message between this rank and peer.

    Both ranks call it; the lower one times the round trips after untimed warm-ups and sends peer the median.
    """
    rank = comm.Get_rank()
    if peer == rank or not 0 <= peer < comm.Get_size() or nbytes < 1 or repeats < 1:
        raise ValueError(f"pingpong_seconds: peer {peer} must be another rank of the {comm.Get_size()} and "
                         f"nbytes {nbytes}, repeats {repeats} at least 1")
    buf, first, times = np.ones(nbytes, dtype=np.uint8), rank < peer, []
    for i in range(PROBE_WARMUP + repeats):
        t0 = time.perf_counter()
        if first:
            comm.Send(buf, dest=peer, tag=PROBE_TAG)
        comm.Recv(buf, source=peer, tag=PROBE_TAG)
        if not first:
            comm.Send(buf, dest=peer, tag=PROBE_TAG)
        elif i >= PROBE_WARMUP:
            times.append((time.perf_counter() - t0) / 2.0)
    if not first:
        return float(comm.recv(source=peer, tag=PROBE_TAG))
    median = float(np.median(times))
    comm.send(median, dest=peer, tag=PROBE_TAG)
    return median


def allreduce_seconds(comm: Comm, nbytes: int, repeats: int) -> float:
    """Return the median time of an in-place Allreduce(SUM) of a float32 buffer of nbytes over comm (collective).

    Each repeat starts after a barrier and counts as the slowest rank's time (what a step waits for).
    """
    if nbytes < 4 or repeats < 1:
        raise ValueError(f"allreduce_seconds: nbytes {nbytes} must be at least 4 and repeats {repeats} at least 1")
    buf, times = np.zeros(nbytes // 4, dtype=np.float32), []
    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)      # warm-up: first touch, algorithm setup
    for _ in range(repeats):
        comm.Barrier()
        t0 = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        times.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    return float(np.median(times))


def polled_allreduce_seconds(comm: Comm, nbytes: int, repeats: int, compute_s: float = 0.004) -> float:
    """Return the median time of an in-place float32 sum of nbytes made as a tp collective is: a nonblocking
    Iallreduce waited for by polling (:class:`hpcpipe.runtime.tp_group.TPGroup`), not a blocking Allreduce,
    reached as a step reaches it: after ``compute_s`` of matrix products on each rank, so the ranks arrive apart.

    MPI advances a nonblocking collective only inside its calls: between two sleeping polls
    a transfer made of several pieces waits (bench/bench_tp_collectives.py between 2 emulated
    nodes at 10 Gbit/s, 1 MiB: 15.4 ms polled after computing, 1.1 ms polled after a barrier,
    0.85 ms blocking; in shared memory 0.2-0.3 ms each). Each repeat counts as the slowest rank's time.
    """
    from hpcpipe.runtime.prompt_wait import PromptWait
    from hpcpipe.runtime.tp_group import YIELD_S

    if nbytes < 4 or repeats < 1:
        raise ValueError(f"polled_allreduce_seconds: nbytes {nbytes} must be at least 4 and repeats {repeats} at "
                         "least 1")
    buf, times, prompt = np.zeros(nbytes // 4, dtype=np.float32), [], PromptWait(Poller(), YIELD_S)
    a = np.ones((2048, 64), dtype=np.float32)
    b = np.ones((64, 192), dtype=np.float32)
    prompt.wait([comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM)], ("reduce", nbytes))     # warm-up: learns its window
    for _ in range(repeats):
        comm.Barrier()
        start = time.perf_counter()
        while time.perf_counter() - start < compute_s:    # the layer before the collective
            a @ b
        t0 = time.perf_counter()
        prompt.wait([comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM)], ("reduce", nbytes))
        times.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    return float(np.median(times))
