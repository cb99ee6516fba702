"""The serving benchmark (bench/bench_serve.py): its window arithmetic, and a --quick run against the real server."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
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
