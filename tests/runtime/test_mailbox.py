"""MPI test: runtime.mailbox.Mailbox moves (header, array) messages between ranks and polls without blocking."""

from __future__ import annotations

import numpy as np
import pytest

from hpcpipe.runtime.backend import select_backend
from hpcpipe.runtime.comm import Poller, barrier
from hpcpipe.runtime.mailbox import Mailbox

pytestmark = pytest.mark.mpi


def test_headers_and_arrays_arrive_in_order_from_every_rank(world):
    size, rank = world.Get_size(), world.Get_rank()
    poller = Poller(20.0, 1000.0)
    box = Mailbox(world, select_backend("numpy"), poller)
    assert box.poll(None, 40) is None                       # nothing sent yet: None at once, no blocking
    barrier(world, poller)
    if rank != 0:
        for i in range(3):                                   # three messages, the last without an array
            array = np.full((rank, i + 2), rank * 10 + i, dtype=np.float32) if i < 2 else None
            box.post(0, 40, ("work", rank, i, [(rank, i)]), array)
        box.flush()
    else:
        got: dict[int, list] = {}
        while sum(len(v) for v in got.values()) < 3 * (size - 1):
            message = box.poll(None, 40)
            if message is None:
                continue
            header, array, source = message
            assert header[1] == source
            got.setdefault(source, []).append((header, array))
        for source, messages in got.items():
            assert [h[2] for h, _ in messages] == [0, 1, 2]   # per sender, in send order
            for header, array in messages:
                assert header == ("work", source, header[2], [(source, header[2])])
                if header[2] < 2:
                    assert array.dtype == np.float32 and array.shape == (source, header[2] + 2)
                    assert np.all(array == source * 10 + header[2])
                else:
                    assert array is None
    barrier(world, poller)
    assert box.poll(None, 40) is None
