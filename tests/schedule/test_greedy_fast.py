"""The greedy builders (ZB-H1, ZB-V) with their steady-state fast-forward against the plain tick-by-tick greedy."""

import itertools

import numpy as np
import pytest

from hpcpipe.schedule import zero_bubble
from hpcpipe.schedule.ir import IDLE
from hpcpipe.schedule.registry import build_timeline

# builder, the fast-forward function it calls, sizes where the steady state is long enough to skip
GREEDIES = {
    "zb-h1": ("_greedy_split", "_steady_repeats", [(5, 64), (16, 80), (21, 130), (32, 100), (63, 256), (64, 256)]),
    "zb-v": ("_greedy_v", "_v_steady_repeats", [(3, 200), (5, 64), (8, 100), (16, 80), (21, 130), (32, 100),
                                                 (63, 256), (64, 256), (64, 512)]),
}


def _same(name: str, pp: int, n_micro: int) -> bool:
    build = getattr(zero_bubble, GREEDIES[name][0])
    fast, plain = build(pp, n_micro), build(pp, n_micro, fast_forward=False)
    return all(a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b)
               for a, b in ((fast.ops, plain.ops), (fast.mb, plain.mb), (fast.chunk, plain.chunk)))


@pytest.mark.parametrize("name", sorted(GREEDIES))
def test_fast_forward_matches_greedy_on_small_grid(name):
    bad = [(p, m) for p, m in itertools.product(range(1, 13), range(1, 41)) if not _same(name, p, m)]
    assert bad == []


@pytest.mark.parametrize("name, pp, n_micro", [(name, p, m) for name, (_, _, sizes) in GREEDIES.items()
                                               for p, m in sizes])
def test_fast_forward_matches_greedy_and_skips(monkeypatch, name, pp, n_micro):
    skipped = []
    steady_name = GREEDIES[name][1]
    steady = getattr(zero_bubble, steady_name)

    def spy(*args):
        repeats = steady(*args)
        skipped.append(repeats)
        return repeats

    monkeypatch.setattr(zero_bubble, steady_name, spy)
    assert _same(name, pp, n_micro)
    assert max(skipped) > 0        # the fast path did skip ticks, so the comparison covers it


@pytest.mark.parametrize("name, pp, n_micro", [("zb-h1", 64, 256), ("zb-v", 64, 512)])
def test_fast_forward_keeps_idle_cells_at_micro_batch_and_chunk_zero(name, pp, n_micro):
    tl = build_timeline(name, pp, n_micro, 2 if name == "zb-v" else 1)
    idle = tl.ops == IDLE
    assert not tl.mb[idle].any() and not np.asarray(tl.chunk)[idle].any()
