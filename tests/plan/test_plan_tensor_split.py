"""Tensor-parallel costs (issue #41): the profile measures the groups split as a tp rank holds them, plans take
those times instead of the whole group's / tp, the loss's collectives are counted as the engine makes them, and a
collective costs what the calibration's tp run measured beyond the comm model."""

import json

import numpy as np
import pytest
from support.plan import mlp_config, synthetic_profile

from hpcpipe.config import from_dict
from hpcpipe.nn.registry import model_def
from hpcpipe.plan.engine_calibration import POLL_CPU_S, summarize_tensor_trace, tensor_width
from hpcpipe.plan.layer_profile import _StageBench, bench_indices, profile_layers, tp_field
from hpcpipe.plan.predict import Candidate, Predictor
from hpcpipe.profiles.comm_model import CommModel

GPT = {"kind": "gpt", "vocab_size": 64, "seq_len": 8, "d_model": 16, "n_heads": 2, "n_blocks": 2,
       "tie_embeddings": False}


def gpt_config():
    return from_dict({"model": dict(GPT), "parallel": {"pp": 1}, "train": {"optimizer": "sgd"},
                      "checkpoint": {"dir": ""}})


def with_split(profile, tp: int, share: dict[int, float]):
    """Add measured split times to a synthetic profile: group i at tp costs share[i] of its whole time."""
    for i, part in share.items():
        group = profile._group(i)
        for op in "FIWB":
            group[tp_field(op, tp)] = {rows: seconds * part for rows, seconds in group[op].items()}
    return profile


def test_the_split_bench_computes_a_tp_ranks_part_and_the_profile_records_it():
    config = gpt_config()
    model = model_def(config)
    bench = _StageBench(model, bench_indices(model), np, "float32", 0, tp=2)
    head = model.n_layers - 1
    assert bench.params.local_shape(head, "head/weight") == (16, 32)        # half the vocabulary's columns
    assert bench.params.local_shape(0, "tok_emb") == (32, 16)               # the lookup's half of the table
    rng = np.random.default_rng(0)
    x = rng.integers(0, 64, size=(2, 8))
    caches, g = bench.forward(x, rng.integers(0, 64, size=(2, 8)), 2, rng, None)
    assert g.shape == (2, 8, 32)        # the vocabulary-parallel loss's gradient: this rank's logits only
    times = {tp_field(op, 2): {i: [] for i in bench.indices} for op in "FIWB"}
    bench.backward(caches, g, 2, rng, times, split=False)
    assert all(len(times["B/tp2"][i]) == 1 for i in bench.indices)
    layers = profile_layers(config, [1, 2], repeats=2, budget_s=0.0, tps=(2,))
    assert layers["tps"] == [2]
    for group in layers["groups"].values():
        for op in "FIWB":
            assert set(group[op]) == set(group[f"{op}/tp2"]) == {"1", "2"}
            assert all(v > 0 for v in group[f"{op}/tp2"].values())


def test_the_profile_reads_split_times_where_measured_and_a_share_elsewhere():
    config = mlp_config([8, 12, 8, 12, 4])
    profile = with_split(synthetic_profile(config, {i: 0.01 for i in range(4)}), 2, {1: 0.7})
    assert profile.raw_seconds("F", 1, 8, 2) == pytest.approx(0.7 * profile.raw_seconds("F", 1, 8))
    assert profile.raw_seconds("B", 0, 8, 2) == pytest.approx(profile.raw_seconds("B", 0, 8) / 2)
    assert profile.sizes_at(2) == [] and profile.sizes_at(4) == []       # measured for some groups only
    assert with_split(profile, 2, {i: 0.5 for i in range(4)}).sizes_at(2) == profile.sizes


def test_tp_plans_take_the_measured_split_compute():
    """Every group measured at 0.7 of its whole time when split over 2 (a block's replicated parts, its
    half-width products): the tp = 2 plan computes 0.7 of the tp = 1 plan's time, plus its collectives."""
    config = mlp_config([8, 12, 8, 12, 4], micro_batches=4, micro_batch_size=8)
    profile = with_split(synthetic_profile(config, {i: 0.01 for i in range(4)}), 2, {i: 0.7 for i in range(4)})
    predictor = Predictor(config, profile)
    one = predictor.predict(Candidate(1, 1, "gpipe", 1, 4, 8, (4,)))
    two = predictor.predict(Candidate(1, 1, "gpipe", 1, 4, 8, (4,), "profile", 2))
    collectives = sum(sum(predictor.tp_seconds(i, 8, 2)) for i in range(4))
    assert two.busy_max_s == pytest.approx(0.7 * one.busy_max_s + 4 * collectives)


def test_a_gpt_pays_the_collectives_its_layers_make():
    """Lookup: one sum of (rows, T, d); a block: two forward, two backward; the loss: a maximum of one float a
    token and one sum of two (denominator, target logit); the head's input gradient: one sum of (rows, T, d)."""
    config = gpt_config()
    profile = synthetic_profile(config, {i: 0.001 for i in range(4)}, latency=1e-5, per_byte=1e-9)
    predictor = Predictor(config, profile)
    ar = profile.comm.allreduce
    rows, tokens, act = 4, 4 * 8, 4 * 8 * 16 * 4
    assert predictor.tp_seconds(0, rows, 2) == pytest.approx((ar(act, 2), 0.0))
    assert predictor.tp_seconds(1, rows, 2) == pytest.approx((2 * ar(act, 2), 2 * ar(act, 2)))
    assert predictor.tp_seconds(3, rows, 2) == pytest.approx((ar(tokens * 4, 2) + ar(2 * tokens * 4, 2), ar(act, 2)))


def _tensor_run(profile, collective_s: float, forward: float = 1.0, backward: float = 1.0):
    profile.data["engine"] = {"tensor": {"tp": 2, "rows": 4, "collective_s": collective_s, "collectives": 20,
                                         "forward": [forward] * 4, "backward": [backward] * 4}}
    return profile


def test_a_collective_costs_what_the_tp_run_measured_beyond_the_model():
    config = gpt_config()
    profile = synthetic_profile(config, {i: 0.001 for i in range(4)}, latency=1e-5, per_byte=1e-9)
    modelled = sum(sum(Predictor(config, profile).tp_seconds(i, 4, 2)) for i in range(4))
    predictor = Predictor(config, _tensor_run(profile, modelled + 20 * 3e-4, 1.2, 1.1))
    assert predictor.tp_extra_s == pytest.approx(3e-4)
    act = profile.comm.allreduce(4 * 8 * 16 * 4, 2)
    assert predictor.tp_seconds(1, 4, 2) == pytest.approx((2 * (act + 3e-4), 2 * (act + 3e-4)))
    # the tp run's engine factors scale the split compute, and only the split compute
    assert profile.seconds("F", 1, 4, tp=2) == pytest.approx(1.2 * profile.raw_seconds("F", 1, 4, 2))
    assert profile.seconds("B", 1, 4, tp=2) == pytest.approx(1.1 * profile.raw_seconds("B", 1, 4, 2))
    assert profile.seconds("F", 1, 4) == pytest.approx(profile.raw_seconds("F", 1, 4))
    # collectives faster than the model (a noisy probe) add nothing, and take nothing away
    assert Predictor(config, _tensor_run(profile, 0.5 * modelled)).tp_extra_s == 0.0


def _x(cat, tid, step, ts, dur, cpu=None):
    args = {"step": step, "stage": 0, "mb": 0} if cat != "tp" else {"step": step}
    if cpu is not None:
        args["cpu_us"] = cpu
    return {"ph": "X", "cat": cat, "name": cat, "pid": 0, "tid": tid, "ts": ts, "dur": dur, "args": args}


def test_the_tp_run_trace_gives_compute_without_the_polls_and_the_collectives_per_micro_batch(tmp_path):
    poll = POLL_CPU_S * 1e6
    events = []
    for step in range(5):
        slow = 10 if step < 2 else 1          # warm-up steps, left out
        for tid in (0, 1):
            t = step * 100_000
            # a forward of 10 ms CPU with 2 collectives inside (0.2 ms and 2 ms: the longer one polls 0.5 ms)
            events.append(_x("F", tid, step, t, 13_000 * slow, (10_000 + 200 + poll) * slow))
            events += [_x("tp", tid, step, t + 1000, 200 * slow), _x("tp", tid, step, t + 5000, 2000 * slow)]
            t += 13_000 * slow
            events.append(_x("B", tid, step, t, 21_000 * slow, 20_000 * slow))
            events.append(_x("tp", tid, step, t + 100, 1000 * slow))
            events.append(_x("tp", tid, step, t + 30_000 * slow, 900))      # outside every action: not counted
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    got = summarize_tensor_trace(str(path))
    assert got["forward_s"] == pytest.approx([10e-3])
    assert got["backward_s"] == pytest.approx([20e-3 - POLL_CPU_S])
    assert got["collective_s"] == pytest.approx(3.2e-3) and got["collectives"] == 3


def test_collectives_that_carry_their_cpu_time_take_exactly_that_out_of_the_compute(tmp_path):
    events = []
    for step in range(2, 5):
        for tid in (0, 1):
            t = step * 100_000
            # a forward of 10 ms compute around a 3 ms collective that polled 1.7 ms of CPU (a learnt window)
            events.append(_x("F", tid, step, t, 14_000, 11_700))
            events.append(_x("tp", tid, step, t + 1000, 3000, 1700))
            events.append(_x("B", tid, step, t + 20_000, 21_000, 20_050))
            events.append(_x("tp", tid, step, t + 20_100, 400, 50))
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    got = summarize_tensor_trace(str(path))
    assert got["forward_s"] == pytest.approx([10e-3])
    assert got["backward_s"] == pytest.approx([20e-3])
    assert got["collective_s"] == pytest.approx(3.4e-3) and got["collectives"] == 2


def test_a_traced_collective_keeps_its_cpu_time_in_the_trace():
    from hpcpipe.trace import rank_events

    events = rank_events([(3, [("tp allreduce", 1.0, 1.004, 0.0015), ("tp allreduce", 2.0, 2.001)])], 0)
    assert events[0]["args"] == {"step": 3, "cpu_us": pytest.approx(1500.0)}
    assert events[1]["args"] == {"step": 3}


def test_the_tp_run_is_as_wide_as_the_model_splits():
    assert tensor_width(gpt_config(), 2) == 2
    assert tensor_width(gpt_config(), 4) == 2         # 2 heads: tp 4 does not split them
    assert tensor_width(gpt_config(), 1) == 1


def test_tp_collectives_cost_the_probes_polled_allreduce():
    """Over TCP a polled nonblocking allreduce took 10-15x the blocking one: the probe measures both, the tp
    collectives read the polled points (ring-scaled like the blocking ones), a probe without them the blocking."""
    sizes = [4096 * 4 ** k for k in range(5)]
    probe = {"p2p": [[n, 1e-5 + n * 1e-9] for n in sizes], "allreduce": [[n, 2e-5 + n * 1e-9] for n in sizes],
             "tp_allreduce": [[n, 10 * (2e-5 + n * 1e-9)] for n in sizes], "baseline_rss_bytes": 1 << 26}
    polled = CommModel.from_probe(probe)
    assert polled.tp_allreduce(sizes[2], 2) == pytest.approx(10 * polled.allreduce(sizes[2], 2))
    assert polled.tp_allreduce(sizes[2], 4) > polled.tp_allreduce(sizes[2], 2) and polled.tp_allreduce(9, 1) == 0.0
    again = CommModel.from_dict(json.loads(json.dumps(polled.to_dict())))
    assert again.tp_allreduce(sizes[2], 2) == polled.tp_allreduce(sizes[2], 2)
    blocking = CommModel.from_probe({k: v for k, v in probe.items() if k != "tp_allreduce"})
    assert blocking.tp_allreduce(sizes[2], 2) == blocking.allreduce(sizes[2], 2)
    config = gpt_config()
    profile = synthetic_profile(config, {i: 0.001 for i in range(4)})
    profile.comm = polled
    act = 4 * 8 * 16 * 4
    assert Predictor(config, profile).tp_seconds(1, 4, 2) == pytest.approx((2 * polled.tp_allreduce(act, 2),) * 2)
