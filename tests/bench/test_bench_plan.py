"""The planner's proof harness (bench/bench_plan.py): its grid, matching and checks, and a run on a hand-made plan."""

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from support import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import bench_plan  # noqa: E402  (bench/ is not a package)
import plan_finals  # noqa: E402

MLP, GPT = str(ROOT / "configs" / "plan-mlp.toml"), str(ROOT / "configs" / "plan-gpt.toml")


@pytest.mark.parametrize("config,global_batch", [(MLP, 2048), (GPT, 32)])
def test_grid_is_twelve_runnable_configurations_of_the_configs_global_batch(config, global_batch):
    base, why = bench_plan.check_config(config, 2, [])
    assert base is not None, why
    assert base["dp"] * base["micro_batches"] * base["micro_batch_size"] == global_batch
    configs, skipped = bench_plan.grid(config, 2, global_batch, base["micro_batch_size"])
    assert len(configs) >= 12 and not skipped
    assert all(c["dp"] * c["micro_batches"] * c["micro_batch_size"] == global_batch for c in configs)
    assert {(c["dp"], c["pp"]) for c in configs} == {(1, 2), (2, 1)}
    assert {(c["schedule"], c["virtual_stages"]) for c in configs if c["pp"] > 1} == {
        ("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zb-v", 2)}
    assert len({json.dumps(c, sort_keys=True) for c in configs}) == len(configs)
    assert all(sum(c["stage_layers"]) == base["n_layers"] for c in configs)


def test_a_grid_entry_that_cannot_run_is_skipped_with_the_reason():
    # 16 micro-batches over 2048 rows at dp=1 would be fine; 3 ranks give pp=3, dp=1 and pp=1, dp=3,
    # and 2048 is not divisible by 3 replicas
    configs, skipped = bench_plan.grid(MLP, 3, 2048, 128)
    assert configs and all(c["dp"] == 1 for c in configs)
    assert any("do not divide the global batch 2048" in note for note in skipped)


def test_benchmark_configs_are_the_models_asked_for():
    mlp = tomllib.loads(Path(MLP).read_text())
    assert mlp["model"]["dims"] == [1024] * 9 and mlp["train"]["optimizer"] == "sgd"
    assert mlp["checkpoint"]["dir"] == ""
    gpt = tomllib.loads(Path(GPT).read_text())["model"]
    assert (gpt["vocab_size"], gpt["seq_len"], gpt["d_model"], gpt["n_heads"], gpt["n_blocks"],
            gpt["tie_embeddings"]) == (8192, 64, 128, 4, 4, False)


def test_prediction_matches_only_the_same_configuration():
    plan = {"dp": 1, "pp": 2, "schedule": "1f1b", "virtual_stages": 1, "micro_batches": 8, "micro_batch_size": 4,
            "stage_layers": [5, 1], "step_time_s": 0.4}
    plans = {"plans": [plan]}
    assert bench_plan.predicted(plans, dict(plan)) == 0.4
    for key, other in (("stage_layers", [3, 3]), ("schedule", "gpipe"), ("micro_batches", 16), ("dp", 2)):
        assert bench_plan.predicted(plans, {**plan, key: other}) is None, key


def test_equal_cut_and_sizes():
    assert bench_plan.equal_cut(6, 2) == [3, 3]
    assert bench_plan.equal_cut(6, 4) == [2, 2, 1, 1]
    assert bench_plan.parse_bytes("8GiB") == 8 * 2**30 and bench_plan.parse_bytes("512MB") == 512 * 10**6
    with pytest.raises(SystemExit, match="not a size"):
        bench_plan.parse_bytes("8 parsecs")


def test_checks_fail_a_slow_or_mispredicted_or_oversized_top_choice():
    planner = {"wall_s": [70.0, 1.0]}
    top = {"median_s": 1.0, "predicted_s": 0.8, "peak_rss_bytes": 3 * 2**30}
    grid = [{"median_s": 0.9}, {"error": "exit 2"}]
    checks = bench_plan.checks(planner, top, grid, 2 * 2**30)
    assert {k: c["ok"] for k, c in checks.items()} == {
        "top_prediction_error": False, "top_vs_fastest_grid": False, "top_peak_rss_bytes": False,
        "planner_first_s": False, "planner_cached_s": True}
    good = bench_plan.checks(planner, {**top, "predicted_s": 0.9, "peak_rss_bytes": 2**30}, [{"median_s": 0.96}],
                             2 * 2**30)
    assert good["top_prediction_error"]["ok"] and good["top_vs_fastest_grid"]["ok"] and good["top_peak_rss_bytes"]["ok"]
    # the grid's run of the top plan itself (same rounds as the others) is what the grid comparison uses
    config = {"dp": 1, "pp": 2, "schedule": "1f1b", "virtual_stages": 1, "micro_batches": 8, "stage_layers": [5, 1]}
    twin = bench_plan.checks(planner, {**top, "config": config, "median_s": 1.2},
                             [{"median_s": 0.9, "config": config}, {"median_s": 0.88, "config": {}}], 2 * 2**30)
    assert twin["top_vs_fastest_grid"]["value"] == 0.9 / 0.88 and twin["top_vs_fastest_grid"]["ok"]
    # the memory model must bound every run's peak RSS
    over = bench_plan.checks(planner, {**top, "predicted_peak_bytes": 2**30, "peak_rss_bytes": 2**31}, [], 2**32)
    assert over["rss_over_predicted_peak_max"] == {"value": 2.0, "limit": 1.0, "ok": False}


def test_runner_on_a_hand_made_plan(tmp_path):
    top = {"dp": 1, "pp": 2, "schedule": "1f1b", "virtual_stages": 1, "micro_batches": 8, "micro_batch_size": 4,
           "stage_layers": [5, 1], "step_time_s": 0.4, "samples_per_s": 80.0, "bubble": 0.1,
           "peak_bytes_per_rank": 10**8}
    # the grid's first entry (dp=2, pp=1, one micro-batch of 16) with a prediction to find
    second = {**top, "dp": 2, "pp": 1, "schedule": "gpipe", "micro_batches": 1, "micro_batch_size": 16,
              "stage_layers": [6], "step_time_s": 0.5}
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"ranks": 2, "global_batch": 32, "budget_bytes": 2**30, "prediction_only": False,
                                "plans": [top, second]}))
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_plan.py"), "--config", GPT, "--plan-json",
                           str(plan), "--max-grid", "1", "--steps", "3", "--quiet-wait", "0", "--out", str(out),
                           "--final-rounds", "1", "--final-within", "100"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())
    assert res["top"]["config"] == top and len(res["top"]["times"]) == 1     # 3 steps, 2 of warm-up
    assert 20e6 < res["top"]["peak_rss_bytes"] < 2**30
    [row] = res["grid"]
    assert row["config"]["dp"] == 2 and row["predicted_s"] == 0.5 and row["median_s"] > 0
    assert set(res["checks"]) == {"top_prediction_error", "top_vs_fastest_grid", "top_peak_rss_bytes",
                                  "rss_over_predicted_peak_max", "top_vs_fastest_grid_first_pass"}
    # the final: one adjacent pair of the top plan and the grid's entry, judged by their ratio
    [[a, b]] = res["finals"]["grid-00"]["pairs"]
    assert res["checks"]["top_vs_fastest_grid"]["value"] == pytest.approx(a / b)
    assert "final, top vs grid-00: median ratio" in proc.stdout
    assert res["checks"]["top_peak_rss_bytes"]["ok"]
    assert "| **top** dp=1 pp=2 1f1b 8x4 [5, 1] | 0.400 |" in proc.stdout


def test_rounds_combine_into_their_median_or_fastest_and_the_largest_peak():
    rounds = [{"median_s": 0.40, "peak_rss_bytes": 10}, {"error": "exit 1"}, {"median_s": 0.30, "peak_rss_bytes": 30},
              {"median_s": 0.35, "peak_rss_bytes": 20}]
    med = bench_plan.combine_rounds(rounds, "median")
    assert med["median_s"] == 0.35 and med["fastest_s"] == 0.30 and med["peak_rss_bytes"] == 30
    assert med["round_medians_s"] == [0.40, None, 0.30, 0.35] and med["statistic"] == "median"
    assert bench_plan.combine_rounds(rounds, "fastest")["median_s"] == 0.30
    failed = bench_plan.combine_rounds([{"error": "exit 1"}], "median")
    assert "median_s" not in failed and failed["error"] == "exit 1"


def test_the_final_pairs_the_top_plan_with_each_close_configuration_and_takes_the_worst_median_ratio():
    rows = [{"median_s": 1.00, "config": {"schedule": "gpipe", "dp": 2, "pp": 1, "micro_batches": 1,
                                          "micro_batch_size": 16}},
            {"median_s": 1.08, "config": {"schedule": "zb-h1", "dp": 1, "pp": 2, "micro_batches": 8,
                                          "micro_batch_size": 4}},
            {"median_s": 1.20, "config": {}}, {"error": "exit 1", "config": {}}]
    # within 10 % of the fastest, the top plan's own twin (row 0 here) left out
    assert plan_finals.finalists(rows, 0.10, lambda r: False) == [0, 1]
    assert plan_finals.finalists(rows, 0.10, lambda r: r is rows[0]) == [1]
    assert plan_finals.finalists([{"error": "x"}], 0.1, lambda r: False) == []
    speed = {-1: [1.10, 1.00, 1.04], 0: [1.0, 1.0, 1.0], 1: [1.2, 0.9, 1.0]}
    calls = []

    def run(k, rnd):
        calls.append((k, rnd))
        return {"median_s": speed[k][rnd]}

    pairs = plan_finals.run_pairs(run, [0, 1], 3)
    # the top plan first in even rounds, second in odd ones, each pair adjacent
    assert calls[:4] == [(-1, 0), (0, 0), (-1, 0), (1, 0)] and calls[4:6] == [(0, 1), (-1, 1)]
    assert pairs[0]["ratio"] == pytest.approx(1.04) and pairs[1]["ratio"] == pytest.approx(1.04)
    check = plan_finals.final_check({0: pairs[0], 1: {**pairs[1], "ratio": 1.07}}, rows)
    assert check["value"] == 1.07 and not check["ok"] and "grid-01 (zb-h1 dp1 pp2 8x4)" in check["note"]
    assert plan_finals.final_check({}, rows)["ok"]
    # a close configuration whose every pair failed is no pass
    failed = plan_finals.final_check({0: pairs[0], 1: {"pairs": [], "ratios": [], "ratio": None}}, rows)
    assert not failed["ok"] and "grid-01" in failed["note"]


def test_negative_final_options_are_refused():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_plan.py"), "--config", GPT,
                           "--final-rounds", "-1"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--final-rounds (-1) and --final-within (0.1) must be >= 0" in proc.stderr
