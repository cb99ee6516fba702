"""MPI test: a rank waiting in comm.Poller sleeps instead of spinning, under MPICH and Open MPI alike.

Both libraries busy-poll inside blocking calls (MPI_Wait, MPI_Recv, MPI_Barrier);
hpcpipe waits with MPI_Testall plus time.sleep, so a waiting rank leaves its
core to the ranks that compute (more ranks than cores is the normal case in tests).
"""

from __future__ import annotations

import time

import pytest
from mpi4py import MPI

from hpcpipe.runtime.comm import Poller, barrier

pytestmark = pytest.mark.mpi

WAIT_S = 1.5


def test_waiting_ranks_use_almost_no_cpu(world):
    if world.Get_size() < 2:
        pytest.skip("needs 2 or more ranks: one late rank, the others waiting")
    poller = Poller(20.0, 1000.0)
    barrier(world, poller)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    if world.Get_rank() == 0:
        time.sleep(WAIT_S)                         # the late rank
    barrier(world, poller)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    if world.Get_rank() != 0:
        assert wall >= WAIT_S * 0.9
        # a spinning wait burns its whole share of a core; a polling one about 1-2 % (20 us .. 1 ms sleeps)
        assert cpu < 0.1 * wall, (f"{MPI.Get_library_version().splitlines()[0]}: {cpu:.3f} s of CPU while "
                                  f"waiting {wall:.3f} s")
        assert poller.waited_s >= WAIT_S * 0.9
