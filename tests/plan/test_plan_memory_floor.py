"""The planner refuses what no plan, or no profiling process, can hold before it starts anything (issue #32).

`model.dims = [16, 50000, 50000, 16]` with `--memory-per-rank 1GiB` used to profile anyway, and the kernel
killed the 12 and 24 GB profiling processes. These tests run the planner in this process with every
measuring function replaced by one that fails the test: a refusal must come from arithmetic alone.
"""

from __future__ import annotations

import pytest

from hpcpipe.config import load_config
from hpcpipe.plan import command, profiling
from hpcpipe.runtime import host_memory

HUGE = ["--set", "model.dims=[16,50000,50000,16]", "--set", "parallel.pp=2"]


@pytest.fixture
def nothing_measured(monkeypatch):
    """Make every measurement of the planner fail the test."""
    def measured(*args, **kwargs):
        raise AssertionError("the planner started measuring")

    for name in ("measure_comm", "measure_rank_baseline", "run_layer_profile", "_engine_factors"):
        monkeypatch.setattr(profiling, name, measured)


def _plan(args, capsys, tmp_path) -> tuple[int, list[str]]:
    code = command.main([*args, "--profile-dir", str(tmp_path / "profiles")])
    err = capsys.readouterr().err
    return code, err.strip().splitlines()


def test_a_model_no_plan_can_hold_is_refused_before_anything_is_measured(nothing_measured, capsys, tmp_path):
    code, lines = _plan([*HUGE, "--ranks", "2", "--memory-per-rank", "1GiB"], capsys, tmp_path)
    assert code == 2 and len(lines) == 1, lines
    line = lines[0]
    assert line.startswith("hpcpipe: error: no plan for 2 ranks fits 1.00 GiB per rank (--memory-per-rank): the "
                           "busiest rank of any plan needs at least 18.63 GiB (20001974912 bytes)"), line
    # layer 1 holds 50000 x 50000 weights and 50000 biases, float32, with their gradients (SGD: no state)
    assert "layer 1's 2,500,050,000 parameters" in line and "nothing was measured" in line
    assert not (tmp_path / "profiles").exists()


def test_without_a_budget_the_machine_is_the_budget(nothing_measured, capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(host_memory, "node_available_bytes", lambda: 24 << 30)
    monkeypatch.setattr(host_memory, "address_space_headroom", lambda: None)
    code, lines = _plan([*HUGE, "--ranks", "2"], capsys, tmp_path)
    assert code == 2 and len(lines) == 1, lines
    assert "fits 12.00 GiB per rank (this node has 24 GiB available for 2 rank(s) (12 GiB each))" in lines[0]


def test_under_an_address_space_limit_each_rank_has_its_headroom(nothing_measured, capsys, tmp_path, monkeypatch):
    # was: the node's memory, already capped by the limit, divided by the ranks again (3 GiB -> 1.5 GiB)
    monkeypatch.setattr(host_memory, "node_available_bytes", lambda: 24 << 30)
    monkeypatch.setattr(host_memory, "address_space_headroom", lambda: 3 << 30)
    code, lines = _plan([*HUGE, "--ranks", "2"], capsys, tmp_path)
    assert code == 2 and len(lines) == 1, lines
    assert "fits 3.00 GiB per rank (each rank has 3 GiB left under its address-space limit (ulimit -v, " in lines[0]


def test_a_model_whose_profiling_would_not_fit_the_machine_is_refused(nothing_measured, capsys, tmp_path,
                                                                      monkeypatch):
    # a budget large enough for a plan, but the layer bench holds the whole model in each of 2 processes
    monkeypatch.setattr(command, "available_bytes", lambda: 24 << 30)
    code, lines = _plan([*HUGE, "--ranks", "2", "--memory-per-rank", "64GiB"], capsys, tmp_path)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("hpcpipe: error: profiling model.dims [16, 50000, 50000, 16] here needs about ")
    assert "more than this machine's 24.00 GiB available; nothing was measured" in lines[0]
    assert not (tmp_path / "profiles").exists()


def test_a_model_that_fits_reaches_the_measurements(nothing_measured, capsys, tmp_path):
    with pytest.raises(AssertionError, match="started measuring"):
        command.main(["--set", "model.dims=[64,64,64,64,64]", "--set", "parallel.pp=2", "--ranks", "2",
                      "--memory-per-rank", "8MiB", "--profile-dir", str(tmp_path / "profiles")])


def test_the_floor_is_below_every_plan_the_search_keeps():
    """The floor is a lower bound: the smallest plan the search predicts (test_plan_command's) lies above it."""
    from support.plan import mlp_config, synthetic_profile

    from hpcpipe.plan.memory_floor import plan_floor
    from hpcpipe.plan.search import search

    config = mlp_config([64, 256, 512, 128, 64, 8], micro_batches=8, micro_batch_size=4)
    profile = synthetic_profile(config, {i: 1e-6 for i in range(5)})
    for ranks in (1, 2, 4):
        result = search(config, profile, ranks, 32, None)
        least = min(p.peak_bytes for p in result.predictions)
        assert plan_floor(config, ranks, 32).total <= least


def test_the_floor_counts_optimizer_state_and_the_best_split():
    from hpcpipe.plan.memory_floor import plan_floor

    config = load_config(None, ["model.dims=[100,100,100,100,100]", "parallel.pp=2", "train.optimizer=\"adam\"",
                                "data.synthetic_samples=16"])
    floor = plan_floor(config, 4, 64)
    # 4 equal layers of 10,100 parameters on at most 4 stages: one layer per rank, x (param + grad + 2 Adam)
    assert floor.pp_max == 4 and floor.params == 10100 and floor.param_bytes == 10100 * 4 * 4
