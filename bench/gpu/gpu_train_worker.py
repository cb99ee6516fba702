"""hpcpipe's side of the GPU training benchmark (under mpiexec; pp = the number of ranks, all on one GPU):

    mpiexec -n 2 python bench/gpu/gpu_train_worker.py --size full --phases fp32,tf32 [--backend cupy]

The benchmark GPT (bench/gpu/gpu_common.SIZES, untied head) trained by hpcpipe's Trainer under 1F1B with Adam
on synthetic token windows, in phases of one process: each phase sets the precision (run.tf32 through
runtime.backend.set_tf32; on NumPy it is ignored), runs warm-up steps, then times steps (barrier, step, device
synchronised on every rank, barrier). Rank 0 prints one JSON line: per phase the step times, tokens/s, the
host<->device bytes of a step on each rank and the GPU memory each rank's pool holds.

Initial weights: normal(0, 0.02) drawn in float32 (the model's own init draws float64 first, which for 840 M
parameters costs more than the whole measurement; the values do not change the speed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
from gpu_common import SIZES


def _fast_init(model, indices, seed, dtype):
    """Normal(0, 0.02) matrices, zero biases, unit norms, drawn in float32 per (seed, group)."""
    from hpcpipe.nn.gpt.shape import group_params
    out = {}
    for i in indices:
        rng = np.random.default_rng([seed, i])
        group = {}
        for name, dims in group_params(model.shape, i):
            if name.endswith("bias"):
                group[name] = np.zeros(dims, dtype=dtype)
            elif name.startswith("ln"):
                group[name] = np.ones(dims, dtype=dtype)
            else:
                value = rng.standard_normal(dims, dtype=np.float32)
                value *= 0.02
                group[name] = value.astype(dtype, copy=False)
        out[i] = group
    return out


def config(size: dict, pp: int, backend: str, steps: int) -> dict:
    """The run's config sections: the benchmark GPT at pp ranks, 1F1B, Adam, synthetic windows, no checkpoint."""
    g = size["gpt"]
    return {"parallel": {"pp": pp, "dp": 1, "schedule": "1f1b"},
            "model": {"kind": "gpt", "vocab_size": g["vocab"], "seq_len": g["seq_len"], "d_model": g["d_model"],
                      "n_heads": g["n_heads"], "n_blocks": g["n_blocks"], "d_ff": g["d_ff"],
                      "tie_embeddings": False, "dtype": "float32"},
            "data": {"synthetic_samples": size["micro_batches"] * size["micro_batch_size"]},
            "train": {"steps": steps, "micro_batches": size["micro_batches"],
                      "micro_batch_size": size["micro_batch_size"], "optimizer": "adam", "lr": 1e-4},
            "checkpoint": {"dir": ""}, "log": {"progress": False}, "run": {"backend": backend}}


def main() -> None:
    """Train the benchmark GPT phase by phase and print rank 0's JSON line."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="full", choices=sorted(SIZES))
    ap.add_argument("--phases", default="fp32,tf32")
    ap.add_argument("--backend", default="cupy")
    args = ap.parse_args()
    size = SIZES[args.size]
    phases = args.phases.split(",")

    from mpi4py import MPI

    from hpcpipe.config import from_dict
    from hpcpipe.nn.gpt.model import GPTModel
    from hpcpipe.runtime.backend import set_tf32, tf32_state
    from hpcpipe.train.setup import prepare
    from hpcpipe.train.trainer import Trainer

    world = MPI.COMM_WORLD
    pp = world.Get_size()
    per_phase = size["warmup_steps"] + size["steps"]
    GPTModel.init_arrays = _fast_init
    t0 = time.perf_counter()
    trainer = Trainer(prepare(from_dict(config(size, pp, args.backend, per_phase * len(phases))), pp), world)
    setup_s = time.perf_counter() - t0
    be = trainer.backend
    tokens = size["micro_batches"] * size["micro_batch_size"] * size["gpt"]["seq_len"]
    result = {"pp": pp, "backend": be.name, "setup_s": setup_s, "tokens_per_step": tokens,
              "params": int(world.allreduce(trainer.params.flat.size)), "phases": {}}
    step = 0
    for phase in phases:
        note = set_tf32(be.xp, phase == "tf32")
        times, losses, moved = [], [], []
        for i in range(per_phase):
            world.Barrier()
            t = time.perf_counter()
            losses.append(trainer.train_step(step))
            be.synchronize()
            world.Barrier()
            if i >= size["warmup_steps"]:
                times.append(time.perf_counter() - t)
                moved.append(trainer.last_host_device_bytes)
            step += 1
        pool = int(be.xp.get_default_memory_pool().total_bytes()) if be.on_gpu else 0
        by_rank = world.gather({"host_device_bytes_per_step": moved, "pool_bytes": pool,
                                "tf32": tf32_state(be.xp)}, root=0)
        median = statistics.median(times)
        result["phases"][phase] = {"times_s": times, "median_s": median, "tokens_per_s": tokens / median,
                                   "losses": losses, "ranks": by_rank, "note": note}
    set_tf32(be.xp, False)
    if world.Get_rank() == 0:
        print(json.dumps(result), flush=True)
    trainer.close()


if __name__ == "__main__":
    main()
