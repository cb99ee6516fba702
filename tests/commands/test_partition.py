"""The balanced stage cut: the same cut as the exact dynamic programme it replaced, ties included, in time
linear in the layer count (a config.json of 100,000 layers used to spend minutes here, deaf to SIGTERM)."""

from __future__ import annotations

import random
import signal
from types import SimpleNamespace

import pytest

from hpcpipe.nn.partition import partition


def programme(cost: list, n_stages: int) -> list[int]:
    """The O(stages x layers^2) dynamic programme as it was (hpcpipe before issue 40): the reference cut."""
    n = len(cost)
    prefix = [0]
    for c in cost:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0
    for k in range(1, n_stages + 1):
        for i in range(k, n - (n_stages - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    counts, i = [], n
    for k in range(n_stages, 0, -1):
        j = cut[k][i]
        counts.append(i - j)
        i = j
    counts.reverse()
    return counts


def _specs(cost: list) -> list[SimpleNamespace]:
    return [SimpleNamespace(cost=c) for c in cost]


def _counts(cost: list, n_stages: int) -> list[int]:
    return [len(r) for r in partition(_specs(cost), n_stages)]


@pytest.mark.parametrize("kind", ["int", "small-int", "float", "seconds", "zeros"])
def test_the_cut_equals_the_dynamic_programme_on_random_costs(kind):
    rng = random.Random({"int": 1, "small-int": 2, "float": 3, "seconds": 4, "zeros": 5}[kind])
    for _ in range(150):
        n = rng.randint(1, 24)
        if kind == "int":
            cost = [rng.randint(0, 10 ** rng.randint(1, 15)) for _ in range(n)]
        elif kind == "small-int":      # many ties
            cost = [rng.randint(0, 3) for _ in range(n)]
        elif kind == "float":
            cost = [rng.random() * 10 ** rng.randint(-3, 3) for _ in range(n)]
        elif kind == "seconds":        # ties after rounding: sums of decimal fractions
            cost = [rng.choice([0.1, 0.2, 0.3, 0.7, 1e-9, 0.0]) for _ in range(n)]
        else:
            cost = [rng.choice([0, 0, 5]) for _ in range(n)]
        for n_stages in range(1, n + 1):
            assert _counts(cost, n_stages) == programme(cost, n_stages), (cost, n_stages)


def test_the_cut_of_the_repository_models_is_unchanged():
    from hpcpipe.config import from_dict, load_config
    from hpcpipe.nn.mlp.model import layer_specs
    from hpcpipe.nn.registry import model_def
    specs = layer_specs(load_config(None, ["model.dims=[8, 64, 64, 8, 8, 8]"]))
    gpt = model_def(from_dict({"model": {"kind": "gpt", "vocab_size": 8192, "seq_len": 64, "d_model": 64,
                                         "n_heads": 4, "n_blocks": 6}, "parallel": {"pp": 1}})).specs
    for case in (specs, gpt):
        for n_stages in range(1, len(case) + 1):
            assert [len(r) for r in partition(case, n_stages)] == programme([s.cost for s in case], n_stages)


def test_negative_costs_still_get_the_programme_cut():
    cost = [3, -1, 4, -1, 5, -9, 2, 6]
    for n_stages in range(1, len(cost) + 1):
        assert _counts(cost, n_stages) == programme(cost, n_stages)


def _cpu_budget(seconds: float):
    """Raise TimeoutError in this process after ``seconds`` of its own CPU time (load on other cores does not count)."""
    def expired(signum, frame):
        raise TimeoutError(f"over {seconds} s of CPU time")
    signal.signal(signal.SIGPROF, expired)
    signal.setitimer(signal.ITIMER_PROF, seconds)


def test_a_hundred_thousand_layers_cut_in_well_under_a_second():
    """Was O(stages x layers^2): minutes at 100,000 layer groups, even at one stage."""
    rng = random.Random(0)
    cost = [rng.randint(10 ** 6, 10 ** 7) for _ in range(100_000)]
    previous = signal.getsignal(signal.SIGPROF)
    late = None
    try:
        for n_stages in (1, 4, 256):
            _cpu_budget(20)
            counts = _counts(cost, n_stages)
            assert sum(counts) == len(cost) and min(counts) >= 1
        _cpu_budget(20)
        assert sum(_counts([c / 3 for c in cost], 64)) == len(cost)
    except TimeoutError as exc:
        late = str(exc)
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)
    assert late is None, f"cutting 100,000 layer groups took {late}"
