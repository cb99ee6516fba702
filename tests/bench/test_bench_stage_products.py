"""bench/bench_stage_products.py: it measures the products it counts, and refuses bad options with one line."""

import json
import subprocess
import sys

import numpy as np
import pytest
from support import ROOT

from hpcpipe.kernels import cpu

sys.path.insert(0, str(ROOT / "bench"))
import bench_stage_products as stage  # noqa: E402  (bench/ is not a package)


def test_a_block_holds_the_four_products_in_each_format():
    rng = np.random.default_rng(0)
    for fmt in stage.FORMATS:
        weights = stage.block_weights(fmt, rng)
        assert [w.shape for w in weights] == stage.BLOCK
        assert {w.kind for w in weights} == {fmt}


@pytest.mark.skipif(cpu.library() is None, reason="the compiled kernels are not built")
def test_the_json_counts_each_pass_s_flops_and_bytes(tmp_path):
    out = tmp_path / "r.json"
    assert stage.main(["--blocks", "2", "--rows", "1,5", "--formats", "float32,q8_0", "--repeats", "1",
                       "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [(r["format"], r["M"]) for r in res["rows"]] == [("float32", 1), ("float32", 5), ("q8_0", 1), ("q8_0", 5)]
    per_block = sum(n * k for n, k in stage.BLOCK)
    for r in res["rows"]:
        assert r["gflops"] == pytest.approx(2.0 * r["M"] * 2 * per_block / r["seconds"] / 1e9)
    assert res["rows"][0]["weight_bytes"] == 2 * per_block * 4
    assert res["rows"][2]["weight_bytes"] == 2 * per_block * (1 + 2 / 32)       # int8 + one float16 per 32


@pytest.mark.parametrize("args, words", [(["--rows", "0,4"], "--rows (0,4)"), (["--rows", "a"], "--rows 'a'"),
                                         (["--formats", "f64"], "unknown f64"),
                                         (["--out", "/nonexistent/r.json"], "does not exist or is not writable")])
def test_a_bad_option_is_one_line(args, words):
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_stage_products.py"), *args],
                         capture_output=True, text=True)
    assert run.returncode == 2 and words in run.stderr and "Traceback" not in run.stderr
