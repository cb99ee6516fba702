"""MPI test: the planner's probes (mpi_probes.pingpong_seconds, allreduce_seconds, polled_allreduce_seconds) at any
rank count.

World ranks 0 and 1 ping-pong (the others wait, sleeping); the allreduce probe runs on the whole world.
"""

from __future__ import annotations

import math

import pytest

from hpcpipe.runtime.comm import Poller, barrier, gather_to_root
from hpcpipe.runtime.mpi_probes import allreduce_seconds, pingpong_seconds, polled_allreduce_seconds

pytestmark = pytest.mark.mpi


def test_pingpong_between_ranks_0_and_1(world):
    if world.Get_size() < 2:
        pytest.skip("needs 2 or more ranks")
    rank = world.Get_rank()
    times = None
    if rank < 2:
        with pytest.raises(ValueError, match="must be another rank of the"):
            pingpong_seconds(world, rank, 4096, 3)
        times = [pingpong_seconds(world, 1 - rank, n, 5) for n in (4096, 16 << 20)]
    barrier(world, Poller())        # ranks 2.. wait here without spinning on the pair's cores
    everyone = gather_to_root(world, times)
    if rank == 0:
        assert everyone[0] == everyone[1], "both ends of the ping-pong return the same median"
        small, big = everyone[0]
        assert all(math.isfinite(t) and t > 0 for t in (small, big))
        assert big > small, f"16 MiB ({big} s) one way was not slower than 4 KiB ({small} s)"


def test_allreduce_on_the_whole_world(world):
    small = allreduce_seconds(world, 4096, 5)
    big = allreduce_seconds(world, 16 << 20, 3)
    everyone = gather_to_root(world, (small, big))
    if world.Get_rank() == 0:
        assert len(set(everyone)) == 1, f"ranks disagree on the (max over ranks) median: {everyone}"
        assert all(math.isfinite(t) and t > 0 for t in (small, big))
        if world.Get_size() > 1:
            assert big > small, f"16 MiB allreduce ({big} s) was not slower than 4 KiB ({small} s)"
    with pytest.raises(ValueError, match="at least 4"):
        allreduce_seconds(world, 2, 1)     # checked before any communication, on every rank alike


def test_polled_allreduce_on_the_whole_world_sums_and_agrees(world):
    """The tp collectives' path (nonblocking, polled) is timed on every rank alike and really sums."""
    small = polled_allreduce_seconds(world, 4096, 5)
    big = polled_allreduce_seconds(world, 16 << 20, 3)
    everyone = gather_to_root(world, (small, big))
    if world.Get_rank() == 0:
        assert len(set(everyone)) == 1, f"ranks disagree on the (max over ranks) median: {everyone}"
        assert all(math.isfinite(t) and t > 0 for t in (small, big))
        if world.Get_size() > 1:
            assert big > small, f"16 MiB polled allreduce ({big} s) was not slower than 4 KiB ({small} s)"
    with pytest.raises(ValueError, match="at least 4"):
        polled_allreduce_seconds(world, 2, 1)
