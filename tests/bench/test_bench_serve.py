"""The serving benchmark (bench/bench_serve.py): its window arithmetic, and a --quick run against the real server."""

import json
import subprocess
import sys

import pytest
from support import ROOT

sys.path.insert(0, str(ROOT / "bench"))
from serve_load import Record, window_stats  # noqa: E402  (bench/ is not a package)


def test_window_counts_tokens_gaps_and_ttft_inside_the_window_only():
    # request a: sent before the window, tokens at 0.5 (outside), 1.5, 2.0 (2 tokens in one event), done at 2.0
    a = Record(0.2, [(0.5, 1), (1.5, 1), (2.0, 2)], done=True, usage=4, status=200)
    # request b: sent inside, first token 0.3 s later, then one gap of 0.2 s; cut by the window's end at 3.0
    b = Record(2.1, [(2.4, 1), (2.6, 1), (3.5, 1)], done=False, status=200)
    c = Record(2.2, [], status=429)
    w = window_stats([a, b, c], 1.0, 3.0)
    assert w["tokens"] == 1 + 2 + 1 + 1 and w["tokens_per_s"] == pytest.approx(2.5)
    assert w["requests_done"] == 1 and w["requests_started"] == 2 and w["errors"] == 1
    assert w["ttft_n"] == 1 and w["ttft_p50_ms"] == pytest.approx(300.0)
    # gaps: a 1.0, 0.5 and 0 (the event's second token); b 0.2 (its first token is its TTFT, not a gap)
    assert w["itl_n"] == 4 and w["itl_zero_share"] == pytest.approx(0.25)
    assert w["itl_p50_ms"] == pytest.approx(350.0) and w["itl_p99_ms"] <= 1000.0
    assert w["usage_mismatches"] == 0
    # the one long gap (>= 2 x p50: a's 1.0 s) ends when no request's first token arrives ...
    assert w["itl_long_n"] == 1 and w["itl_long_with_first_token_share"] == 0.0
    # ... unless one does (its prefill rode on the step that delayed a's token)
    d = Record(1.2, [(1.5005, 1)], status=200)
    assert window_stats([a, b, c, d], 1.0, 3.0)["itl_long_with_first_token_share"] == 1.0
    a.usage = 5
    assert window_stats([a], 1.0, 3.0)["usage_mismatches"] == 1


@pytest.mark.slow
def test_quick_benchmark_measures_every_point(tmp_path):
    out = tmp_path / "results_serve.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_serve.py"), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| layout | ranks | clients | tokens/s |" in proc.stdout
    res = json.loads(out.read_text())
    assert res["machine"]["cores"] >= 1 and res["machine"]["gemm_2048_1core_gflops"] > 0
    assert "NumPy" in res["machine"]["library"] and "mpi4py" in res["machine"]["library"]
    assert res["exit_status"] == {"pp1": 0, "pp1-nocache": 0, "pp2": 0}      # SIGTERM drained every server
    points = {(p["layout"], p["concurrency"]) for p in res["points"]}
    assert points == {(layout, c) for layout in ("pp1", "pp1-nocache", "pp2") for c in (1, 4)}
    for p in res["points"]:
        key = (p["layout"], p["concurrency"])
        assert p["tokens_per_s"] > 0 and p["tokens"] > 0 and p["requests_done"] > 0, key
        assert p["errors"] == 0 and p["usage_mismatches"] == 0 and p["idle_after"], key
        assert 0 < p["ttft_p50_ms"] <= p["ttft_p99_ms"], key
        assert 0 <= p["itl_p50_ms"] <= p["itl_p99_ms"], key
        # what the clients received in the window is what the server says it generated in it
        assert p["server"]["tokens_per_s"] == pytest.approx(p["tokens_per_s"], rel=0.25), key
    names = [g["name"] for g in res["goals"]]
    assert len(names) == 6 and any("5x no-cache" in n for n in names)
    assert all(g["pass"] is not None for g in res["goals"] if "8 ranks" not in g["name"])
    assert "PASS" in proc.stdout or "FAIL" in proc.stdout


@pytest.mark.slow
def test_quick_ceiling_bounds_each_layout_by_its_ranks_cpu_time(tmp_path):
    out = tmp_path / "ceiling.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_serve_ceiling.py"), "--quick", "--seconds", "1",
                           "--layouts", "pp1,pp2", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "pp2 / pp1: " in proc.stdout and "(goal >= 1.8)" in proc.stdout
    res = json.loads(out.read_text())
    assert [(r["layout"], r["dp"], r["pp"], r["rows_per_step"]) for r in res["results"]] == \
        [("pp1", 1, 1, 32), ("pp2", 1, 2, 16)]
    for r in res["results"]:
        cpu = r["cpu_s"]
        assert len(cpu) == r["dp"] * r["pp"] and min(cpu) > 0 and r["rounds"] >= 2, r
        # sequences x rounds over the time a perfect scheduler needs for that CPU time
        ideal = max(sum(cpu) / min(r["cores"], len(cpu)), max(cpu))
        assert r["tokens_per_s"] == pytest.approx(32 * r["rounds"] / ideal)
        # no rank used more CPU than wall time, so the bound is at least what the ranks reached side by side
        assert r["tokens_per_s"] >= 0.95 * r["side_by_side_tokens_per_s"] > 0, r


def test_ceiling_rounds_are_the_decode_steps_the_server_runs():
    from bench_serve_ceiling import LAYOUTS, QUICK, Rank, positions, stage_ranges

    from hpcpipe.nn.core.decode import Segment
    assert LAYOUTS["dp2xpp4"] == (2, 4, 4) and LAYOUTS["dp2xpp4-mb1"] == (2, 4, 1)
    pos = positions(QUICK, 32)
    assert pos.min() == QUICK["prompt_chars"] and pos.max() == QUICK["prompt_chars"] + QUICK["max_tokens"] - 1
    ranges = stage_ranges(QUICK, 2)
    assert ranges[0].start == 0 and ranges[-1].stop == QUICK["n_blocks"] + 2
    first = Rank(QUICK, ranges[0], 8, 2, gemm_only=False)
    # two groups of 4 decode rows, each sequence one new token at its own position
    pos8 = positions(QUICK, 8)
    assert [[(s.slot, s.start, s.length) for s in segs] for _, segs in first.steps] == \
        [[(i, int(pos8[i]), 1) for i in range(4)], [(i, int(pos8[i]), 1) for i in range(4, 8)]]
    x, segs = first.steps[0]
    assert first.stage.forward(x, segs).shape == (4, QUICK["d_model"])
    # 8 sequences of max_tokens 16 admit a prompt every other round, prefilled whole into the spare slot 8
    assert [(s.slot, s.start, s.length) for s in first.prompt[1]] == [(8, 0, QUICK["prompt_chars"])]
    calls = []
    first._forward = lambda x, segs: calls.append(sum(s.length for s in segs))
    for _ in range(4):
        first.round()
    assert calls == [4, 4, 4, 4, QUICK["prompt_chars"]] * 2
    last = Rank(QUICK, ranges[1], 8, 1, gemm_only=True)
    # the last stage's products include the tied head (d x vocab)
    assert any(w.shape == (QUICK["d_model"], 96) for w in last.weights)
    assert isinstance(segs[0], Segment)
