"""Unit tests of the planner: sizes, interpolation, stage cuts, search against hand arithmetic, the written config."""

import os
import tomllib

import pytest
from support.plan import mlp_config, synthetic_profile

from hpcpipe.config import from_dict, load_config
from hpcpipe.errors import ConfigError
from hpcpipe.plan import report
from hpcpipe.plan.command import configured_global_batch, parse_bytes, plan_threads, planner_command, write_new
from hpcpipe.plan.predict import Candidate, Predictor
from hpcpipe.plan.profiling import largest_profiled_rows, profile_sizes
from hpcpipe.plan.search import divisors, micro_batch_rows, schedule_variants, search
from hpcpipe.profiles.profile import _interpolate
from hpcpipe.profiles.stage_cut import measured_cut
from hpcpipe.schedule.costs import Costs
from hpcpipe.schedule.event_sim import simulate_schedule


@pytest.mark.parametrize("text,value", [("8GiB", 8 << 30), ("8G", 8 << 30), ("512MiB", 512 << 20),
                                        ("8GB", 8 * 10 ** 9), ("1.5g", 3 << 29), ("1000", 1000), (" 2 TiB ", 2 << 40)])
def test_memory_sizes_parse(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "lots", "8 GiBs", "-1G", "0", "0.0001", "1e9", "8XB"])
def test_bad_memory_sizes_are_refused_with_the_value(text):
    with pytest.raises(ConfigError, match="--memory-per-rank"):
        parse_bytes(text)


def test_interpolation_is_linear_between_and_proportional_outside():
    points = {"10": 1.0, "20": 3.0}
    assert _interpolate(points, 15) == pytest.approx(2.0)
    assert _interpolate(points, 20) == 3.0
    assert _interpolate(points, 40) == pytest.approx(6.0)
    assert _interpolate(points, 5) == pytest.approx(0.5)


def test_profile_sizes_keep_the_ends_and_a_geometric_spread():
    assert profile_sizes([4, 2, 2, 8]) == [2, 4, 8]
    many = [2 ** k for k in range(16)]
    picked = profile_sizes(many, limit=6)
    assert len(picked) == 6 and picked[0] == 1 and picked[-1] == 2 ** 15
    # a huge batch is measured at the largest size a rank can hold, and extrapolated from there
    assert profile_sizes([8, 16, 10 ** 12], largest=64) == [8, 16, 64]


def test_the_largest_profiled_micro_batch_keeps_its_widest_activation_small():
    mlp = mlp_config([64, 4096, 10])
    assert largest_profiled_rows(mlp) == (128 << 20) // (8 * 4096)
    gpt = from_dict({"model": {"kind": "gpt", "vocab_size": 4096, "seq_len": 64, "d_model": 32, "n_heads": 2,
                               "n_blocks": 1}, "parallel": {"pp": 1}, "checkpoint": {"dir": ""}})
    assert largest_profiled_rows(gpt) == (128 << 20) // (8 * 64 * 4096)      # the logits are the widest


def test_divisors_of_a_huge_number_are_quick():
    n = 2 ** 20 * 3 ** 10 * 7 ** 3 * 11          # about 2e14: a loop up to n would run for days
    found = divisors(n)
    assert len(found) == 21 * 11 * 4 * 2 and found == sorted(found) and all(n % d == 0 for d in found)
    assert divisors(1) == [1] and divisors(49) == [1, 7, 49]


def test_small_sizes_keep_their_digits():
    from hpcpipe.plan.report import size_text
    # was "0 MiB" for a budget of 1 byte (--memory-per-rank 1, no unit)
    assert (size_text(1), size_text(1536), size_text(3 << 20), size_text(3 << 30)) == \
        ("1 bytes", "1.5 KiB", "3 MiB", "3.00 GiB")


def test_small_times_keep_their_digits():
    assert [report.seconds_text(t) for t in (1.5, 0.652, 0.024, 0.000312, 0.0)] == \
        ["1.500 s", "652 ms", "24 ms", "312 us", "0.000 s"]
    assert [report.step_column(t) for t in (0.6907, 12.5, 0.000266)] == ["0.6907", "12.5000", "0.000266"]


def test_the_table_has_an_ep_column_when_a_plan_splits_experts():
    """A Mixtral's plans at ep = 1 and ep = 2 printed as two identical rows ('2 1 1 gpipe 1 x 16'): no ep column."""
    from hpcpipe.plan.predict import Candidate, Prediction
    plans = [Prediction(Candidate(2, 1, "gpipe", 1, 1, 16, (4,), ep=ep), 0.0267, 0.0, 0.02, 0.0002, 98 << 20)
             for ep in (1, 2)]
    head, _, one, two = report.table(plans, gpt=True).splitlines()
    assert head.split()[:5] == ["#", "dp", "pp", "tp", "ep"], head
    assert one.split()[1:5] == ["2", "1", "1", "1"] and two.split()[1:5] == ["2", "1", "1", "2"], (one, two)
    assert head.index("ep") + 1 == one.index("1  gpipe") == two.index("2  gpipe")         # under its head
    dense = report.table(plans[:1], gpt=True).splitlines()[0]               # no experts split: as before
    assert dense.split()[:5] == ["#", "dp", "pp", "tp", "schedule"], dense


def test_the_written_header_holds_the_whole_planner_command_on_one_line():
    text = planner_command(["--config", "my plan.toml", "--ranks", "2", "--set", "model.dims=[4,\n4]"])
    assert text == "python -m hpcpipe.plan --config 'my plan.toml' --ranks 2 --set 'model.dims=[4,\\n4]'"
    assert tomllib.loads(report.to_toml({"train": {"steps": 1}}, f"written by {text}")) == {"train": {"steps": 1}}


def test_a_plan_file_is_new_whole_and_never_over_a_file_that_appeared(tmp_path):
    write_new(str(tmp_path / "best.toml"), "--write", "x = 1\n")
    assert (tmp_path / "best.toml").read_text() == "x = 1\n"
    umask = os.umask(0o022)
    os.umask(umask)
    assert (tmp_path / "best.toml").stat().st_mode & 0o777 == 0o666 & ~umask      # not mkstemp's 0600
    (tmp_path / "mine.toml").write_text("# mine\n")
    with pytest.raises(ConfigError, match="appeared while the run was writing"):
        write_new(str(tmp_path / "mine.toml"), "--write", "x = 1\n")
    assert (tmp_path / "mine.toml").read_text() == "# mine\n"
    (tmp_path / "link.toml").symlink_to(tmp_path / "elsewhere.toml")        # dangling: never followed
    with pytest.raises(ConfigError, match="appeared while the run was writing"):
        write_new(str(tmp_path / "link.toml"), "--write", "x = 1\n")
    assert not (tmp_path / "elsewhere.toml").exists()
    with pytest.raises(ConfigError, match="cannot write"):
        write_new(str(tmp_path / "gone" / "plans.json"), "--json", "{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.toml", "link.toml", "mine.toml"]   # no leftovers


def test_micro_batch_rows_cover_every_candidate():
    # 2 ranks, batch 64, 4 layers: dp=1 (replica 64) and dp=2 (replica 32), counts up to 8
    config = from_dict({"model": {"dims": [8, 12, 8, 12, 4]}})     # 4 layers; tp 2 splits (12 and 12 even)
    rows = micro_batch_rows(config, 64, 2, 8)
    assert rows == sorted({64 // m for m in (1, 2, 4, 8)} | {32 // m for m in (1, 2, 4, 8)})
    assert divisors(12) == [1, 2, 3, 4, 6, 12]


def test_schedule_variants_fit_the_layers():
    assert schedule_variants(1, 8) == [("gpipe", 1)]
    names = schedule_variants(2, 4)
    assert ("interleaved-1f1b", 2) in names and ("zb-v", 2) in names and ("interleaved-1f1b", 3) not in names
    assert ("zb-v", 2) not in schedule_variants(4, 6)


def test_measured_cut_moves_blocks_away_from_an_expensive_head():
    config = mlp_config([8] * 7)    # 6 layers
    profile = synthetic_profile(config, {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0, 5: 5.0})
    assert measured_cut(profile, 2, 4) == (5, 1)
    even = synthetic_profile(config, {i: 1.0 for i in range(6)})
    assert measured_cut(even, 3, 4) == (2, 2, 2)


def test_prediction_is_the_simulation_of_the_summed_layer_costs():
    config = mlp_config([8, 9, 10, 11, 12], micro_batches=4, micro_batch_size=2)   # four distinct layers
    per_row = {0: 0.01, 1: 0.02, 2: 0.03, 3: 0.04}
    profile = synthetic_profile(config, per_row)
    c = Candidate(1, 2, "1f1b", 1, 4, 8, (2, 2))
    p = Predictor(config, profile).predict(c)
    f0, f1 = (0.01 + 0.02) * 8, (0.03 + 0.04) * 8
    costs = Costs(comm=0.0, step=0.0, per_stage={("F", 0): f0, ("I", 0): f0, ("W", 0): f0, ("B", 0): 2 * f0,
                                                   ("F", 1): f1, ("I", 1): f1, ("W", 1): f1, ("B", 1): 2 * f1})
    expected = simulate_schedule("1f1b", 2, 4, 1, costs, per_rank_costs=False, events=False)
    assert p.step_time_s == pytest.approx(expected.step_time)
    # 1F1B holds min(pp - stage, m) micro-batches: 2 on stage 0 of 2 layers, 1000 bytes per row each
    assert p.memory["activations"] == 2 * 2 * 1000 * 8
    assert p.samples_per_step == 32


def test_shared_cores_slow_replicas_as_much_as_pipelines():
    """--cores is shared by all dp x pp ranks: 4 replicas on 1 core take 4x, on 2 cores 2x (was: 1x for dp)."""
    config = mlp_config([8] * 5, micro_batches=4, micro_batch_size=2)
    profile = synthetic_profile(config, {i: 0.01 for i in range(4)})
    alone = Predictor(config, profile).predict(Candidate(4, 1, "gpipe", 1, 4, 2, (4,))).step_time_s
    for cores, slower in ((4, 1.0), (8, 1.0), (2, 2.0), (1, 4.0)):
        shared = Predictor(config, profile, cores).predict(Candidate(4, 1, "gpipe", 1, 4, 2, (4,)))
        assert shared.step_time_s == pytest.approx(alone * slower, rel=1e-9), cores
    # dp = 2 x pp = 2 on 2 cores: each pipeline has one core for its two ranks, as pp = 2 alone on 1 core
    piped = Predictor(config, profile, 2).predict(Candidate(2, 2, "1f1b", 1, 4, 2, (2, 2))).step_time_s
    one_pipeline = Predictor(config, profile, 1).predict(Candidate(1, 2, "1f1b", 1, 4, 2, (2, 2))).step_time_s
    assert piped == pytest.approx(one_pipeline, rel=1e-9)
    assert piped > Predictor(config, profile).predict(Candidate(2, 2, "1f1b", 1, 4, 2, (2, 2))).step_time_s * 1.5


def test_search_picks_the_fastest_plan_and_respects_the_budget():
    config = mlp_config([8] * 5, micro_batches=8, micro_batch_size=4)
    profile = synthetic_profile(config, {i: 0.01 for i in range(4)})
    result = search(config, profile, ranks=2, global_batch=32, budget=None, max_micro=8)
    times = [p.step_time_s for p in result.feasible]
    assert times == sorted(times)
    best = result.feasible[0]
    # free messages and step ends, equal layers: dp = 2 has no bubble at all and must win
    assert (best.candidate.dp, best.candidate.pp) == (2, 1)
    assert best.step_time_s == pytest.approx(min(times))
    # a budget between the smallest and the largest need keeps only the plans under it
    needs = sorted(p.peak_bytes for p in result.predictions)
    budget = needs[len(needs) // 2]
    limited = search(config, profile, ranks=2, global_batch=32, budget=budget, max_micro=8)
    assert limited.feasible and all(p.peak_bytes <= budget for p in limited.feasible)
    assert len(limited.feasible) < len(result.feasible)


def test_search_without_a_layout_says_why():
    config = mlp_config([8] * 3)     # 2 layers
    profile = synthetic_profile(config, {0: 0.01, 1: 0.01})
    with pytest.raises(ConfigError, match="no plan exists"):
        search(config, profile, ranks=3, global_batch=4, budget=None)   # dp=3 does not divide 4, pp=3 > 2 layers


def test_written_config_reads_back_as_the_plan():
    config = mlp_config([8] * 5, micro_batches=8, micro_batch_size=4)
    profile = synthetic_profile(config, {i: 0.01 for i in range(4)})
    best = search(config, profile, ranks=2, global_batch=32, budget=None, max_micro=8).feasible[0]
    pp_plan = next(p for p in search(config, profile, 2, 32, None, max_micro=8).feasible if p.candidate.pp == 2)
    for p in (best, pp_plan):
        text = report.to_toml(report.planned_config(config, p), "a header\nsecond line")
        back = from_dict(tomllib.loads(text))
        c = p.candidate
        assert (back.parallel.dp, back.parallel.pp, back.parallel.schedule) == (c.dp, c.pp, c.schedule)
        assert (back.train.micro_batches, back.train.micro_batch_size) == (c.micro_batches, c.micro_batch_size)
        assert back.parallel.virtual_stages == c.virtual_stages
        if c.pp > 1:
            assert tuple(back.parallel.stage_layers) == c.stage_layers
        assert back.model == config.model
        assert back.parallel.dp * back.train.micro_batches * back.train.micro_batch_size == 32


def test_global_batch_comes_from_the_config_layout():
    config = load_config(None, ["parallel.pp=2", "parallel.dp=\"auto\"", "train.micro_batches=4",
                                "train.micro_batch_size=3"])
    assert configured_global_batch(config, 8) == 4 * 4 * 3
    assert configured_global_batch(config, 3) == 4 * 3     # pp does not divide: one replica's batch


def test_threads_follow_the_ranks_per_node(monkeypatch):
    monkeypatch.delenv("HPCPIPE_THREADS", raising=False)
    assert plan_threads(2, None, 2) == 1
    assert plan_threads(1, None, 2) == 2
    assert plan_threads(512, None, 2) == 1
    assert plan_threads(4, 2, 8) == 1
    monkeypatch.setenv("HPCPIPE_THREADS", "3")
    assert plan_threads(2, None, 2) == 3


@pytest.mark.parametrize("value,ok", [("profile", True), ("measured", False), ([2, 2], True)])
def test_stage_layers_takes_counts_or_profile(value, ok):
    raw = {"model": {"dims": [8] * 5}, "parallel": {"pp": 2, "stage_layers": value}}
    if ok:
        assert from_dict(raw).parallel.stage_layers == value
    else:
        with pytest.raises(ConfigError, match="stage_layers"):
            from_dict(raw)


def test_tensor_parallel_plans_split_compute_and_memory_and_pay_their_collectives():
    """A tp = 2 candidate: every action at half its measured cost plus the tp allreduces of its layers (an MLP's
    row-parallel outputs, column-parallel input gradients), parameters per rank halved; the search offers tp
    layouts only where the model splits (its column-parallel widths, 12 and 12, over 2 and 4 ranks)."""
    config = mlp_config([8, 12, 8, 12, 4], micro_batches=4, micro_batch_size=8)
    profile = synthetic_profile(config, {i: 0.01 for i in range(4)})
    predictor = Predictor(config, profile)
    one = predictor.predict(Candidate(1, 1, "gpipe", 1, 4, 8, (4,)))
    two = predictor.predict(Candidate(1, 1, "gpipe", 1, 4, 8, (4,), "profile", 2))
    allreduce = profile.comm.allreduce
    # forward: layers 1 and 3 sum their (8, 8) and (8, 4) outputs; backward: layer 2 sums its (8, 8) input gradient
    assert predictor.tp_seconds(1, 8, 2) == (allreduce(8 * 8 * 8, 2), 0.0)
    assert predictor.tp_seconds(2, 8, 2) == (0.0, allreduce(8 * 8 * 8, 2))
    assert predictor.tp_seconds(0, 8, 2) == (0.0, 0.0) and predictor.tp_seconds(1, 8, 1) == (0.0, 0.0)
    fwd = allreduce(8 * 8 * 8, 2) + allreduce(8 * 4 * 8, 2)
    bwd = allreduce(8 * 8 * 8, 2)
    compute = one.busy_max_s / 2
    assert two.busy_max_s == pytest.approx(compute + 4 * (fwd + bwd))
    assert two.memory["parameters"] == pytest.approx(one.memory["parameters"] / 2, abs=16)
    result = search(config, profile, ranks=4, global_batch=32, budget=None, max_micro=4)
    tps = {p.candidate.tp for p in result.predictions}
    assert tps == {1, 2, 4} and all(p.candidate.dp * p.candidate.pp * p.candidate.tp == 4 for p in result.predictions)
    assert "tp" in report.plan_dict(two) and report.planned_config(config, two)["parallel"]["tp"] == 2
    assert "dp=1 x pp=1 x tp=2" in report.describe(two)
