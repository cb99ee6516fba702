"""Training recipes on this machine (issue #38): bytes per rank and step time of ZeRO-1 and LoRA.

    python bench/bench_recipes.py [--steps 4] [--seq-len 128] [--out FILE]

A SmolLM2-135M-shaped llama (d 576, 30 blocks, 9 query / 3 key-value heads of 64, ff 1536, vocabulary 49152,
tied, float32; 134.5 M parameters) trained by ``python -m hpcpipe.train`` at dp = 2 (2 ranks, pp = 1, one BLAS
thread each) with AdamW on synthetic token windows, one window of seq_len tokens per replica and step, in four
jobs:

* ``full``: every parameter trains, train.zero = 0 (every replica holds Adam's two moments of everything);
* ``full-zero1``: the same with train.zero = 1 (each replica holds 1/2 of the moments and updates 1/2);
* ``lora16``: LoRA rank 16 (alpha 32) on all seven linear maps, the base frozen (zero = 0);
* ``lora16-zero1``: the same with train.zero = 1.

From each job's metrics (rank 0's JSON lines): ``parameter_bytes`` (parameters, the trained ones' gradients,
ZeRO's block of the averaged gradient: the largest rank), ``peak_optimizer_bytes`` (the optimizer state the
largest rank holds), ``peak_rss_bytes``, and the median ``step_time_s`` of the steps after the first (the
first allocates). The load average before and after each job is recorded (2 ranks on a 2-core machine: a
busy machine slows every job alike, so compare inside one run). Results go to bench/results/<today>-recipes.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_schedules import ENV, MPIEXEC, dated_out, load, write_results  # noqa: E402

SMOLLM2 = {"kind": "llama", "vocab_size": 49152, "d_model": 576, "n_heads": 9, "n_kv_heads": 3, "n_blocks": 30,
           "d_ff": 1536, "tie_embeddings": True, "rope_theta": 100000.0, "norm_eps": 1e-5}
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
JOBS = {"full": {}, "full-zero1": {"zero": 1}, "lora16": {"lora_rank": 16, "lora_alpha": 32.0, "lora_targets": ALL},
        "lora16-zero1": {"lora_rank": 16, "lora_alpha": 32.0, "lora_targets": ALL, "zero": 1}}


def sets(section: str, values: dict) -> list[str]:
    """--set arguments of one section."""
    return [arg for key, value in values.items() for arg in ("--set", f"{section}.{key}={json.dumps(value)}")]


def job(name: str, train: dict, steps: int, seq_len: int, directory: Path) -> dict:
    """Train one job on 2 ranks; return its bytes, step times and the load around it."""
    metrics = directory / f"{name}.jsonl"
    args = (sets("model", {**SMOLLM2, "seq_len": seq_len})
            + sets("train", {"steps": steps, "micro_batches": 1, "micro_batch_size": 1, "optimizer": "adamw",
                             "lr": 1e-4, **train})
            + sets("parallel", {"dp": 2, "pp": 1}) + sets("data", {"synthetic_samples": 16})
            + sets("checkpoint", {"dir": ""}) + sets("log", {"metrics": str(metrics), "progress": False}))
    before = load()
    t0 = time.perf_counter()
    proc = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-m", "hpcpipe.train", *args], env=ENV,
                          capture_output=True, text=True, cwd=directory)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"{name} failed:\n{proc.stdout}\n{proc.stderr}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    last = records[-1]
    times = [r["step_time_s"] for r in records[1:]]
    out = {"job": name, "train": train, "parameter_bytes": last["parameter_bytes"],
           "peak_optimizer_bytes": last["peak_optimizer_bytes"],
           "optimizer_bytes_by_rank": last["optimizer_bytes_by_rank"],
           "parameter_and_optimizer_bytes": last["parameter_bytes"] + last["peak_optimizer_bytes"],
           "peak_rss_bytes": last["peak_rss_bytes"], "step_time_s": statistics.median(times),
           "step_times_s": [r["step_time_s"] for r in records], "losses": [r["loss"] for r in records],
           "wall_s": wall, "load_before": before, "load_after": load()}
    print(f"{name:13s} params+grads {out['parameter_bytes'] / 2**20:8.1f} MiB  optimizer "
          f"{out['peak_optimizer_bytes'] / 2**20:8.1f} MiB  peak RSS {out['peak_rss_bytes'] / 2**20:7.0f} MiB  "
          f"step {out['step_time_s']:.2f} s  (load {before} -> {out['load_after']})", flush=True)
    return out


def main() -> int:
    """Run the four jobs; write the results file."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--out", default=dated_out("recipes"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        jobs = [job(name, train, args.steps, args.seq_len, Path(tmp)) for name, train in JOBS.items()]
    by = {j["job"]: j for j in jobs}
    ratios = {
        "optimizer_zero1_over_zero0": by["full-zero1"]["peak_optimizer_bytes"] / by["full"]["peak_optimizer_bytes"],
        "param_and_optimizer_lora16_over_full": by["lora16"]["parameter_and_optimizer_bytes"]
        / by["full"]["parameter_and_optimizer_bytes"],
        "step_time_lora16_over_full": by["lora16"]["step_time_s"] / by["full"]["step_time_s"],
        "step_time_zero1_over_zero0": by["full-zero1"]["step_time_s"] / by["full"]["step_time_s"],
    }
    print(json.dumps(ratios, indent=1))
    write_results(args.out, {"model": SMOLLM2, "seq_len": args.seq_len, "steps": args.steps, "dp": 2,
                             "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "jobs": jobs,
                             "ratios": ratios})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
