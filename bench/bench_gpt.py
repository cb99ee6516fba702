"""GPT benchmark: hpcpipe vs torch.distributed.pipelining at pp=2 (GPipe, 1F1B), MFU, stash bytes, recompute.

    pip install -e ".[mpich]" && pip install torch==2.13.0   # torch only for the comparison
    python bench/bench_gpt.py [--quick] [--steps 6] [--rounds 2] [--out bench/results/YYYY-MM-DD-gpt.json]

One run, one model in both frameworks: hpcpipe's GPT contract with an untied head
(torch cannot tie across stages), float32, Adam, the same initial weights
(hpcpipe.nn.gpt.model.GPTModel.init_group, seed 0) and the same synthetic token batch (one
HDF5 file of random ids, read by both), cut after the same block (stage 0 =
embedding + the first half of the blocks). hpcpipe runs its real training command
(``mpiexec -n 2 python -m hpcpipe.train --set ...``; step time and peak stash bytes
per stage from its metrics lines), PyTorch runs bench/torch_gpt_worker.py; every
rank has one BLAS thread. Step time = median of the timed steps after warm-up; each
job runs once per round and keeps its best round (the machine is shared). MFU =
tokens/s x FLOPs per token / (2 cores x the one-core rate of a 2048^3 float32
matmul measured in this run, best sample); FLOPs per token as in gpt_cost.py:
6 x non-embedding parameters + 12 x n_blocks x T x d (attention, causal counted fully).
The step-0 losses of both frameworks are printed next to hpcpipe's sequential
reference on the same batch: equal losses show the two runs train the same model.
The results go to bench/results/<today>-gpt.json (--quick: <today>-gpt-quick.json)
unless --out says otherwise; --report FILE prints an earlier run's tables again.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile

import gpt_cost
import numpy as np
from bench_schedules import ENV, MPIEXEC, ROOT, dated_out, load, matmul_rate, run_job, wait_quiet, write_results

from hpcpipe.nn.gpt.shape import GPTShape

FULL = {"vocab": 512, "seq_len": 128, "d_model": 384, "n_heads": 6, "n_blocks": 4, "d_ff": 0,
        "micro_batches": 8, "micro_batch_size": 2}
QUICK = {"vocab": 64, "seq_len": 32, "d_model": 64, "n_heads": 4, "n_blocks": 2, "d_ff": 0,
         "micro_batches": 4, "micro_batch_size": 2}
MODEL_KEYS = ("vocab", "seq_len", "d_model", "n_heads", "n_blocks", "d_ff")
JOBS = [("hpcpipe", "gpipe", "none"), ("hpcpipe", "1f1b", "none"), ("hpcpipe", "1f1b", "stage"),
        ("torch", "gpipe", None), ("torch", "1f1b", None)]


def write_tokens(path: str, rows: int, size: dict, seed: int = 0) -> None:
    """Write one step's worth of random next-token windows: x = w[:-1], y = w[1:] (int32)."""
    import h5py
    w = np.random.default_rng(seed).integers(0, size["vocab"], (rows, size["seq_len"] + 1), dtype=np.int32)
    with h5py.File(path, "w") as f:
        f["x"], f["y"] = w[:, :-1], w[:, 1:]


def reference_loss(path: str, size: dict, rows: int) -> float:
    """Mean cross-entropy of hpcpipe's sequential GPT (initial weights) on the token file's first rows."""
    import h5py

    from hpcpipe.nn.core.decoder_model import Decoder
    from hpcpipe.nn.gpt.model import GPTModel
    from hpcpipe.nn.gpt.shape import GPTShape
    from hpcpipe.nn.token_loss import token_cross_entropy
    shape = GPTShape(vocab=size["vocab"], seq_len=size["seq_len"], d_model=size["d_model"],
                     n_heads=size["n_heads"], n_blocks=size["n_blocks"], d_ff=size["d_ff"], tied=False)
    with h5py.File(path, "r") as f:
        x, y = f["x"][:rows].astype(np.int64), f["y"][:rows].astype(np.int64)
    logits, _ = Decoder(GPTModel(shape)).forward(x)
    total, _ = token_cross_entropy(np, logits, y, 1.0)
    return float(total) / y.size


def hpcpipe_overrides(size: dict, schedule: str, recompute: str, split: int, data: str, metrics: str,
                      steps: int, lr: float) -> list[str]:
    """The --set items of one hpcpipe job (untied GPT, pp=2 cut after ``split`` blocks, Adam, no checkpoint)."""
    return [
        "model.kind=\"gpt\"", f"model.vocab_size={size['vocab']}", f"model.seq_len={size['seq_len']}",
        f"model.d_model={size['d_model']}", f"model.n_heads={size['n_heads']}",
        f"model.n_blocks={size['n_blocks']}", f"model.d_ff={size['d_ff']}", "model.tie_embeddings=false",
        "model.dtype=\"float32\"", "model.seed=0",
        "parallel.pp=2", "parallel.dp=1", f"parallel.schedule=\"{schedule}\"",
        f"parallel.stage_layers=[{1 + split}, {size['n_blocks'] - split + 1}]",
        f"data.path=\"{data}\"", f"train.micro_batches={size['micro_batches']}",
        f"train.micro_batch_size={size['micro_batch_size']}", "train.optimizer=\"adam\"", f"train.lr={lr}",
        f"train.steps={steps}", f"train.recompute=\"{recompute}\"",
        f"log.metrics=\"{metrics}\"", "log.progress=false", "checkpoint.dir=\"\"",
    ]


def run_hpcpipe(overrides: list[str], metrics: str, warmup: int, cwd: str) -> dict:
    """Run hpcpipe.train at 2 ranks; return median step time, peak stash bytes per stage, step-0 loss."""
    if os.path.exists(metrics):
        os.remove(metrics)     # the metrics log appends
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "hpcpipe.train"]
    for item in overrides:
        cmd += ["--set", item]
    proc = subprocess.run(cmd, env=ENV, cwd=cwd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{shlex.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    with open(metrics) as f:
        records = [json.loads(line) for line in f if line.strip()]
    times = sorted(r["step_time_s"] for r in records[warmup:])
    peaks = records[-1].get("peak_stash_bytes_by_stage", {})
    return {"framework": "hpcpipe", "times": times, "median_s": statistics.median(times), "min_s": times[0],
            "loss_step0": records[0]["loss"], "peak_stash_bytes_by_stage": [peaks[k] for k in sorted(peaks, key=int)],
            "command": shlex.join(cmd)}


def free_port() -> int:
    """A TCP port free right now on localhost (for torch's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torch_args(size: dict, schedule: str, split: int, data: str, steps: int, warmup: int, lr: float) -> list[str]:
    """Command-line arguments of one torch_gpt_worker.py job (the same model, batch and cut as hpcpipe's)."""
    return ["--schedule", schedule, "--data", data, "--vocab", str(size["vocab"]), "--seq-len", str(size["seq_len"]),
            "--d-model", str(size["d_model"]), "--n-heads", str(size["n_heads"]),
            "--n-blocks", str(size["n_blocks"]), "--d-ff", str(size["d_ff"]), "--split", str(split),
            "--micro-batches", str(size["micro_batches"]), "--micro-batch-size", str(size["micro_batch_size"]),
            "--lr", str(lr), "--steps", str(steps), "--warmup", str(warmup), "--port", str(free_port())]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; --quick picks a tiny model and one short round."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, 2 timed steps, 1 round (a smoke run)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per job (6; --quick 2)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=None, help="repeat every job, keep its best round (2; --quick 1)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--no-hpcpipe", action="store_true")
    for key in MODEL_KEYS + ("micro_batches", "micro_batch_size"):
        ap.add_argument("--" + key.replace("_", "-"), type=int, default=None, help=f"default {FULL[key]}")
    ap.add_argument("--out", default=None,
                    help="write the results here (default: bench/results/<today>-gpt.json, --quick: -gpt-quick.json)")
    ap.add_argument("--quiet-idle", type=float, default=0.9, help="before each job wait for this idle share")
    ap.add_argument("--quiet-wait", type=float, default=None, help="longest wait for quiet, s (60; --quick 0)")
    ap.add_argument("--report", metavar="JSON", help="only print the tables of an earlier run's results")
    args = ap.parse_args(argv)
    args.steps = args.steps or (2 if args.quick else 6)
    args.rounds = args.rounds or (1 if args.quick else 2)
    args.warmup = 1 if args.quick and args.warmup == 2 else args.warmup
    args.quiet_wait = (0.0 if args.quick else 60.0) if args.quiet_wait is None else args.quiet_wait
    args.out = args.out or dated_out("gpt-quick" if args.quick else "gpt")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run every job, print the tables, write the JSON results."""
    args = parse_args(argv)
    if args.report:
        with open(args.report) as f:
            report(json.load(f))
        return 0
    sys.path.insert(0, os.path.join(ROOT, "src"))
    size = dict(QUICK if args.quick else FULL)
    size.update({k: v for k in size if (v := getattr(args, k)) is not None})
    split = size["n_blocks"] // 2
    rows = size["micro_batches"] * size["micro_batch_size"]
    tmp = tempfile.mkdtemp(prefix="hpcpipe-bench-gpt-")
    data, metrics = os.path.join(tmp, "tokens.h5"), os.path.join(tmp, "metrics.jsonl")
    write_tokens(data, rows, size)
    results: dict = {"command": shlex.join([sys.executable, *sys.argv]), "size": size, "split_blocks": split,
                     "tokens_per_step": rows * size["seq_len"], "rounds": args.rounds, "steps": args.steps,
                     "warmup": args.warmup, "loads": [load()], "runs": {}}
    m = GPTShape(**{k: size[k] for k in MODEL_KEYS}, tied=False)   # the benchmark's head is untied
    results["params"] = gpt_cost.params(m)
    results["flops_per_token"] = gpt_cost.flops_per_token(m)
    results["attention_flops_per_token"] = gpt_cost.attention_flops_per_token(m)
    results["loss_reference"] = reference_loss(data, size, rows)
    wait_quiet(args.quiet_idle, args.quiet_wait)
    rate = matmul_rate(2048, 2048, 2048)
    t, d = size["micro_batch_size"] * size["seq_len"], size["d_model"]
    results["rate_model_gemm_gflops"] = matmul_rate(t, d, 4 * d)
    print(f"load {results['loads'][0]}; one core: 2048^3 matmul {rate:.1f} GFLOP/s, the model's "
          f"{t}x{d}x{4 * d} {results['rate_model_gemm_gflops']:.1f} GFLOP/s", flush=True)
    jobs = [j for j in JOBS if not (args.no_torch and j[0] == "torch") and not (args.no_hpcpipe and j[0] == "hpcpipe")]
    for rnd in range(args.rounds):
        if rnd:
            rate = max(rate, matmul_rate(2048, 2048, 2048))
        for framework, schedule, recompute in jobs:
            key = f"{framework}/{schedule}" + (f"/recompute-{recompute}" if recompute else "")
            idle = wait_quiet(args.quiet_idle, args.quiet_wait)
            if framework == "hpcpipe":
                sets = hpcpipe_overrides(size, schedule, recompute, split, data, metrics,
                                         args.warmup + args.steps, args.lr)
                r = run_hpcpipe(sets, metrics, args.warmup, tmp)
            else:
                r = run_job(2, "torch_gpt_worker.py",
                            torch_args(size, schedule, split, data, args.steps, args.warmup, args.lr))
            r["load"], r["idle_before"] = load(), idle
            best = results["runs"].get(key)
            if best is None or r["median_s"] < best["median_s"]:
                results["runs"][key] = r
            print(f"round {rnd}: {key:28s} {r['median_s'] * 1e3:8.1f} ms/step  (idle before {idle:.0%}, "
                  f"load after {r['load']})", flush=True)
    results["rate2048_gflops"] = max(rate, matmul_rate(2048, 2048, 2048))
    results["loads"].append(load())
    stage_groups = [range(0, 1 + split), range(1 + split, size["n_blocks"] + 2)]
    results["stash_formula"] = {
        rc: gpt_cost.stash_formula(m, size["micro_batch_size"], size["micro_batches"], "1f1b", stage_groups,
                                   rc == "stage") for rc in ("none", "stage")}
    results["stash_formula_gpipe"] = gpt_cost.stash_formula(m, size["micro_batch_size"], size["micro_batches"],
                                                            "gpipe", stage_groups, False)
    report(results)
    write_results(args.out, results)
    print(f"\nwrote {args.out}; command: {results['command']}")
    return 0


def report(res: dict) -> None:
    """Print the throughput table, the stash table and the goals (from a results dict)."""
    runs, tokens = res["runs"], res["tokens_per_step"]
    peak = 2 * res["rate2048_gflops"] * 1e9

    def mfu(r: dict | None) -> str:
        return f"{tokens / r['median_s'] * res['flops_per_token'] / peak:.1%}" if r else "-"

    def tps(r: dict | None) -> str:
        return f"{tokens / r['median_s']:,.0f}" if r else "-"

    s = res["size"]
    print(f"\nmodel: vocab {s['vocab']}, T {s['seq_len']}, d {s['d_model']}, {s['n_heads']} heads, "
          f"{s['n_blocks']} blocks, d_ff {s['d_ff'] or 4 * s['d_model']}, untied; {s['micro_batches']} micro-batches "
          f"x {s['micro_batch_size']} sequences = {tokens} tokens/step; params {res['params']['total']:,} "
          f"({res['params']['flop_counted']:,} FLOP-counted); FLOPs/token {res['flops_per_token']:,} "
          f"(attention {res['attention_flops_per_token']:,} = 12 x n_blocks x T x d, causal counted fully)")
    print(f"one-core 2048^3 matmul {res['rate2048_gflops']:.1f} GFLOP/s (x 2 cores = MFU denominator); "
          f"load before/after {res['loads'][0]} / {res['loads'][-1]}\n")
    print("| schedule | hpcpipe tokens/s | torch tokens/s | hpcpipe / torch | hpcpipe MFU | torch MFU |")
    print("|---|---|---|---|---|---|")
    ratios, mfus = {}, {}
    for sched in ("gpipe", "1f1b"):
        h, t = runs.get(f"hpcpipe/{sched}/recompute-none"), runs.get(f"torch/{sched}")
        ratio = t["median_s"] / h["median_s"] if h and t else None
        ratios[sched] = ratio
        if h:
            mfus[sched] = tokens / h["median_s"] * res["flops_per_token"] / peak
        print(f"| {sched} | {tps(h)} | {tps(t)} | {f'{ratio:.2f}x' if ratio else '-'} | {mfu(h)} | {mfu(t)} |")
    losses = ", ".join(f"{k} {r['loss_step0']:.6f}" for k, r in runs.items() if r.get("loss_step0") is not None)
    print(f"\nstep-0 loss: sequential reference {res['loss_reference']:.6f}; {losses}")
    none, stage = runs.get("hpcpipe/1f1b/recompute-none"), runs.get("hpcpipe/1f1b/recompute-stage")
    if none and stage:
        print("\n| 1f1b stage | stash bytes, no recompute (formula, error) | with recompute (formula, error) | cut |")
        print("|---|---|---|---|")
        errors, cuts = [], []
        pairs = zip(none["peak_stash_bytes_by_stage"], stage["peak_stash_bytes_by_stage"], strict=True)
        for i, (a, b) in enumerate(pairs):
            fa, fb = res["stash_formula"]["none"][i], res["stash_formula"]["stage"][i]
            errors += [abs(a - fa) / fa, abs(b - fb) / fb]
            cuts.append(a / b if b else float("inf"))
            print(f"| {i} | {a:,} ({fa:,}, {(a - fa) / fa:+.1%}) | {b:,} ({fb:,}, {(b - fb) / fb:+.1%}) "
                  f"| {cuts[-1]:.1f}x |")
        gpipe = runs.get("hpcpipe/gpipe/recompute-none")
        if gpipe and "stash_formula_gpipe" in res:
            pairs = zip(gpipe["peak_stash_bytes_by_stage"], res["stash_formula_gpipe"], strict=True)
            print("gpipe stash bytes per stage (formula, error): " + ", ".join(
                f"{a:,} ({f:,}, {(a - f) / f:+.1%})" for a, f in pairs))
        slow = stage["median_s"] / none["median_s"]
        print(f"\nrecompute step time {stage['median_s'] * 1e3:.0f} ms vs {none['median_s'] * 1e3:.0f} ms: "
              f"{slow - 1:+.1%}")
        best = max(mfus.values()) if mfus else 0.0
        goals = [("hpcpipe / torch >= 1.3x (both schedules)", all(r is not None and r >= 1.3 for r in ratios.values())),
                 (f"best MFU >= 60% ({best:.1%})", best >= 0.6),
                 (f"stash within 10% of the formula (worst {max(errors):.1%})", max(errors) <= 0.1),
                 (f"recompute cuts stash >= 4x (least {min(cuts):.1f}x)", min(cuts) >= 4),
                 (f"recompute costs <= 35% step time ({slow - 1:+.1%})", slow <= 1.35)]
        print("\ngoals: " + "; ".join(f"{name}: {'met' if ok else 'NOT met'}" for name, ok in goals))


if __name__ == "__main__":
    sys.exit(main())
