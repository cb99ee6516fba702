"""Training data: the shuffled order (a keyed bijection, O(batch) per step), reads that fail loudly."""

from __future__ import annotations

import time
import tracemalloc

import numpy as np
import pytest

from hpcpipe.train.data import replica_rows, step_samples
from hpcpipe.train.shuffle import EpochPermutation


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 13, 16, 17, 31, 64, 65, 97, 255, 256, 1000, 1021, 4096, 65537])
def test_epoch_order_is_a_permutation_of_every_size(n):
    for seed, epoch in [(0, 0), (7, 3)]:
        order = EpochPermutation(n, seed, epoch)(np.arange(n))
        assert order.dtype == np.int64
        assert np.array_equal(np.sort(order), np.arange(n))


def test_order_depends_on_seed_and_epoch_and_looks_shuffled():
    n = 10007
    base = EpochPermutation(n, 0, 0)(np.arange(n))
    for seed, epoch in [(0, 1), (1, 0), (2, 5)]:
        other = EpochPermutation(n, seed, epoch)(np.arange(n))
        assert np.mean(other == base) < 0.01
    assert np.mean(base == np.arange(n)) < 0.01
    # neighbours in the order are not neighbours in the file: mean |jump| near n/3 as for a random order
    assert 0.25 * n < np.mean(np.abs(np.diff(base))) < 0.42 * n
    # deterministic: the same (n, seed, epoch) gives the same order, evaluated in any chunks
    again = np.concatenate([EpochPermutation(n, 0, 0)(np.arange(a, min(a + 999, n))) for a in range(0, n, 999)])
    assert np.array_equal(again, base)


def test_step_samples_cover_each_epoch_once_and_replicas_take_their_rows():
    n, g = 50, 12   # 12 does not divide 50: steps straddle epochs
    stream = np.concatenate([step_samples(s, g, n, True, 4) for s in range(25)])   # 300 positions = 6 epochs
    epochs = stream.reshape(6, n)
    for e in range(6):
        assert np.array_equal(np.sort(epochs[e]), np.arange(n))
    assert not np.array_equal(epochs[0], epochs[1])
    rows = replica_rows(2, 1, 3, 2)
    for s in range(25):
        assert np.array_equal(step_samples(s, g, n, True, 4, rows=rows), step_samples(s, g, n, True, 4)[rows])
    assert np.array_equal(step_samples(3, g, n, False, 4), (np.arange(36, 48)) % n)


def test_shuffled_step_at_625_million_rows_costs_milliseconds_and_no_n_sized_memory():
    n, g = 625_000_000, 1024
    step_samples(0, g, n, True, 0)   # warm up imports
    tracemalloc.start()
    t0 = time.perf_counter()
    for step in (0, 400_000, 610_351):   # the last one straddles epochs 0 and 1
        idx = step_samples(step, g, n, True, 0)
    seconds = (time.perf_counter() - t0) / 3
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert idx.shape == (g,) and idx.min() >= 0 and idx.max() < n and len(np.unique(idx)) == g
    assert peak < 2_000_000, peak            # the old permutation(n) took 5 GB
    assert seconds < 0.25, seconds            # about 1-2 ms here; generous for a busy machine
