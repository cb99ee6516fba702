"""MPI test: runtime.expert_comm.ExpertGroup's all-to-all of token rows delivers every rank's rows in rank order and
counts the bytes that left the rank (the metrics' sent_bytes) and none of those it kept."""

from __future__ import annotations

import numpy as np
import pytest

from hpcpipe.runtime.backend import select_backend
from hpcpipe.runtime.comm import Poller
from hpcpipe.runtime.expert_comm import ExpertGroup
from hpcpipe.runtime.wire import WireBytes

pytestmark = pytest.mark.mpi


def test_rows_reach_their_ranks_and_the_bytes_that_left_are_counted(world):
    size, rank = world.Get_size(), world.Get_rank()
    wire = WireBytes()
    group = ExpertGroup(world, select_backend("numpy"), Poller(20.0, 1000.0), wire)
    # rank r sends (r + s + 1) rows of width 3 to rank s, each row filled with 100 r + s
    send_rows = [rank + s + 1 for s in range(size)]
    rows = np.concatenate([np.full((n, 3), 100 * rank + s, dtype=np.float64) for s, n in enumerate(send_rows)])
    recv_rows = [s + rank + 1 for s in range(size)]
    got = group.exchange_rows(rows, send_rows, recv_rows)
    want = np.concatenate([np.full((n, 3), 100 * s + rank, dtype=np.float64) for s, n in enumerate(recv_rows)])
    assert np.array_equal(got, want)
    left = sum(n for s, n in enumerate(send_rows) if s != rank) * 3 * 8
    assert wire.take() == (left, 0)          # one node: nothing off it
    assert group.bytes_sent == left
