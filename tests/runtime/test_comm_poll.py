"""MPI test: a rank waiting in comm.Poller sleeps instead of spinning, under MPICH and Open MPI alike.

Both libraries busy-poll inside blocking calls (MPI_Wait, MPI_Recv, MPI_Barrier);
hpcpipe waits with MPI_Testall plus time.sleep, so a waiting rank leaves its
core to the ranks that compute (more ranks than cores is the normal case in tests).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from mpi4py import MPI

from hpcpipe.runtime.comm import Poller, barrier
from hpcpipe.runtime.prompt_wait import PromptWait
from hpcpipe.runtime.tp_group import YIELD_S

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


def test_a_tp_collectives_waiter_sleeps_once_its_partner_is_later_than_the_transfer(world):
    if world.Get_size() < 2:
        pytest.skip("needs 2 or more ranks: one late rank, the others waiting")
    poller = Poller(20.0, 1000.0)
    prompt = PromptWait(poller, YIELD_S)
    buf = np.ones(1 << 16, dtype=np.float32)
    for _ in range(5):                        # the window learns this sum's transfer time
        barrier(world, poller)
        prompt.wait([world.Iallreduce(MPI.IN_PLACE, buf)], ("reduce", buf.nbytes))
    barrier(world, poller)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    if world.Get_rank() == 0:
        time.sleep(WAIT_S)                    # the late partner (still computing, or stalled)
    prompt.wait([world.Iallreduce(MPI.IN_PLACE, buf)], ("reduce", buf.nbytes))
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    if world.Get_rank() != 0:
        assert wall >= WAIT_S * 0.9
        assert prompt.window(("reduce", buf.nbytes)) < 0.1 * WAIT_S
        assert cpu < 0.1 * wall, f"{cpu:.3f} s of CPU while waiting {wall:.3f} s in a tp collective"
