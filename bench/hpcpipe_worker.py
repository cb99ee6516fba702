"""One hpcpipe benchmark job (run under mpiexec by bench_schedules.py): prints one JSON line on rank 0.

    mpiexec -n 2 python bench/hpcpipe_worker.py --schedule 1f1b --pp 2 --steps 6 [--trace t.json]
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import numpy as np


def main() -> None:
    """Train a few steps of the benchmark model and report per-step times measured on rank 0."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--virtual-stages", type=int, default=1)
    ap.add_argument("--micro-batches", type=int, default=16)
    ap.add_argument("--global-batch", type=int, default=2048, help="samples per step over all replicas")
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--trace", default="")
    ap.add_argument("--poll-max-us", type=float, default=1000.0)
    args = ap.parse_args()

    from mpi4py import MPI

    from hpcpipe.config import from_dict
    from hpcpipe.train.loop import write_trace
    from hpcpipe.train.setup import prepare
    from hpcpipe.train.trainer import Trainer

    world = MPI.COMM_WORLD
    dp = world.Get_size() // args.pp
    # the same global batch at every layout: replicas split each micro-batch
    micro_batch_size = args.global_batch // (dp * args.micro_batches)
    samples = dp * args.micro_batches * micro_batch_size
    cfg = from_dict({
        "parallel": {"pp": args.pp, "dp": dp, "schedule": args.schedule, "virtual_stages": args.virtual_stages},
        "model": {"dims": [args.dim] * (args.layers + 1), "activation": "relu", "dtype": "float32"},
        "data": {"synthetic_samples": samples},
        "train": {"micro_batches": args.micro_batches, "micro_batch_size": micro_batch_size,
                  "optimizer": "sgd", "lr": 1e-4, "steps": args.warmup + args.steps},
        "log": {"progress": False},
        "run": {"poll_max_us": args.poll_max_us},
    })
    trainer = Trainer(prepare(cfg, world.Get_size()), world, record_events=bool(args.trace))
    times, events, cpu, faults = [], [], 0.0, 0
    for step in range(args.warmup + args.steps):
        world.Barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        trainer.train_step(step)
        dt = time.perf_counter() - t0
        if step >= args.warmup:
            times.append(dt)
            cpu += time.process_time() - c0
            faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
            if args.trace:
                events.append((step, trainer.last_stats.events))
    if args.trace:
        write_trace(args.trace, world, events)
    # CPU seconds per step summed over ranks: waiting ranks that sleep add little to it
    cpu_total = world.reduce(cpu / args.steps, root=0)
    faults_total = world.reduce(faults // args.steps, root=0)   # minor page faults per step, all ranks
    peaks = world.gather(trainer.last_stats.peak_stashed, root=0)
    peak_bytes = world.gather(trainer.last_stats.peak_stash_bytes, root=0)
    if world.Get_rank() == 0:
        n_params = sum(d * d + d for d in [args.dim] * args.layers)
        print(json.dumps({"schedule": args.schedule, "pp": args.pp, "dp": dp, "v": args.virtual_stages,
                          "times": times, "median_s": float(np.median(times)), "min_s": float(np.min(times)),
                          "samples": samples, "params": n_params, "cpu_s_per_step_all_ranks": cpu_total,
                          "page_faults_per_step": faults_total, "peak_stashed": peaks,
                          "peak_stash_bytes": peak_bytes}), flush=True)
    trainer.close()


if __name__ == "__main__":
    main()
