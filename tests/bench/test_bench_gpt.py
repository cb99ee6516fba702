"""The GPT benchmark (bench/bench_gpt.py): its formulas against the real layers, and a --quick run end to end."""

import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest
from support import ROOT

from hpcpipe.nn.core.decoder_model import Decoder
from hpcpipe.nn.gpt.model import GPTModel
from hpcpipe.nn.gpt.shape import GPTShape, group_params
from hpcpipe.nn.memory import cache_bytes

sys.path.insert(0, str(ROOT / "bench"))
import gpt_cost  # noqa: E402  (bench/ is not a package)


def test_stash_formula_counts_what_each_layer_keeps():
    shape = size = GPTShape(vocab=50, seq_len=12, d_model=24, n_heads=3, n_blocks=2, d_ff=40, tied=False)
    tokens = np.random.default_rng(0).integers(0, 50, (3, 12))
    _, caches = Decoder(GPTModel(shape)).forward(tokens)
    for group, cache in enumerate(caches):
        measured = cache_bytes(cache)          # what the engine counts
        assert measured == gpt_cost.stage_stash_bytes(size, 3, range(group, group + 1)), group


def test_parameter_count_matches_the_groups():
    shape = size = GPTShape(vocab=50, seq_len=12, d_model=24, n_heads=3, n_blocks=2, tied=False)
    total = sum(int(np.prod(dims)) for g in range(shape.n_groups) for _, dims in group_params(shape, g))
    counts = gpt_cost.params(size)
    assert counts["total"] == total
    assert counts["flop_counted"] == total - 50 * 24 - 12 * 24
    assert gpt_cost.flops_per_token(size) == 6 * counts["flop_counted"] + 12 * 2 * 12 * 24


def test_in_flight_micro_batches():
    assert [gpt_cost.in_flight("gpipe", 8, 2, s) for s in (0, 1)] == [8, 8]
    assert [gpt_cost.in_flight("1f1b", 8, 2, s) for s in (0, 1)] == [2, 1]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                    reason="the benchmark compares against PyTorch: pip install torch==2.13.0")
def test_quick_benchmark_writes_positive_results(tmp_path):
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_gpt.py"), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| schedule | hpcpipe tokens/s | torch tokens/s |" in proc.stdout
    res = json.loads(out.read_text())
    assert res["rate2048_gflops"] > 0 and res["flops_per_token"] > 0 and res["tokens_per_step"] > 0
    keys = {"hpcpipe/gpipe/recompute-none", "hpcpipe/1f1b/recompute-none", "hpcpipe/1f1b/recompute-stage",
            "torch/gpipe", "torch/1f1b"}
    assert set(res["runs"]) == keys
    for key, run in res["runs"].items():
        assert run["median_s"] > 0 and all(t > 0 for t in run["times"]), key
        # the same model, weights and batch in both frameworks: the same first loss
        assert run["loss_step0"] == pytest.approx(res["loss_reference"], rel=1e-4), key
    # the engine's measured peak stash bytes per stage follow the formula (within the 10 %)
    for key, formula in (("hpcpipe/1f1b/recompute-none", res["stash_formula"]["none"]),
                         ("hpcpipe/1f1b/recompute-stage", res["stash_formula"]["stage"]),
                         ("hpcpipe/gpipe/recompute-none", res["stash_formula_gpipe"])):
        peaks = res["runs"][key]["peak_stash_bytes_by_stage"]
        assert len(peaks) == len(formula) == 2 and all(p > 0 for p in peaks), key
        assert peaks == pytest.approx(formula, rel=0.1), key
