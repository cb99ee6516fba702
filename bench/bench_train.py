"""Training throughput benchmark: step time, samples/s and model FLOP utilisation (MFU).

    python bench/bench_train.py                       # dims [1024]*9, 16 x 128, pp=2 dp=1, gpipe
    python bench/bench_train.py --ranks 8 --set parallel.pp=4 --set parallel.dp=2

MFU = 6 x parameters x samples / step time, divided by (ranks' cores) x the
rate of a 2048x2048x2048 float32 matmul on one core, measured by this script
in the same run with one BLAS thread. Every rank runs with one BLAS thread.
Step time is the median over the measured steps (the first --warmup steps
are dropped).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.update({k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")})

import numpy as np  # noqa: E402  (after the thread caps)

DEFAULTS = ["model.dims=[1024, 1024, 1024, 1024, 1024, 1024, 1024, 1024, 1024]", "train.micro_batches=16",
            "train.micro_batch_size=128", "parallel.pp=2", "parallel.dp=1", "train.lr=1e-4",
            "log.progress=false", "data.synthetic_samples=2048"]


def matmul_rate(n: int = 2048, repeats: int = 5) -> float:
    """Return the best FLOP/s of an n x n x n float32 matmul on one thread."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((n, n), dtype=np.float32), rng.standard_normal((n, n), dtype=np.float32)
    out = np.empty((n, n), dtype=np.float32)
    np.matmul(a, b, out=out)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.matmul(a, b, out=out)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n ** 3 / best


def run_training(ranks: int, overrides: list[str], steps: int) -> list[dict]:
    """Run the real training command under mpiexec and return its metrics records."""
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    mpiexec = mpiexec if os.path.exists(mpiexec) else shutil.which("mpiexec")
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "metrics.jsonl")
        args = [mpiexec, "-n", str(ranks), sys.executable, "-m", "hpcpipe.train"]
        for item in [*DEFAULTS, f"train.steps={steps}", f"log.metrics=\"{metrics}\"", *overrides]:
            args += ["--set", item]
        subprocess.run(args, check=True, cwd=tmp, env=dict(os.environ, HPCPIPE_THREADS="1"))
        with open(metrics) as f:
            return [json.loads(line) for line in f]


def parameter_count(overrides: list[str]) -> tuple[int, int]:
    """Return (parameters, samples per step) of the benchmarked configuration."""
    from hpcpipe.config import load_config
    config = load_config(None, [*DEFAULTS, *overrides])
    dims = config.model.dims
    params = sum(dims[i] * dims[i + 1] + (dims[i + 1] if config.model.bias else 0) for i in range(len(dims) - 1))
    dp = config.parallel.dp if isinstance(config.parallel.dp, int) else 1
    return params, dp * config.train.micro_batches * config.train.micro_batch_size


def main() -> None:
    """Measure and print one table row per configuration."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--cores", type=int, default=os.cpu_count(), help="cores the ranks share (MFU denominator)")
    args = parser.parse_args()
    rate = matmul_rate()
    records = run_training(args.ranks, args.overrides, args.steps)
    step = statistics.median(r["step_time_s"] for r in records[args.warmup:])
    params, samples = parameter_count(args.overrides)
    flops = 6.0 * params * samples
    cores = min(args.ranks, args.cores)
    print(f"matmul 2048^3 float32, 1 thread: {rate / 1e9:.1f} GFLOP/s; {cores} cores")
    print("| ranks | config | step time (ms) | samples/s | model FLOP/s (G) | MFU |")
    print("|---|---|---|---|---|---|")
    label = " ".join(args.overrides) or "pp=2 dp=1 gpipe"
    print(f"| {args.ranks} | {label} | {step * 1e3:.1f} | {samples / step:.0f} | {flops / step / 1e9:.1f} | "
          f"{flops / step / (cores * rate):.1%} |")


if __name__ == "__main__":
    main()
