"""The most decode tokens/s a serving layout can reach on this machine: its ranks' decode steps alone, side by side.

    python bench/bench_serve_ceiling.py                  # the serving benchmark's model, 32 sequences, 10 s a layout
    python bench/bench_serve_ceiling.py --gemm-only      # only the blocks' and head's matrix products (the BLAS bound)
    python bench/bench_serve_ceiling.py --quick          # a tiny model, 2 s a layout (the smoke test runs this)

Each rank of a layout is one process (one BLAS thread) that holds the stage the
server would give it (``hpcpipe.nn.partition.partition``, the serve plan's cut) as
a real ``DecodeStage`` with a KV cache, filled for its replica's sequences at
the positions a steady stream of requests occupies (prompt + 0 .. max_tokens - 1,
spread evenly). A round is what one token of every sequence costs that rank:
one decode forward per micro-batch group of its replica (32 / dp sequences cut
into ``groups`` = pp groups, the issue's rule; ``-mb1`` layouts keep one group),
plus its share of the new requests' prefill: a request decodes max_tokens
tokens, so a steady stream prefills sequences / max_tokens prompts a round
(each a forward of prompt_chars rows; ``--no-prefill`` leaves them out).
All ranks of all replicas start together and each runs the same number of
rounds (sized by a pilot to last about --seconds), with no messages, no HTTP
and no waiting for each other. The bound is sequences x rounds / the time a
perfect scheduler needs for the CPU time the ranks used: max(sum of CPU / cores,
the largest rank's CPU). No stage is slower than alone and no core idles while
work is left, so the served tokens/s cannot exceed it. "side by side" is the
rate the ranks reached on the wall clock (each replica's slowest rank).
``--gemm-only`` replaces each forward with the products of
its weights over the same rows (no attention, norms, GELU or Python per
block): the bound of any NumPy + OpenBLAS engine with these weights.
Prints the table and the ratios the serving goals name (pp=2 / pp=1 >= 1.8,
8 ranks / pp=2 >= 0.8). Analysis: docs/bench-serve.md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time

os.environ.update({k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                                     "BLIS_NUM_THREADS", "HPCPIPE_THREADS")})

import numpy as np  # noqa: E402  (after the thread caps)
from bench_serve import CHARS, FULL, LONG, QUICK  # noqa: E402

# name: (dp, pp, micro-batch groups per replica)
LAYOUTS = {"pp1": (1, 1, 1), "pp2": (1, 2, 2), "dp2xpp4": (2, 4, 4), "pp8": (1, 8, 8), "dp2xpp4-mb1": (2, 4, 1)}


def stage_ranges(size: dict, pp: int) -> list[range]:
    """The layer groups of each of pp stages, cut as the serve plan cuts them (FLOP-balanced)."""
    from hpcpipe.config import from_dict
    from hpcpipe.nn.partition import partition
    from hpcpipe.nn.registry import model_specs
    cfg = from_dict({"model": {"kind": "gpt", "vocab_size": len(CHARS), "seq_len": size["seq_len"],
                               "d_model": size["d_model"], "n_heads": size["n_heads"], "n_blocks": size["n_blocks"]}})
    return partition(model_specs(cfg), pp)


def positions(size: dict, n: int) -> np.ndarray:
    """Cached tokens of n sequences in a steady stream: spread evenly over prompt .. prompt + max_tokens - 1."""
    return size["prompt_chars"] + (np.arange(n) * size["max_tokens"]) // n


class Rank:
    """One rank's stage and the decode steps of its replica's groups."""

    def __init__(self, size: dict, groups: range, n_seq: int, n_groups: int, gemm_only: bool, prefill: bool = True):
        from hpcpipe.nn.core.decode import DecodeStage, Segment
        from hpcpipe.nn.core.decoder_model import Decoder
        from hpcpipe.nn.gpt.model import GPTModel
        from hpcpipe.nn.gpt.shape import GPTShape
        shape = GPTShape(vocab=len(CHARS), seq_len=size["seq_len"], d_model=size["d_model"],
                         n_heads=size["n_heads"], n_blocks=size["n_blocks"], tied=True)
        model = Decoder(GPTModel(shape), np, "float32", seed=0)
        arrays = {i: {k: np.array(v) for k, v in model.params[i].items()} for i in (*groups, 0)}
        table = arrays[0]["tok_emb"] if 0 not in groups else None
        # one slot more than the sequences: the new requests' prompts are prefilled there
        self.stage = DecodeStage(GPTModel(shape), groups, arrays, np, "float32", n_seq + 1, tok_emb=table)
        pos = positions(size, n_seq)
        rng = np.random.default_rng(0)
        first = 0 in groups
        for slot, p in enumerate(pos):   # fill each slot's cache up to its position (a prefill)
            x = rng.integers(0, shape.vocab, p) if first else rng.standard_normal((p, shape.d_model), np.float32)
            self.stage.forward(x, [Segment(slot, 0, int(p))])
        self.steps = []
        for part in np.array_split(np.arange(n_seq), n_groups):
            segs = [Segment(int(s), int(pos[s]), 1) for s in part]
            x = rng.integers(0, shape.vocab, part.size) if first else \
                rng.standard_normal((part.size, shape.d_model), np.float32)
            self.steps.append((x, segs))
        n = size["prompt_chars"]
        x = rng.integers(0, shape.vocab, n) if first else rng.standard_normal((n, shape.d_model), np.float32)
        self.prompt = (x, [Segment(n_seq, 0, n)])
        # a request decodes max_tokens tokens, so a steady stream admits n_seq / max_tokens prompts a round
        self.prompts_per_round = n_seq / size["max_tokens"] if prefill else 0.0
        self._owed = 0.0
        self.gemm_only = gemm_only
        self.weights = [w for i in groups for name, w in arrays[i].items()
                        if name.endswith("/weight") and w.ndim == 2]
        if shape.n_groups - 1 in groups:
            self.weights.append(arrays[0]["tok_emb"].T)   # the tied head's product
        self._inputs = {(sum(s.length for s in segs), w.shape[0]):
                        np.ones((sum(s.length for s in segs), w.shape[0]), np.float32)
                        for _, segs in (*self.steps, self.prompt) for w in self.weights}

    def round(self) -> None:
        """One token of every sequence of the replica through this rank, and its share of new prompts."""
        for x, segs in self.steps:
            self._forward(x, segs)
        self._owed += self.prompts_per_round
        while self._owed >= 1.0:
            self._forward(*self.prompt)
            self._owed -= 1.0

    def _forward(self, x: np.ndarray, segs: list) -> None:
        """The stage's forward over these segments, or only its weights' products over as many rows."""
        if self.gemm_only:
            rows = sum(s.length for s in segs)
            for w in self.weights:
                self._inputs[rows, w.shape[0]] @ w
        else:
            self.stage.forward(x, segs)


def worker(args: tuple) -> tuple[int, float, float]:
    """Build one rank; after a pilot that sizes the run, do the agreed rounds; return (rounds, wall s, CPU s).

    Every rank does the same number of rounds, so a rank that finishes early frees its core for the
    others, as a pipeline's waiting stage does (a fixed window would let fast ranks take the slow
    ones' CPU and understate the bound).
    """
    size, groups, n_seq, n_groups, gemm_only, prefill, seconds, barrier, pilots = args
    rank = Rank(size, groups, n_seq, n_groups, gemm_only, prefill)
    rank.round()   # warm
    barrier.wait()
    start, rounds = time.perf_counter(), 0
    while time.perf_counter() - start < seconds / 4:
        rank.round()
        rounds += 1
    pilots.append(rounds / (time.perf_counter() - start))
    barrier.wait()
    rounds = max(2, int(min(pilots) * seconds))
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(rounds):
        rank.round()
    return rounds, time.perf_counter() - start, time.process_time() - cpu


def measure(size: dict, name: str, sequences: int, seconds: float, gemm_only: bool, prefill: bool = True) -> dict:
    """Run every rank of one layout side by side; return its tokens/s bound and the per-rank rounds."""
    dp, pp, n_groups = LAYOUTS[name]
    n_seq = sequences // dp
    ranges = stage_ranges(size, pp)
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager, ctx.Pool(dp * pp) as pool:
        barrier, pilots = manager.Barrier(dp * pp), manager.list()
        jobs = [(size, ranges[s], n_seq, n_groups, gemm_only, prefill, seconds, barrier, pilots)
                for _ in range(dp) for s in range(pp)]
        out = pool.map(worker, jobs)
    per_replica = [out[r * pp:(r + 1) * pp] for r in range(dp)]
    side_by_side = sum(n_seq * ranks[0][0] / max(wall for _, wall, _ in ranks) for ranks in per_replica)
    # perfect scheduling of the same CPU work: no core idle while work is left, no rank faster than alone
    cpu = [c for _, _, c in out]
    tokens = sequences * out[0][0] / max(sum(cpu) / min(os.cpu_count() or 1, len(cpu)), max(cpu))
    return {"layout": name, "dp": dp, "pp": pp, "groups": n_groups, "rows_per_step": n_seq // n_groups,
            "tokens_per_s": tokens, "side_by_side_tokens_per_s": side_by_side, "rounds": out[0][0],
            "wall_s": [round(w, 2) for _, w, _ in out],
            "cpu_s": cpu, "cores": os.cpu_count() or 1, "cpu_share": [round(c / w, 3) for _, w, c in out]}


def main() -> None:
    """Measure each layout's bound and print the table and the goal ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=32, help="sequences in flight (the concurrent clients)")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--gemm-only", action="store_true", help="only the weights' matrix products")
    parser.add_argument("--no-prefill", action="store_true", help="decode steps only (no share of new prompts)")
    parser.add_argument("--long", action="store_true", help="the serving benchmark's long-context workload")
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 s a layout")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    parser.add_argument("--out", default="", help="write the results as JSON here")
    args = parser.parse_args()
    size = QUICK if args.quick else LONG if args.long else FULL
    seconds = 2.0 if args.quick else args.seconds
    names = [n for n in args.layouts.split(",") if n]
    if args.quick:   # the tiny model has 4 layer groups: no pp=8
        names = [n for n in names if n not in LAYOUTS or LAYOUTS[n][1] <= size["n_blocks"] + 2]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        sys.exit(f"bench_serve_ceiling: unknown layouts {unknown} (known: {', '.join(LAYOUTS)})")
    if args.sequences < 1 or seconds <= 0:
        sys.exit(f"bench_serve_ceiling: --sequences must be >= 1 and --seconds > 0, got {args.sequences} and "
                 f"{seconds:g}")
    print(f"model {size}, {args.sequences} sequences, {seconds:g} s a layout, "
          f"{'GEMMs only' if args.gemm_only else 'DecodeStage.forward'}, "
          f"{'decode only' if args.no_prefill else 'with the prompts prefill'}, load {os.getloadavg()[0]:.2f}",
          flush=True)
    results = []
    print("| layout | ranks | rows a step | tokens/s bound | side by side | rounds | wall s per rank | "
          "CPU / wall per rank |")
    print("|---|---|---|---|---|---|---|---|")
    for name in names:
        r = measure(size, name, args.sequences, seconds, args.gemm_only, not args.no_prefill)
        results.append(r)
        print(f"| {name} | {r['dp'] * r['pp']} | {r['rows_per_step']} | {r['tokens_per_s']:.1f} | "
              f"{r['side_by_side_tokens_per_s']:.1f} | {r['rounds']} | {r['wall_s']} | {r['cpu_share']} |", flush=True)
    by = {r["layout"]: r["tokens_per_s"] for r in results}
    for a, b, goal in (("pp2", "pp1", ">= 1.8"), ("dp2xpp4", "pp2", ">= 0.8"), ("pp8", "pp2", ">= 0.8"),
                       ("dp2xpp4-mb1", "pp2", ">= 0.8 (one group per replica)")):
        if a in by and b in by:
            print(f"{a} / {b}: {by[a] / by[b]:.2f}x (goal {goal})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": size, "sequences": args.sequences, "seconds": seconds, "gemm_only": args.gemm_only,
                       "prefill": not args.no_prefill,
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
