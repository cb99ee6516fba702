"""Unit tests of the profile's line fit and of the engine calibration (trace summary, factors in predictions)."""

import json

import pytest
from support.plan import mlp_config, synthetic_profile

from hpcpipe.errors import ConfigError
from hpcpipe.plan.engine_calibration import FACTOR_RANGE, _factor, summarize_trace
from hpcpipe.plan.predict import Candidate, Predictor
from hpcpipe.profiles.profile import affine_fit
from hpcpipe.profiles.stage_cut import measured_cut


def test_the_line_through_exact_points_is_found():
    a, b = affine_fit({str(r): 0.002 + 0.0005 * r for r in (1, 2, 4, 8, 16, 32)})
    assert a == pytest.approx(0.002) and b == pytest.approx(0.0005)


def test_one_outlying_size_moves_the_line_less_than_joining_the_points_would():
    points = {str(r): 0.002 + 0.0005 * r for r in (1, 2, 4, 8, 16, 32)}
    points["2"] *= 0.6                       # one size measured 40 % fast (a quiet spell, a cache that held it)
    a, b = affine_fit(points)
    assert abs((a + 2 * b) / (0.002 + 0.001) - 1) < 0.25     # the point alone says -40 %
    assert a + 16 * b == pytest.approx(0.002 + 0.008, rel=0.05)


def test_no_negative_fixed_or_per_row_cost():
    a, b = affine_fit({"1": 1.0, "10": 20.0, "100": 210.0})     # the free line crosses below 0 at 0 rows
    assert a == 0.0 and b > 0
    a, b = affine_fit({"1": 5.0, "10": 4.9, "100": 4.8})         # the free line falls with the rows
    assert b == 0.0 and a == pytest.approx(4.9, rel=0.05)
    assert affine_fit({"8": 4.0}) == (0.0, 0.5)                   # one size: in proportion to the rows


def _event(cat, tid, step, stage, dur_us, cpu_us, ts_us=0):
    return {"ph": "X", "cat": cat, "name": cat, "pid": 0, "tid": tid, "ts": ts_us, "dur": dur_us,
            "args": {"step": step, "stage": stage, "mb": 0, "cpu_us": cpu_us}}


def _trace(tmp_path, events):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return str(path)


def test_trace_summary_takes_medians_of_steps_after_the_warm_up(tmp_path):
    events = []
    for step in range(6):
        slow = 10 if step < 2 else 1          # warm-up steps, left out
        start = step * 100_000
        for tid in (0, 1):
            t = start
            for _ in range(2):                # 2 micro-batches
                events.append(_event("F", tid, step, tid, 1000 * slow * (1 + tid), 1000 * slow * (1 + tid), t))
                t += 1000 * slow * (1 + tid)
                events.append(_event("B", tid, step, tid, 2000 * slow * (1 + tid), 2000 * slow * (1 + tid), t))
                t += 2000 * slow * (1 + tid)
            # the allreduce's own wall time (its transfer, its polls) is no replica's wait
            events.append(_event("ALLREDUCE", tid, step, tid, 50_000, 100, t))
    got = summarize_trace(_trace(tmp_path, events))
    assert got["forward_s"] == pytest.approx([1e-3, 2e-3])      # per stage, per micro-batch, CPU time
    assert got["backward_s"] == pytest.approx([2e-3, 4e-3])
    # rank 0 ends its compute at 6 ms, rank 1 at 12 ms: on average a rank waits 3 ms for the last one
    compute = (2 * (1e-3 + 2e-3) + 2 * (2e-3 + 4e-3)) / 2
    assert got["sync_share"] == pytest.approx(3e-3 / compute)
    # a wait far above the compute is capped
    for e in events:
        if e["tid"] == 1 and e["cat"] == "B":
            e["ts"] += 10 ** 6
    assert summarize_trace(_trace(tmp_path, events))["sync_share"] == 0.5


def test_a_trace_without_compute_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="no forward and backward"):
        summarize_trace(_trace(tmp_path, [_event("ALLREDUCE", 0, 3, 0, 10, 10)]))


def test_factors_are_kept_in_a_sane_range():
    low, high = FACTOR_RANGE
    assert _factor(1.2, 1.0) == 1.2
    assert _factor(100.0, 1.0) == high and _factor(0.0, 1.0) == low


def _calibrated(config, per_row, engine):
    profile = synthetic_profile(config, per_row)
    profile.data["engine"] = engine
    return profile


def test_engine_factors_scale_the_groups_replicas_or_pipeline():
    config = mlp_config([8] * 5, micro_batches=4, micro_batch_size=2)      # 4 layers
    engine = {"replicas": {"forward": [1.5] * 4, "backward": [2.0] * 4, "sync_share": 0.0},
              "pipeline": {"forward": [1.0, 1.0, 1.0, 3.0], "backward": [1.0, 1.0, 1.0, 3.0], "stage_layers": [2, 2]}}
    profile = _calibrated(config, {i: 0.01 for i in range(4)}, engine)
    assert profile.seconds("F", 0, 4) == pytest.approx(1.5 * 0.04)
    assert profile.seconds("W", 3, 4) == pytest.approx(2.0 * 0.04)
    assert profile.seconds("F", 3, 4, pipelined=True) == pytest.approx(3.0 * 0.04)
    assert profile.raw_seconds("F", 3, 4) == pytest.approx(0.04)
    # the pipeline's dear last group moves a block off its stage
    assert measured_cut(profile, 2, 4) == (3, 1)
    assert measured_cut(profile, 2, 4, raw=True) == (2, 2)


def test_gpipe_and_zb_h1_take_the_zero_bubble_runs_factors_the_others_the_1f1b_runs():
    config = mlp_config([8] * 5, micro_batches=4, micro_batch_size=2)
    engine = {"replicas": {"forward": [1.0] * 4, "backward": [1.0] * 4, "sync_share": 0.0},
              "pipeline": {"forward": [1.5] * 4, "backward": [1.5] * 4, "stage_layers": [2, 2]},
              "pipeline_zb": {"forward": [1.1] * 4, "backward": [1.2] * 4, "stage_layers": [2, 2]}}
    profile = _calibrated(config, {i: 0.01 for i in range(4)}, engine)
    for schedule in ("gpipe", "zb-h1"):
        assert profile.seconds("F", 3, 4, pipelined=True, schedule=schedule) == pytest.approx(1.1 * 0.04)
        assert profile.seconds("I", 3, 4, pipelined=True, schedule=schedule) == pytest.approx(1.2 * 0.04)
    for schedule in ("1f1b", "interleaved-1f1b", "zb-v"):
        assert profile.seconds("F", 3, 4, pipelined=True, schedule=schedule) == pytest.approx(1.5 * 0.04)
    assert profile.seconds("F", 3, 4, schedule="zb-h1") == pytest.approx(0.04)       # no pipeline: the replicas'
    del engine["pipeline_zb"]                                      # a profile calibrated before the ZB-H1 run
    assert profile.seconds("F", 3, 4, pipelined=True, schedule="zb-h1") == pytest.approx(1.5 * 0.04)
    # the prediction of a plan uses its own schedule's factors
    engine["pipeline_zb"] = {"forward": [1.0] * 4, "backward": [1.0] * 4, "stage_layers": [2, 2]}
    zb, one = Candidate(1, 2, "zb-h1", 1, 4, 2, (2, 2)), Candidate(1, 2, "1f1b", 1, 4, 2, (2, 2))
    plain = synthetic_profile(config, {i: 0.01 for i in range(4)})
    assert Predictor(config, profile).predict(zb).busy_max_s == pytest.approx(
        Predictor(config, plain).predict(zb).busy_max_s)
    assert Predictor(config, profile).predict(one).busy_max_s == pytest.approx(
        1.5 * Predictor(config, plain).predict(one).busy_max_s)


def test_a_zero_bubble_trace_counts_input_and_weight_halves_as_one_backward(tmp_path):
    events = []
    for step in range(4):
        t = step * 100_000
        for _ in range(2):
            for cat, us in (("F", 1000), ("I", 1500), ("W", 500)):
                events.append(_event(cat, 0, step, 0, us, us, t))
                t += us
    got = summarize_trace(_trace(tmp_path, events))
    assert got["forward_s"] == pytest.approx([1e-3]) and got["backward_s"] == pytest.approx([2e-3])


def test_replicas_wait_is_added_to_data_parallel_plans_only():
    config = mlp_config([8] * 5, micro_batches=4, micro_batch_size=2)
    per_row = {i: 0.01 for i in range(4)}
    plain = synthetic_profile(config, per_row)
    waiting = _calibrated(config, per_row, {"replicas": {"forward": [1.0] * 4, "backward": [1.0] * 4,
                                                        "sync_share": 0.1}})
    dp = Candidate(2, 1, "gpipe", 1, 4, 2, (4,))
    pp = Candidate(1, 2, "1f1b", 1, 4, 2, (2, 2))
    base, late = Predictor(config, plain).predict(dp), Predictor(config, waiting).predict(dp)
    assert late.step_time_s == pytest.approx(base.step_time_s + 0.1 * base.busy_max_s)
    assert Predictor(config, waiting).predict(pp).step_time_s == pytest.approx(
        Predictor(config, plain).predict(pp).step_time_s)


def test_the_plan_says_how_it_was_calibrated():
    from hpcpipe.plan.command import engine_text

    engine = {"replicas": {"forward": [1.2, 1.2], "backward": [1.0, 1.0], "sync_share": 0.05},
              "pipeline": {"forward": [1.0, 2.0], "backward": [1.0, 2.0]}}
    assert engine_text(engine) == ("real runs take replicas 1.10x, pipeline 1F1B 1.50x the layer bench's times; "
                                   "replicas wait 5.0% of a step at the allreduce")
    engine["pipeline_zb"] = {"forward": [1.0, 1.0], "backward": [1.0, 1.4]}
    assert engine_text(engine).startswith("real runs take replicas 1.10x, pipeline 1F1B 1.50x, ZB-H1 1.10x the")
    assert engine_text({"failed": "the calibration run failed (exit status 1)"}).startswith(
        "not calibrated (the calibration run failed (exit status 1))")


def test_a_failed_calibration_run_leaves_the_bench_times_and_says_so(monkeypatch):
    from hpcpipe.plan import engine_calibration, profiling

    def fail(*args, **kwargs):
        raise ConfigError("the calibration run (dp=2 x pp=1) failed (exit status 1): mpiexec -n 2 ...\n  | MemoryError")

    monkeypatch.setattr(engine_calibration, "calibrate", fail)
    config = mlp_config([8] * 3)
    said = []
    engine = profiling._engine_factors(config, synthetic_profile(config, {0: 0.01, 1: 0.01}), 2, said.append)
    assert engine == {"failed": "the calibration run (dp=2 x pp=1) failed (exit status 1): mpiexec -n 2 ..."}
    assert any("warning: a calibration run failed" in line for line in said)
    bench = synthetic_profile(config, {0: 0.01, 1: 0.01})
    bench.data["engine"] = engine
    assert bench.seconds("F", 0, 4) == bench.raw_seconds("F", 0, 4) and bench.sync_share == 0.0
