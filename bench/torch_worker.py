"""PyTorch baseline (run under mpiexec by bench_schedules.py): torch.distributed.pipelining on gloo, CPU.

Needs torch, which is not an hpcpipe dependency:  pip install torch==2.13.0
    mpiexec -n 2 python bench/torch_worker.py --schedule 1f1b --steps 6
Rank and world size come from MPICH's PMI_RANK / PMI_SIZE (or OMPI_COMM_WORLD_*); no torchrun.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def _env_int(*names: str, default: int = 0) -> int:
    for n in names:
        if os.environ.get(n, "").isdigit():
            return int(os.environ[n])
    return default


def main() -> None:
    """Time training steps of the benchmark MLP under PyTorch's pipeline schedules."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved-1f1b"])
    ap.add_argument("--virtual-stages", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=16)
    ap.add_argument("--micro-batch-size", type=int, default=128)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--port", default="29517")
    args = ap.parse_args()

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    torch.set_num_threads(1)
    rank = _env_int("PMI_RANK", "OMPI_COMM_WORLD_RANK", "RANK")
    world = _env_int("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "WORLD_SIZE", default=1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", args.port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)

    v = args.virtual_stages if args.schedule == "interleaved-1f1b" else 1
    n_stages = world * v
    per = args.layers // n_stages

    def chunk() -> nn.Module:
        layers = []
        for _ in range(per):
            layers += [nn.Linear(args.dim, args.dim), nn.ReLU()]
        return nn.Sequential(*layers)

    stage_ids = [c * world + rank for c in range(v)]
    modules = [chunk() for _ in stage_ids]
    stages = [PipelineStage(m, s, n_stages, torch.device("cpu")) for m, s in zip(modules, stage_ids, strict=True)]
    loss_fn = nn.MSELoss()
    n = args.micro_batches
    if args.schedule == "gpipe":
        sched = ScheduleGPipe(stages[0], n, loss_fn=loss_fn)
    elif args.schedule == "1f1b":
        sched = Schedule1F1B(stages[0], n, loss_fn=loss_fn)
    else:
        sched = ScheduleInterleaved1F1B(stages, n, loss_fn=loss_fn)
    params = [p for m in modules for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=1e-4)
    batch = n * args.micro_batch_size
    x = torch.randn(batch, args.dim)
    y = torch.randn(batch, args.dim)
    times = []
    for step in range(args.warmup + args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        if rank == 0:
            sched.step(x)
        elif rank == world - 1:
            sched.step(target=y, losses=[])
        else:
            sched.step()
        opt.step()
        dist.barrier()   # a step ends when the whole pipeline has finished it
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    if rank == 0:
        times.sort()
        print(json.dumps({"schedule": args.schedule, "pp": world, "times": times,
                          "median_s": times[len(times) // 2], "min_s": times[0], "samples": batch}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
