"""bench/bench_gpt_floor.py: its products are the model's, and its bound is a lower bound of the simulator's steps."""

import json
import subprocess
import sys

import numpy as np
import pytest
from support import ROOT

from hpcpipe.nn.gpt.shape import GPTShape
from hpcpipe.schedule.costs import Costs
from hpcpipe.schedule.event_sim import simulate_schedule

sys.path.insert(0, str(ROOT / "bench"))
import bench_gpt_floor as floor  # noqa: E402  (bench/ is not a package)
import gpt_cost  # noqa: E402

SIZE = {"vocab": 50, "seq_len": 12, "d_model": 24, "n_heads": 3, "n_blocks": 4, "d_ff": 40,
        "micro_batches": 4, "micro_batch_size": 3}


def test_the_floor_multiplies_exactly_what_the_benchmark_counts():
    shape = floor.model_shape(SIZE)
    b, t = SIZE["micro_batch_size"], SIZE["seq_len"]
    counts = gpt_cost.params(shape)
    vectors = 2 * 2 * SIZE["d_model"] * SIZE["n_blocks"] + 2 * SIZE["d_model"]     # LayerNorms (weight, bias)
    vectors += SIZE["n_blocks"] * (3 * 24 + 24 + 40 + 24)                           # biases
    per_token = gpt_cost.flops_per_token(shape) - 6 * vectors     # every product FLOP of the MFU count
    stages = floor.stage_groups(SIZE)
    assert [list(g) for g in stages] == [[0, 1, 2], [3, 4, 5]]
    assert sum(floor.floor_flops(shape, g, b) for g in stages) == per_token * b * t
    assert counts["flop_counted"] - vectors == sum(i * o for g in stages for i, o in floor.weight_products(shape, g))


def test_the_kernels_hold_the_stage_s_products_and_transcendentals():
    shape = floor.model_shape(SIZE)
    b, t, h = SIZE["micro_batch_size"], SIZE["seq_len"], SIZE["n_heads"]
    first, last = (floor.StageKernels(shape, g, b) for g in floor.stage_groups(SIZE))
    for kernels, groups in ((first, [0, 1, 2]), (last, [3, 4, 5])):
        assert [w.shape for _, w, *_ in kernels.products] == floor.weight_products(shape, groups)
        assert len(kernels.attention) == 2
        assert kernels.forward() > 0 and kernels.backward() > 0 and kernels.update() > 0
    rows = b * t
    assert [x.size for x in first.exps] == [rows * 40] * 2 + [b * h * t * (t + 1) // 2] * 2
    assert [x.size for x in last.exps] == [rows * 40] * 2 + [b * h * t * (t + 1) // 2] * 2 + [rows * 50]
    # a tied head multiplies by the embedding table: the same (d, vocab) product
    tied = GPTShape(**{k: SIZE[k] for k in floor.MODEL_KEYS}, tied=True)
    assert floor.weight_products(tied, range(5, 6)) == [(24, 50)]
    assert floor.causal_fraction(12) == pytest.approx(13 / 24)


def test_lean_passes_are_the_documented_calls():
    shape = floor.model_shape(SIZE)
    b, t, d, ff = SIZE["micro_batch_size"], SIZE["seq_len"], 24, 40
    rows, scores = b * t, (b * 3 * t, (t + 1) // 2)
    (fwd0, bwd0), (fwd1, bwd1) = (floor.lean_passes(shape, g, b) for g in floor.stage_groups(SIZE))

    def count(calls, kind, dims):
        return sum(1 for c in calls if c == (kind, dims))

    # per block forward: 2 LayerNorms (5 passes, 2 row sums), 4 biases, GELU 6 passes, the softmax's sum and pass
    assert count(fwd1, "p", (rows, d)) == 2 * (2 * 5 + 2) + 5 and count(fwd1, "r", (rows, d)) == 2 * 4 + 2
    assert count(fwd1, "p", (rows, ff)) == 2 * 7 and count(fwd1, "p", (rows, 3 * d)) == 2
    assert count(fwd1, "r", scores) == count(fwd1, "p", scores) == 2
    assert count(fwd1, "r", (rows, 50)) == count(fwd1, "p", (rows, 50)) == 1      # the loss, last stage only
    # per block backward: GELU 7 passes, softmax 3 passes + 1 row sum, 2 LayerNorms, 4 bias gradients
    assert count(bwd1, "p", (rows, ff)) == 2 * 7 and count(bwd1, "c", (rows, ff)) == 2
    assert count(bwd1, "p", scores) == 2 * 3 and count(bwd1, "r", scores) == 2
    assert count(bwd1, "p", (rows, d)) == 2 * 12 + 6 and count(bwd1, "c", (rows, d)) == 2 * (4 + 2) + 2
    # the embedding: one pass each way, no loss on the first stage
    assert len(fwd0) == len(fwd1) - 7 - 2 + 1 and len(bwd0) == len(bwd1) - 10 + 1
    assert not any(dims == (rows, 50) for _, dims in fwd0 + bwd0)


@pytest.mark.parametrize("seed", range(20))
def test_the_floor_is_a_lower_bound_of_the_simulated_gpipe_and_1f1b(seed):
    rng = np.random.default_rng(seed)
    f, b = list(rng.uniform(0.5, 3, 2)), list(rng.uniform(0.5, 6, 2))
    a = float(rng.uniform(0, 2))
    m = int(rng.integers(1, 12))
    bound = floor.pipeline_floor(f, b, [a, a], m)
    costs = Costs(per_stage={("F", 0): f[0], ("F", 1): f[1], ("B", 0): b[0], ("B", 1): b[1]}, step=a)
    sims = {name: simulate_schedule(name, 2, m, costs=costs, per_rank_costs=False).step_time
            for name in ("gpipe", "1f1b")}
    assert all(s >= bound - 1e-9 for s in sims.values()), (sims, bound)
    if f[1] >= f[0] and b[1] >= b[0]:        # stage 1 the slower: 1F1B reaches the bound
        assert sims["1f1b"] == pytest.approx(bound)


def test_quick_floor_run(tmp_path):
    out = tmp_path / "floor.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_gpt_floor.py"), "--quick", "--no-jobs",
                           "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())
    (run,) = res["floors"]
    assert all(x > 0 for k in ("forward_s", "backward_s", "update_s") for x in run[k])
    m = res["size"]["micro_batches"]
    assert run["step_s"] == floor.pipeline_floor(run["forward_s"], run["backward_s"], run["update_s"], m)
    assert run["lean_step_s"] > run["step_s"] and all(x > 0 for x in run["lean_forward_s"] + run["lean_update_s"])
    assert "floor:" in proc.stdout and res["runs"] == {}


def test_bad_counts_are_refused():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_gpt_floor.py"), "--repeats", "0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--repeats must be at least 1, got 0" in proc.stderr
