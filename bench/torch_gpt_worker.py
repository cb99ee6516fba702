"""PyTorch baseline for the GPT benchmark (run under mpiexec by bench_gpt.py): torch.distributed.pipelining, gloo, CPU.

Needs torch, which is not an hpcpipe dependency:  pip install torch==2.13.0
    mpiexec -n 2 python bench/torch_gpt_worker.py --data tokens.h5 --schedule 1f1b --d-model 384 ...
The model is hpcpipe's GPT contract (GPT-2 style, pre-LayerNorm, no dropout, GELU tanh, causal
multi-head attention with one fused qkv Linear, LayerNorm eps 1e-5, untied head) with hpcpipe's own
initial weights (``hpcpipe.nn.gpt.model.GPTModel.init_group``, same seed), cut in two stages at the same
layer group as the hpcpipe run: stage 0 = embedding + the first ``--split`` blocks, stage 1 = the
rest + ln_f + head. Float32, one thread per rank, Adam. Rank and world size come from MPICH's
PMI_RANK / PMI_SIZE (or OMPI_COMM_WORLD_*), as in torch_worker.py; no torchrun.
Prints one JSON line (from the last rank, which holds the losses).
"""

from __future__ import annotations

import argparse
import json
import os
import time

from torch_worker import _env_int


def build_stages(args, rank: int):
    """Return this rank's stage module, initialised from hpcpipe's init_group values."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    from hpcpipe.nn.gpt.model import GPTModel
    from hpcpipe.nn.gpt.shape import GPTShape

    shape = GPTShape(vocab=args.vocab, seq_len=args.seq_len, d_model=args.d_model, n_heads=args.n_heads,
                     n_blocks=args.n_blocks, d_ff=args.d_ff, tied=False)
    d, heads = shape.d_model, shape.n_heads

    def linear(w, b=None) -> nn.Linear:
        # hpcpipe stores (in, out) and computes x @ W + b; nn.Linear holds W.T
        layer = nn.Linear(w.shape[0], w.shape[1], bias=b is not None)
        with torch.no_grad():
            layer.weight.copy_(torch.from_numpy(w.T.copy()))
            if b is not None:
                layer.bias.copy_(torch.from_numpy(b))
        return layer

    def norm(p: dict, prefix: str) -> nn.LayerNorm:
        layer = nn.LayerNorm(d, eps=1e-5)
        with torch.no_grad():
            layer.weight.copy_(torch.from_numpy(p[f"{prefix}/weight"]))
            layer.bias.copy_(torch.from_numpy(p[f"{prefix}/bias"]))
        return layer

    class Block(nn.Module):
        def __init__(self, p: dict):
            super().__init__()
            self.ln1, self.ln2 = norm(p, "ln1"), norm(p, "ln2")
            self.qkv = linear(p["attn/qkv/weight"], p["attn/qkv/bias"])
            self.proj = linear(p["attn/proj/weight"], p["attn/proj/bias"])
            self.fc = linear(p["mlp/fc/weight"], p["mlp/fc/bias"])
            self.mp = linear(p["mlp/proj/weight"], p["mlp/proj/bias"])

        def attention(self, u):
            b, t, _ = u.shape
            q, k, v = self.qkv(u).view(b, t, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            if args.attention == "sdpa":
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                scores = (q @ k.transpose(-1, -2)) * (d // heads) ** -0.5
                mask = torch.ones(t, t, dtype=torch.bool).triu(1)
                out = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
            return self.proj(out.transpose(1, 2).reshape(b, t, d))

        def forward(self, h):
            a = h + self.attention(self.ln1(h))
            return a + self.mp(F.gelu(self.fc(self.ln2(a)), approximate="tanh"))

    class First(nn.Module):
        def __init__(self, p: dict, blocks: list):
            super().__init__()
            self.tok_emb = nn.Parameter(torch.from_numpy(p["tok_emb"]))
            self.pos_emb = nn.Parameter(torch.from_numpy(p["pos_emb"]))
            self.blocks = nn.ModuleList(blocks)

        def forward(self, tokens):
            h = self.tok_emb[tokens] + self.pos_emb[:tokens.shape[1]]
            for block in self.blocks:
                h = block(h)
            return h

    class Last(nn.Module):
        def __init__(self, p: dict, blocks: list):
            super().__init__()
            self.blocks = nn.ModuleList(blocks)
            self.ln_f = norm(p, "ln_f")
            self.head = linear(p["head/weight"])

        def forward(self, h):
            for block in self.blocks:
                h = block(h)
            return self.head(self.ln_f(h))

    def group(i: int) -> dict:
        return GPTModel(shape).init_group(i, args.seed, "float32")

    if rank == 0:
        return First(group(0), [Block(group(i)) for i in range(1, args.split + 1)])
    return Last(group(shape.n_blocks + 1), [Block(group(i)) for i in range(args.split + 1, shape.n_blocks + 1)])


def main() -> None:
    """Time training steps of the benchmark GPT under PyTorch's GPipe or 1F1B schedule at pp=2."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b"])
    ap.add_argument("--data", required=True, help="HDF5 token file: x, y (N, seq_len); one step's rows are read")
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--d-model", type=int, default=384)
    ap.add_argument("--n-heads", type=int, default=6)
    ap.add_argument("--n-blocks", type=int, default=4)
    ap.add_argument("--d-ff", type=int, default=0)
    ap.add_argument("--split", type=int, default=0, help="blocks on stage 0 (0 = half)")
    ap.add_argument("--attention", default="sdpa", choices=["sdpa", "manual"],
                    help="torch's fused scaled_dot_product_attention (default) or matmul + mask + softmax")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--port", default="29527")
    args = ap.parse_args()
    args.split = args.split or args.n_blocks // 2

    import h5py
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    from torch.nn import functional as F

    torch.set_num_threads(1)
    rank = _env_int("PMI_RANK", "OMPI_COMM_WORLD_RANK", "RANK")
    world = _env_int("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "WORLD_SIZE", default=1)
    if world != 2:
        raise SystemExit(f"torch_gpt_worker: runs at pp=2 (2 ranks), got {world}")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", args.port)
    dist.init_process_group("gloo", rank=rank, world_size=world)

    module = build_stages(args, rank)
    stage = PipelineStage(module, rank, world, torch.device("cpu"))

    def loss_fn(logits, target):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[args.schedule]
    sched = schedule(stage, args.micro_batches, loss_fn=loss_fn)   # scale_grads: mean over micro-batches
    opt = torch.optim.Adam(module.parameters(), lr=args.lr)
    rows = args.micro_batches * args.micro_batch_size
    with h5py.File(args.data, "r") as f:
        x = torch.from_numpy(f["x"][:rows].astype("int64"))
        y = torch.from_numpy(f["y"][:rows].astype("int64"))
    times, first_loss = [], None
    for step in range(args.warmup + args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        losses: list = []
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=losses, return_outputs=False)
        opt.step()
        dist.barrier()   # a step ends when the whole pipeline has finished it
        if step == 0 and losses:
            first_loss = float(torch.stack(losses).detach().mean())
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    if rank == world - 1:
        times.sort()
        print(json.dumps({"framework": "torch", "schedule": args.schedule, "pp": world, "times": times,
                          "median_s": times[len(times) // 2], "min_s": times[0],
                          "tokens": rows * args.seq_len, "loss_step0": first_loss,
                          "attention": args.attention, "torch": torch.__version__}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
