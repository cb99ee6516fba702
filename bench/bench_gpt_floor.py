"""The shortest step any NumPy engine could take for bench_gpt.py's GPT at pp=2, next to torch in the same run.

    python bench/bench_gpt_floor.py              # floor, torch and hpcpipe, 2 rounds (about 2 minutes when quiet)
    python bench/bench_gpt_floor.py --no-jobs    # only the floors (about 40 s)
    python bench/bench_gpt_floor.py --quick      # a tiny model, one short round (the smoke test runs this)

Issue #13 asks hpcpipe for 1.3x the tokens/s of torch.distributed.pipelining at pp=2
(GPipe and 1F1B). This script measures what that asks for. Each pipeline stage is a
process (one BLAS thread) holding the stage's arrays at bench_gpt.py's cut; both run
side by side on the 2 cores, as the training ranks do, and repeat one micro-batch's
**unavoidable** kernels, nothing else:

* every matrix product of the model at its real shape: each weight's forward, input
  gradient and weight gradient (the embedding tables are gathers, not products), and
  attention's QK^T and PV with their four backward products, whose time is counted
  at (T + 1) / 2T: a causal kernel could skip the masked half;
* one transcendental per value that needs one: an ``exp`` per GELU hidden value (the
  tanh approximation written as x / (1 + exp(-2u)); NumPy's float32 exp is about twice
  as fast as its tanh here), per causal attention score and per logit;
* once a step, Adam's three rewritten arrays (moments and parameters of the stage),
  one pass each: the least memory traffic of any Adam update.

LayerNorm, biases, residuals, the softmax and GELU arithmetic, the loss, every
backward elementwise pass, the rest of Adam, the messages and the schedule are left
out: free. Per stage the best (least) forward time f, backward time b (a micro-batch)
and update time a over the repeats are kept. Any schedule with whole backwards
(GPipe, 1F1B) needs at least ``f0 + m (f1 + b1) + b0 + a0`` (stage 1 can start only
after stage 0's first forward, and stage 0 ends with the backward that follows
stage 1's last, then its update), ``m (f0 + b0) + a0`` and ``f0 + m (f1 + b1) + a1``.
The floor is the largest. torch's step time divided by the floor is
the largest speed-up over torch that any engine built from NumPy kernels could show.

The **lean-NumPy floor** adds the elementwise work of the model's contract in few
NumPy calls (``lean_passes``; a lean count, not a proven minimum: folding LayerNorm's
affine map and centring and the biases into the products saves a few ms more, see
docs/bench-gpt.md). NumPy cannot fuse two operations, so each is at least one pass
(a scalar multiply into a preallocated array, the cheapest pass) or one sum over rows
or columns. LayerNorm forward 5 passes + 2 row
sums, backward 6 passes + 2 row sums + 2 column sums (its weight and bias
gradients); a bias 1 pass, its gradient 1 column sum; GELU 6 passes forward
(besides the exp), 7 backward; the causal softmax 1 row sum + 1 pass forward, 3
passes + 1 row sum backward; the loss 1 row sum + 1 pass; the embedding 1 pass each
way; Adam 7 passes over the stage's parameters. A sum is a product with a ones vector
(2.6x faster than ``np.add.reduce`` here). Residual sums are free (a product
can accumulate into its input), and so are the softmax's and the loss's maximum.
Then the torch and hpcpipe jobs of bench_gpt.py run in the same rounds (best round
each). Analysis: docs/bench-gpt.md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shlex
import sys
import tempfile
import time

os.environ.update({k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                                     "BLIS_NUM_THREADS", "HPCPIPE_THREADS")})

import numpy as np  # noqa: E402  (after the thread caps)
from bench_gpt import FULL, MODEL_KEYS, QUICK, hpcpipe_overrides, run_hpcpipe, torch_args, write_tokens  # noqa: E402
from bench_schedules import ROOT, load, run_job, wait_quiet  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "src"))
from hpcpipe.nn.gpt.shape import GPTShape, group_params  # noqa: E402


def model_shape(size: dict) -> GPTShape:
    """The benchmark's GPT (untied head, as in bench_gpt.py)."""
    return GPTShape(**{k: size[k] for k in MODEL_KEYS}, tied=False)


def stage_groups(size: dict) -> list[range]:
    """bench_gpt.py's cut: stage 0 = embedding + the first half of the blocks, stage 1 = the rest + the head."""
    split = size["n_blocks"] // 2
    return [range(0, 1 + split), range(1 + split, size["n_blocks"] + 2)]


def weight_products(shape: GPTShape, groups: range) -> list[tuple[int, int]]:
    """(in, out) of every weight matrix the stage multiplies by, in forward order (a tied head reads tok_emb)."""
    dims = [d for g in groups for name, d in group_params(shape, g)
            if len(d) == 2 and name not in ("tok_emb", "pos_emb")]
    if shape.tied and shape.n_blocks + 1 in groups:
        dims.append((shape.d_model, shape.vocab))
    return dims


def causal_fraction(t: int) -> float:
    """Share of a T x T score matrix a causal kernel must compute: (T + 1) / 2T."""
    return (t + 1) / (2 * t)


def floor_flops(shape: GPTShape, groups: range, b: int) -> float:
    """FLOPs of one micro-batch's products on a stage (forward + backward), attention counted fully."""
    rows, t = b * shape.seq_len, shape.seq_len
    dense = sum(6 * rows * i * o for i, o in weight_products(shape, groups))
    blocks = sum(1 for g in groups if 1 <= g <= shape.n_blocks)
    return dense + blocks * 12 * rows * t * shape.d_model


def pipeline_floor(f: list[float], b: list[float], a: list[float], m: int) -> float:
    """Least step time of a pp=2 schedule with whole backwards and an update a per stage (see the module doc)."""
    return max(f[0] + m * (f[1] + b[1]) + b[0] + a[0], m * (f[0] + b[0]) + a[0], f[0] + m * (f[1] + b[1]) + a[1])


def lean_passes(shape: GPTShape, groups: range, b: int) -> tuple[list, list]:
    """The (kind, (rows, width)) NumPy calls of a stage's micro-batch, forward and backward (module doc).

    kind: "p" an elementwise pass, "r" a sum over each row, "c" a sum over each column.
    """
    rows, d, ff, t = b * shape.seq_len, shape.d_model, shape.ff, shape.seq_len
    rd, scores = (rows, d), (b * shape.n_heads * t, (t + 1) // 2)     # the causal half of the scores
    ln_fwd = [("r", rd)] * 2 + [("p", rd)] * 5
    ln_bwd = [("p", rd)] * 6 + [("r", rd)] * 2 + [("c", rd)] * 2
    biases = [(rows, 3 * d), rd, (rows, ff), rd]
    fwd: list = []
    bwd: list = []
    for g in groups:
        if g == 0:
            fwd.append(("p", rd))
            bwd.append(("p", rd))
        elif g <= shape.n_blocks:
            fwd += 2 * ln_fwd + [("p", x) for x in biases] + [("p", (rows, ff))] * 6 + [("r", scores), ("p", scores)]
            bwd += [("p", (rows, ff))] * 7 + [("p", scores)] * 3 + [("r", scores)] + 2 * ln_bwd
            bwd += [("c", x) for x in biases]
        else:
            fwd += ln_fwd + [("r", (rows, shape.vocab)), ("p", (rows, shape.vocab))]
            bwd += ln_bwd
    return fwd, bwd


# moments kept rescaled by beta^-t (renormalised now and then) so that Adam is BLAS saxpy, square, saxpy, sqrt,
# add eps, divide, saxpy: 7 calls (the 10 of the plain formula took 9.4 ms here, these 7 6.8 ms)
ADAM_PASSES = 7


class StageKernels:
    """One stage's unavoidable kernels for one micro-batch of b sequences, on preallocated float32 arrays."""

    def __init__(self, shape: GPTShape, groups: range, b: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        rows, t, h, dh = b * shape.seq_len, shape.seq_len, shape.n_heads, shape.d_head

        def a(*dims: int) -> np.ndarray:
            return rng.standard_normal(dims, dtype=np.float32)

        # per product: input, weight, output, output gradient, input gradient, weight gradient
        self.products = [(a(rows, i), a(i, o) * 0.02, a(rows, o), a(rows, o), a(rows, i), a(i, o))
                         for i, o in weight_products(shape, groups)]
        n_blocks = sum(1 for g in groups if 1 <= g <= shape.n_blocks)
        # per block: q, k, v, scores, score gradient, output (or its gradient), q, k and v gradients
        self.attention = [tuple(a(b * h, t, dh) for _ in range(3)) + (a(b * h, t, t), a(b * h, t, t))
                          + tuple(a(b * h, t, dh) for _ in range(4)) for _ in range(n_blocks)]
        scores = b * h * t * (t + 1) // 2
        self.exps = [a(rows * shape.ff) * 0.1 for _ in range(n_blocks)] + [a(scores) * 0.1 for _ in range(n_blocks)]
        if shape.n_blocks + 1 in groups:
            self.exps.append(a(rows * shape.vocab) * 0.1)
        self.exp_out = np.empty(max((x.size for x in self.exps), default=1), dtype=np.float32)
        self.causal = causal_fraction(t)
        n_params = sum(int(np.prod(d)) for g in groups for _, d in group_params(shape, g))
        self.adam_arrays = [a(n_params) for _ in range(4)]   # parameters, gradient, two moments
        arrays: dict = {}
        for _, dims in sum(lean_passes(shape, groups, b), []):
            if dims not in arrays:
                # a row or column sum as a product with a ones vector: 2.6x faster than np.add.reduce here
                arrays[dims] = (a(*dims), np.empty(dims, np.float32), np.empty(dims[0], np.float32),
                                np.empty(dims[1], np.float32), np.ones(dims[1], np.float32),
                                np.ones(dims[0], np.float32))
        self.passes = [[(kind, arrays[dims]) for kind, dims in calls] for calls in lean_passes(shape, groups, b)]

    def update(self) -> float:
        """Rewrite the two moments and the parameters once each (from the gradient); return the time in s."""
        p, g, m, v = self.adam_arrays
        start = time.perf_counter()
        np.add(m, g, out=m)
        np.add(v, g, out=v)
        np.add(p, m, out=p)
        return time.perf_counter() - start

    def lean(self, direction: int) -> float:
        """Run the lean-NumPy calls of the forward (0) or backward (1); return their time in s."""
        start = time.perf_counter()
        for kind, (x, out, row_sums, col_sums, ones_row, ones_col) in self.passes[direction]:
            if kind == "p":
                np.multiply(x, 1.0001, out=out)
            elif kind == "r":
                np.matmul(x, ones_row, out=row_sums)
            else:
                np.matmul(ones_col, x, out=col_sums)
        return time.perf_counter() - start

    def lean_update(self) -> float:
        """Adam as ADAM_PASSES elementwise passes over the stage's parameters; return the time in s."""
        p, g, m, _ = self.adam_arrays
        start = time.perf_counter()
        for i in range(ADAM_PASSES):
            np.multiply(g, 1.0001, out=(m, p)[i % 2])
        return time.perf_counter() - start

    def forward(self) -> float:
        """Run the forward kernels; return their time in s (attention products at the causal share)."""
        start = time.perf_counter()
        for x, w, y, *_ in self.products:
            np.matmul(x, w, out=y)
        for x in self.exps:
            np.exp(x, out=self.exp_out[:x.size])
        att = time.perf_counter()
        for q, k, v, s, _, o, *_ in self.attention:
            np.matmul(q, k.swapaxes(-1, -2), out=s)
            np.matmul(s, v, out=o)
        end = time.perf_counter()
        return att - start + (end - att) * self.causal

    def backward(self) -> float:
        """Run the backward kernels (input and weight gradients); return their time in s."""
        start = time.perf_counter()
        for x, w, _, gy, gx, gw in reversed(self.products):
            np.matmul(gy, w.T, out=gx)
            np.matmul(x.T, gy, out=gw)
        att = time.perf_counter()
        for q, k, v, s, gs, go, gq, gk, gv in self.attention:
            np.matmul(s.swapaxes(-1, -2), go, out=gv)
            np.matmul(go, v.swapaxes(-1, -2), out=gs)
            np.matmul(gs, k, out=gq)
            np.matmul(gs.swapaxes(-1, -2), q, out=gk)
        end = time.perf_counter()
        return att - start + (end - att) * self.causal


def floor_worker(args: tuple) -> tuple[float, ...]:
    """Build one stage's kernels; after warm-up and a barrier repeat them; return the least time of each part, s.

    The parts: forward, backward, update (the floor), then the lean-NumPy forward, backward and update calls.
    """
    size, index, repeats, barrier = args
    shape = model_shape(size)
    kernels = StageKernels(shape, stage_groups(size)[index], size["micro_batch_size"], seed=index)

    def once() -> tuple[float, ...]:
        return (kernels.forward(), kernels.backward(), kernels.update(), kernels.lean(0), kernels.lean(1),
                kernels.lean_update())

    once()
    barrier.wait()
    times = [once() for _ in range(repeats)]
    return tuple(min(column) for column in zip(*times, strict=True))


def measure_floor(size: dict, repeats: int) -> dict:
    """Run both stages' kernels side by side; return f, b per stage and the step floor."""
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager, ctx.Pool(2) as pool:
        barrier = manager.Barrier(2)
        out = pool.map(floor_worker, [(size, i, repeats, barrier) for i in range(2)])
    f, b, a, lf, lb, la = ([x[i] for x in out] for i in range(6))
    m = size["micro_batches"]
    lean = [[x + y for x, y in zip(u, v, strict=True)] for u, v in ((f, lf), (b, lb), (a, la))]
    return {"forward_s": f, "backward_s": b, "update_s": a, "step_s": pipeline_floor(f, b, a, m),
            "lean_forward_s": lf, "lean_backward_s": lb, "lean_update_s": la, "lean_step_s": pipeline_floor(*lean, m)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; --quick picks bench_gpt.py's tiny model and one short round."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, 2 timed steps, 1 round (a smoke run)")
    ap.add_argument("--rounds", type=int, default=None, help="repeat the floor and every job (2; --quick 1)")
    ap.add_argument("--repeats", type=int, default=None, help="micro-batches per floor measurement (40; --quick 5)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per job (6; --quick 2)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--no-jobs", action="store_true", help="only the floor (no torch or hpcpipe jobs)")
    ap.add_argument("--quiet-idle", type=float, default=0.9, help="before each measurement wait for this idle share")
    ap.add_argument("--quiet-wait", type=float, default=None, help="longest wait for quiet, s (60; --quick 0)")
    ap.add_argument("--out", default="", help="write the results as JSON here")
    args = ap.parse_args(argv)
    for name, quick, full in (("rounds", 1, 2), ("repeats", 5, 40), ("steps", 2, 6)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    args.warmup = 1 if args.quick and args.warmup == 2 else args.warmup
    args.quiet_wait = (0.0 if args.quick else 60.0) if args.quiet_wait is None else args.quiet_wait
    for name in ("rounds", "repeats", "steps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    return args


def run_jobs(size: dict, args: argparse.Namespace, tmp: str, data: str) -> dict[str, dict]:
    """One round of bench_gpt.py's torch and hpcpipe jobs (GPipe and 1F1B, no recompute)."""
    out, split = {}, size["n_blocks"] // 2
    metrics = os.path.join(tmp, "metrics.jsonl")
    for schedule in ("gpipe", "1f1b"):
        wait_quiet(args.quiet_idle, args.quiet_wait)
        out[f"torch/{schedule}"] = run_job(2, "torch_gpt_worker.py", torch_args(
            size, schedule, split, data, args.steps, args.warmup, 1e-3))
        wait_quiet(args.quiet_idle, args.quiet_wait)
        sets = hpcpipe_overrides(size, schedule, "none", split, data, metrics, args.warmup + args.steps, 1e-3)
        out[f"hpcpipe/{schedule}"] = run_hpcpipe(sets, metrics, args.warmup, tmp)
    return out


def main(argv: list[str] | None = None) -> int:
    """Measure the floor (and the jobs) for the given rounds, print the table, write the JSON."""
    args = parse_args(argv)
    size = dict(QUICK if args.quick else FULL)
    shape = model_shape(size)
    b, m = size["micro_batch_size"], size["micro_batches"]
    res: dict = {"command": shlex.join([sys.executable, *sys.argv]), "size": size, "repeats": args.repeats,
                 "flops_per_microbatch_by_stage": [floor_flops(shape, g, b) for g in stage_groups(size)],
                 "loads": [load()], "floors": [], "runs": {}}
    tmp = tempfile.mkdtemp(prefix="hpcpipe-bench-gpt-floor-")
    data = os.path.join(tmp, "tokens.h5")
    write_tokens(data, m * b, size)
    for rnd in range(args.rounds):
        wait_quiet(args.quiet_idle, args.quiet_wait)
        floor = measure_floor(size, args.repeats)
        res["floors"].append(floor)
        f, b, a = ([round(x * 1e3, 2) for x in floor[k]] for k in ("forward_s", "backward_s", "update_s"))
        print(f"round {rnd}: floor {floor['step_s'] * 1e3:.1f} ms/step (per stage, ms: forward {f} and backward "
              f"{b} a micro-batch, update {a}), lean-NumPy floor {floor['lean_step_s'] * 1e3:.1f} ms/step "
              f"(load {load()})", flush=True)
        if not args.no_jobs:
            for key, r in run_jobs(size, args, tmp, data).items():
                if key not in res["runs"] or r["median_s"] < res["runs"][key]["median_s"]:
                    res["runs"][key] = r
                print(f"round {rnd}: {key:16s} {r['median_s'] * 1e3:8.1f} ms/step", flush=True)
    res["loads"].append(load())
    report(res)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {args.out}")
    return 0


def report(res: dict) -> None:
    """Print both floors against torch and hpcpipe (from a results dict)."""
    floor = min(res["floors"], key=lambda x: x["step_s"])
    lean = min(x["lean_step_s"] for x in res["floors"])
    s = res["size"]
    tokens = s["micro_batches"] * s["micro_batch_size"] * s["seq_len"]
    gflops = [fl / (f + b) / 1e9 for fl, f, b in
              zip(res["flops_per_microbatch_by_stage"], floor["forward_s"], floor["backward_s"], strict=True)]
    print(f"\nfloor: {floor['step_s'] * 1e3:.1f} ms/step = {tokens / floor['step_s']:,.0f} tokens/s; lean-NumPy "
          f"floor {lean * 1e3:.1f} ms/step (best of {len(res['floors'])} rounds; stages' kernels at {gflops[0]:.1f} "
          f"and {gflops[1]:.1f} GFLOP/s counting attention fully; load before/after {res['loads'][0]} / "
          f"{res['loads'][-1]})")
    if not res["runs"]:
        return
    print("\n| schedule | torch ms/step | hpcpipe ms/step | hpcpipe / torch | floor ms/step | torch / floor | "
          "lean-NumPy floor ms/step | torch / lean floor |")
    print("|---|---|---|---|---|---|---|---|")
    for sched in ("gpipe", "1f1b"):
        t, h = res["runs"].get(f"torch/{sched}"), res["runs"].get(f"hpcpipe/{sched}")
        if t and h:
            print(f"| {sched} | {t['median_s'] * 1e3:.1f} | {h['median_s'] * 1e3:.1f} | "
                  f"{t['median_s'] / h['median_s']:.2f}x | {floor['step_s'] * 1e3:.1f} | "
                  f"{t['median_s'] / floor['step_s']:.2f}x | {lean * 1e3:.1f} | {t['median_s'] / lean:.2f}x |")
    print("(torch / floor: the largest speed-up over torch any engine of NumPy kernels could show)")


if __name__ == "__main__":
    sys.exit(main())
