"""Unit tests of the start-up memory check: what a rank needs (parameters, optimizer, activations, data), a model
that cannot fit refused with the numbers, the shipped configs fitting."""

from __future__ import annotations

import pytest
from support import ROOT

from hpcpipe.config import from_dict, load_config
from hpcpipe.errors import ConfigError
from hpcpipe.nn.memory import estimate_rank_bytes
from hpcpipe.nn.mlp.model import layer_specs
from hpcpipe.nn.partition import partition
from hpcpipe.train.preflight import GIB, check_memory
from hpcpipe.train.setup import prepare


def _layout(config, pp):
    return partition(layer_specs(config), pp), pp


def test_memory_estimate_counts_parameters_optimizer_and_activations():
    config = from_dict({"model": {"dims": [10, 20, 30]}, "parallel": {"pp": 1},
                        "train": {"optimizer": "adam", "micro_batches": 2, "micro_batch_size": 3},
                        "data": {"synthetic_samples": 7}})
    ranges, pp = _layout(config, 1)
    need = estimate_rank_bytes(config, ranges, pp, "interleaved")
    n_params = 10 * 20 + 20 + 20 * 30 + 30
    assert need.parameters == 2 * 4 * n_params             # parameters + gradients, float32
    assert need.optimizer == 2 * 4 * n_params              # Adam: two moments
    assert need.activations == 2 * 3 * (10 + 20 + 20 + 30) * 4
    assert need.data == 7 * (10 + 30) * 12 + 10 * 30 * 8
    sgd = from_dict({"model": {"dims": [10, 20, 30]}, "parallel": {"pp": 1}, "train": {"momentum": 0.9}})
    assert estimate_rank_bytes(sgd, ranges, 1, "interleaved").optimizer == 4 * n_params
    # split over two stages: the larger stage (layer 1: 630 parameters) decides
    assert estimate_rank_bytes(config, partition(layer_specs(config), 2), 2, "interleaved").parameters == 2 * 4 * 630


def test_model_that_cannot_fit_is_refused_with_the_numbers():
    config = from_dict({"model": {"dims": [16, 1000000000, 16]}, "parallel": {"pp": 1}})
    ranges, pp = _layout(config, 1)
    with pytest.raises(ConfigError, match=r"the model needs about \d+ GiB per rank \(parameters and gradients "
                                          r"\d+ GiB, optimizer 0 GiB, activations \d+ GiB.*this node has 16 GiB "
                                          r"available for 4 rank\(s\) \(4 GiB each\)"):
        check_memory(config, ranges, pp, "interleaved", 4, available=16 * GIB, ranks_here=4)


def test_existing_and_bench_configs_fit():
    bench = from_dict({"model": {"dims": [1024] * 9}, "parallel": {"pp": 2},
                       "train": {"micro_batches": 16, "micro_batch_size": 128, "optimizer": "adam"}})
    ranges, pp = _layout(bench, 2)
    need = check_memory(bench, ranges, pp, "interleaved", 8, available=4 * GIB, ranks_here=8)
    assert need.total < 0.5 * GIB
    for name in ("default", "digits", "example6", "example7"):
        config = load_config(ROOT / "configs" / f"{name}.toml")
        pp = config.parallel.pp if isinstance(config.parallel.pp, int) else 1
        ranges, _ = _layout(config, pp)
        check_memory(config, ranges, pp, "interleaved", 8, available=1 * GIB, ranks_here=8)


def test_plan_refuses_the_huge_model_on_this_machine():
    with pytest.raises(ConfigError, match="the model needs about .* GiB per rank"):
        prepare(from_dict({"model": {"dims": [16, 1000000000, 16]}, "parallel": {"pp": 1}}), 1)
