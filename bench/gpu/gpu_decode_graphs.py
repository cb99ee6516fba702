"""Decode steps of one stage replayed from CUDA graphs against the same steps run eagerly (issue 36).

    python bench/gpu/gpu_decode_graphs.py [--size full|quick] [--backend cupy|numpy]   # prints one JSON line

The serving Llama of the benchmark's size (bench/gpu/gpu_common.py SIZES: d 2048, 16 blocks, GQA 32/8 heads,
SwiGLU 5632, vocabulary 8192 here) as one stage, random weights as bfloat16 kept as stored (row products) and
widened to float32. For 1 and 64 sequences: 32-token prompts prefilled, then decode steps timed, each one's
logits brought to the host as a server's sampling does. The eager stage, then the graph-replaying one
(hpcpipe.nn.core.decode_graphs), each on its own cache; a step that captures a graph (the first of each shape:
at 1 and 64 sequences the KV blocks' bucket grows from 4 to 6 in the second timed round) is left out of its
round's mean. Reports ms per step (median of the rounds), the speedup, the graphs captured and the largest
logit difference between the two, relative to the largest logit. --backend numpy: the CPU rehearsal.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
from gpu_common import SIZES

from hpcpipe.kernels.formats import RowWeight
from hpcpipe.nn.core.decode import DecodeStage, Segment
from hpcpipe.nn.core.decode_graphs import GraphedStage
from hpcpipe.nn.llama.model import LlamaModel
from hpcpipe.nn.llama.shape import LlamaShape

PROMPT, WARM, TIMED, ROUNDS = 32, 8, 16, 3


def random_arrays(model, stored: bool, seed: int = 0) -> dict:
    """Random parameters (scaled so the activations stay finite); ``stored``: matrices as bfloat16 RowWeights."""
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(model.shape.n_groups):
        out[i] = {}
        for name, dims in model.group_params(i):
            v = rng.standard_normal(dims, dtype=np.float32) * (0.02 if len(dims) == 2 else 1.0)
            if len(dims) == 1 and "norm" in name:
                v = np.ones(dims, dtype=np.float32)
            if stored and len(dims) == 2 and name.endswith("/weight"):
                bits = (np.ascontiguousarray(v.T).view(np.uint32) >> 16).astype(np.uint16)
                v = RowWeight("bfloat16", np.ascontiguousarray(bits))
            out[i][name] = v
    return out


def measure(stage, clients: int, vocab: int, xp, rng) -> tuple[list[float], list]:
    """Prefill ``clients`` prompts, then WARM + ROUNDS x TIMED decode steps: (mean ms per step of each timed
    round, steps that captured a graph left out; the logits of every decode step on the host)."""
    stage.forward(rng.integers(0, vocab, clients * PROMPT), [Segment(s, 0, PROMPT) for s in range(clients)])
    logits, rounds, pos = [], [], PROMPT

    def step() -> float | None:
        """One decode step: its seconds, or None when it captured a graph."""
        nonlocal pos
        captured, t0 = getattr(stage, "captured", 0), time.perf_counter()
        out = stage.forward(rng.integers(0, vocab, clients), [Segment(s, pos, 1) for s in range(clients)])
        logits.append(out.get() if hasattr(out, "get") else out)
        pos += 1
        return None if getattr(stage, "captured", 0) != captured else time.perf_counter() - t0

    for _ in range(WARM):
        step()
    for _ in range(ROUNDS):
        times = [t for t in (step() for _ in range(TIMED)) if t is not None]
        rounds.append(sum(times) / len(times) * 1e3)
    return rounds, logits


def main() -> None:
    """Print {"points": [...]} as one JSON line."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="full", choices=sorted(SIZES))
    ap.add_argument("--backend", default="cupy", choices=["cupy", "numpy"])
    args = ap.parse_args()
    if args.backend == "cupy":
        import cupy as xp
    else:
        xp = np
    cfg = SIZES[args.size]["serve_llama"]
    seq_len = PROMPT + WARM + ROUNDS * TIMED + 1
    model = LlamaModel(LlamaShape(8192 if args.size == "full" else 96, seq_len, cfg["d_model"], cfg["n_heads"],
                                  cfg["n_blocks"], d_ff=cfg["d_ff"], n_kv_heads=cfg["n_kv_heads"]))
    groups = range(model.shape.n_groups)
    points = []
    for stored in (True, False):
        arrays = random_arrays(model, stored)
        fmt = {"weight_format": "stored", "compact": True} if stored else {}
        if stored and xp is np:
            from hpcpipe.kernels import cpu
            if cpu.library() is None:
                continue
        for clients in (1, 64):
            runs = {}
            for graphs in (False, True):
                stage = DecodeStage(model, groups, arrays, xp, "float32", clients, compiled=False, kv_block=16,
                                    **fmt)
                stage = GraphedStage(stage) if graphs else stage
                runs[graphs] = measure(stage, clients, model.shape.vocab, xp, np.random.default_rng(clients))
                if graphs:
                    runs["captured"] = stage.captured
                del stage
            eager, graphed = statistics.median(runs[False][0]), statistics.median(runs[True][0])
            diff = max(float(np.abs(g - e).max() / np.abs(e).max())
                       for g, e in zip(runs[True][1], runs[False][1], strict=True))
            points.append({"weights": "bf16 as stored" if stored else "float32", "clients": clients,
                           "eager_ms_per_step": eager, "graphed_ms_per_step": graphed, "speedup": eager / graphed,
                           "eager_rounds_ms": runs[False][0], "graphed_rounds_ms": runs[True][0],
                           "graphs_captured": runs["captured"], "max_rel_logit_diff": diff})
            print(f"{points[-1]['weights']:15s} clients {clients:3d}: eager {eager:7.2f} ms/step, graphed "
                  f"{graphed:7.2f} ({eager / graphed:.2f}x), logits differ by {diff:.2e}", flush=True)
        del arrays
    print(json.dumps({"backend": args.backend, "size": args.size, "points": points}), flush=True)


if __name__ == "__main__":
    main()
