"""What NumPy's matrix products alone cost per decode step of a SmolLM2-135M-shaped llama, one BLAS thread.

    python bench/bench_decode_floor.py [--out FILE]

The weights of a decode step (30 blocks of q, k, v, o, gate, up, down and the tied head: 513 MiB in
float32) are multiplied by 1, 16 and 32 rows, each block's matrices distinct so that every step streams them
from memory as serving does. Nothing else runs: no attention, norms or Python around it, so the time is a
floor for hpcpipe's NumPy stages at that batch (bench_real_models.py measures the served rates). Variants:
q/k/v and gate/up fused into one product each (fewer, wider calls), and the head as stored for batch 1
((d, vocab): x @ W) against the embedding table's own layout ((vocab, d): W @ x.T). Also one core's copy
bandwidth, the bound on reading the weights once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")    # one BLAS thread, as each serving rank has
os.environ.setdefault("OMP_NUM_THREADS", "1")
import numpy as np  # noqa: E402 - after the thread count is set

HERE = Path(__file__).resolve().parent
D, KV, FF, VOCAB, BLOCKS = 576, 192, 1536, 49152, 30
SHAPES = [(D, D), (D, KV), (D, KV), (D, D), (D, FF), (D, FF), (FF, D)]      # q k v o gate up down, (in, out)


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _blocks(rng) -> tuple[list[list[np.ndarray]], list[list[np.ndarray]]]:
    separate = [[rng.standard_normal(s, dtype=np.float32) for s in SHAPES] for _ in range(BLOCKS)]
    fused = [[np.concatenate(b[:3], axis=1), b[3], np.concatenate(b[4:6], axis=1), b[6]] for b in separate]
    return separate, fused


def measure(repeats: int = 7) -> dict:
    """Seconds of the blocks' and the head's products per step at 1, 16 and 32 rows, and the copy rate."""
    rng = np.random.default_rng(0)
    separate, fused = _blocks(rng)
    table = rng.standard_normal((VOCAB, D), dtype=np.float32)        # (vocab, d): the embedding's layout
    columns = np.ascontiguousarray(table.T)                           # (d, vocab): the head's at batch 1
    weights = sum(w.nbytes for b in separate for w in b) + table.nbytes
    out = {"weights_bytes": weights, "rows": {}}
    for rows in (1, 16, 32):
        x = rng.standard_normal((rows, D), dtype=np.float32)
        h = rng.standard_normal((rows, FF), dtype=np.float32)

        def blocks(chosen, x=x, h=h):
            for block in chosen:
                for w in block:
                    (h if w.shape[0] == FF else x) @ w

        flops = 2 * rows * sum(w.size for b in separate for w in b)
        got = {"blocks_s": _best(lambda: blocks(separate), repeats),
               "blocks_fused_s": _best(lambda: blocks(fused), repeats),
               "head_columns_s": _best(lambda x=x: x @ columns, repeats),
               "head_table_s": _best(lambda x=x: table @ x.T, repeats)}
        got["blocks_gflops"] = flops / got["blocks_s"] / 1e9
        got["step_s"] = got["blocks_s"] + min(got["head_columns_s"], got["head_table_s"])
        got["tokens_per_s"] = rows / got["step_s"]
        out["rows"][str(rows)] = got
    a = np.ones(64 << 20, dtype=np.float32)
    b = np.empty_like(a)
    out["copy_bytes_per_s"] = 2 * a.nbytes / _best(lambda: np.copyto(b, a), 5)
    out["read_floor_s"] = weights / out["copy_bytes_per_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    """Measure, print a table, write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(HERE / "results" / f"{time.strftime('%Y-%m-%d')}-decode-floor.json"))
    args = ap.parse_args(argv)
    res = measure()
    print(f"weights per step {res['weights_bytes'] / 2**20:.0f} MiB; one core copies "
          f"{res['copy_bytes_per_s'] / 1e9:.1f} GB/s -> reading them once takes {res['read_floor_s'] * 1e3:.1f} ms")
    print(f"{'rows':>4} {'blocks ms':>10} {'fused ms':>9} {'GFLOP/s':>8} {'head x@W ms':>12} {'head W@x.T ms':>14} "
          f"{'tokens/s':>9}")
    for rows, r in res["rows"].items():
        print(f"{rows:>4} {r['blocks_s'] * 1e3:10.1f} {r['blocks_fused_s'] * 1e3:9.1f} {r['blocks_gflops']:8.0f} "
              f"{r['head_columns_s'] * 1e3:12.1f} {r['head_table_s'] * 1e3:14.1f} {r['tokens_per_s']:9.1f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
