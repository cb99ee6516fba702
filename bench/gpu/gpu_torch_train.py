"""PyTorch's side of the GPU training benchmark: one process, one GPU, a plain training step.

    python bench/gpu/gpu_torch_train.py --size full --phases fp32,tf32,bf16 [--device cuda]

The same GPT as hpcpipe's (GPT-2 style contract: pre-LayerNorm, fused qkv, GELU tanh, causal attention
computed as hpcpipe does, matmul + mask + softmax, untied head, LayerNorm eps 1e-5), the same batch
(micro_batches x micro_batch_size windows of seq_len random tokens), the same step: the gradients of each
micro-batch accumulated (loss / micro_batches), then one Adam update. Phases: fp32 (float32 products at full
precision), tf32 (torch.set_float32_matmul_precision("high")), bf16 (autocast to bfloat16, float32 weights: a
reference for what bf16 compute would give, which hpcpipe does not have). Warm-up steps, then timed steps
(synchronised). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from gpu_common import SIZES


def build(g: dict, device: str):
    """The benchmark GPT as a torch module on device (float32 weights, normal(0, 0.02) matrices)."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    d, heads, t = g["d_model"], g["n_heads"], g["seq_len"]
    ff = g["d_ff"] or 4 * d

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d, eps=1e-5), nn.LayerNorm(d, eps=1e-5)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc, self.mp = nn.Linear(d, ff), nn.Linear(ff, d)
            self.register_buffer("future", torch.ones(t, t, dtype=torch.bool).triu(1), persistent=False)

        def forward(self, h):
            b, n, _ = h.shape
            q, k, v = self.qkv(self.ln1(h)).view(b, n, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            scores = (q @ k.transpose(-1, -2)) * (d // heads) ** -0.5
            att = scores.masked_fill(self.future[:n, :n], float("-inf")).softmax(-1) @ v
            a = h + self.proj(att.transpose(1, 2).reshape(b, n, d))
            return a + self.mp(F.gelu(self.fc(self.ln2(a)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_emb = nn.Embedding(g["vocab"], d)
            self.pos_emb = nn.Embedding(t, d)
            self.blocks = nn.ModuleList(Block() for _ in range(g["n_blocks"]))
            self.ln_f = nn.LayerNorm(d, eps=1e-5)
            self.head = nn.Linear(d, g["vocab"], bias=False)

        def forward(self, tokens):
            h = self.tok_emb(tokens) + self.pos_emb.weight[:tokens.shape[1]]
            for block in self.blocks:
                h = block(h)
            return self.head(self.ln_f(h))

    model = GPT().to(device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
            elif name.endswith("bias"):
                p.zero_()
    return model


def main() -> None:
    """Time training steps of the benchmark GPT in each precision phase; print one JSON line."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="full", choices=sorted(SIZES))
    ap.add_argument("--phases", default="fp32,tf32,bf16")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    size = SIZES[args.size]
    g = size["gpt"]

    import torch
    from torch.nn import functional as F

    if args.device == "cpu":
        torch.set_num_threads(1)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = build(g, args.device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    m, b = size["micro_batches"], size["micro_batch_size"]
    x = torch.randint(0, g["vocab"], (m, b, g["seq_len"]), device=args.device)
    y = torch.randint(0, g["vocab"], (m, b, g["seq_len"]), device=args.device)
    sync()
    result = {"framework": "torch", "torch": torch.__version__, "device": args.device,
              "setup_s": time.perf_counter() - t0, "params": sum(p.numel() for p in model.parameters()),
              "tokens_per_step": m * b * g["seq_len"], "phases": {}}

    def step(autocast: bool) -> float:
        opt.zero_grad(set_to_none=False)
        total = 0.0
        for i in range(m):
            with torch.autocast(args.device, dtype=torch.bfloat16, enabled=autocast):
                logits = model(x[i])
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y[i].reshape(-1)) / m
            loss.backward()
            total += float(loss.detach())
        opt.step()
        return total

    before = torch.get_float32_matmul_precision()
    try:
        for phase in args.phases.split(","):
            torch.set_float32_matmul_precision("high" if phase == "tf32" else "highest")
            times, losses = [], []
            for i in range(size["warmup_steps"] + size["steps"]):
                sync()
                t = time.perf_counter()
                losses.append(step(phase == "bf16"))
                sync()
                if i >= size["warmup_steps"]:
                    times.append(time.perf_counter() - t)
            median = statistics.median(times)
            result["phases"][phase] = {"times_s": times, "median_s": median,
                                       "tokens_per_s": result["tokens_per_step"] / median, "losses": losses}
            if args.device == "cuda":
                result["phases"][phase]["max_memory_bytes"] = int(torch.cuda.max_memory_allocated())
    finally:
        torch.set_float32_matmul_precision(before)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
