"""A decode stage's weight products as serving does them: many blocks' distinct weights, streamed from memory.

    python bench/bench_stage_products.py [--blocks 16] [--rows 1,8,16,32] [--formats float32,bfloat16,q8_0]
                                         [--out FILE]

Each of ``--blocks`` SmolLM2-135M-shaped blocks (fused q|k|v, o, gate|up, down) has its own weights, so a pass
over them reads 216 MiB of float32 (16 blocks), more than this host's L3 holds for one core: the bytes come from
memory as a served stage's do, which ``bench_gemm.py --cold`` (64 MiB of copies, L3) does not show. One thread;
the best of ``--repeats`` passes; GFLOP/s = 2 M N K summed over the products / seconds. To compare two builds, run
it under each one's PYTHONPATH (``hpcpipe_from`` in the JSON names the one measured) one after the other.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

import hpcpipe  # noqa: E402
from hpcpipe.kernels import cpu  # noqa: E402
from hpcpipe.kernels.formats import RowWeight, quantize_q8_0  # noqa: E402

BLOCK = [(960, 576), (576, 576), (3072, 576), (576, 1536)]     # (N, K) of q|k|v, o, gate|up, down
FORMATS = ("float32", "bfloat16", "q8_0")
HERE = Path(__file__).resolve().parent


def block_weights(fmt: str, rng) -> list:
    """One block's four matrices in ``fmt``."""
    out = []
    for n, k in BLOCK:
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        if fmt == "bfloat16":
            out.append(RowWeight("bfloat16", (w.view(np.uint32) >> 16).astype(np.uint16)))
        elif fmt == "q8_0":
            out.append(quantize_q8_0(w))
        else:
            out.append(RowWeight("float32", w))
    return out


def pass_seconds(blocks: list, m: int, repeats: int, rng) -> float:
    """The best time of one pass of every block's products at ``m`` rows."""
    xs = {k: rng.standard_normal((m, k)).astype(np.float32) for k in {k for _, k in BLOCK}}
    ys = [np.empty((m, n), np.float32) for n, _ in BLOCK]

    def one_pass():
        for weights in blocks:
            for w, (_, k), y in zip(weights, BLOCK, ys, strict=True):
                cpu.matmul(w, xs[k], y)

    one_pass()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        one_pass()
        best = min(best, time.perf_counter() - t)
    return best


def main(argv: list[str] | None = None) -> int:
    """Measure every (format, rows) pair; print them and write the JSON results."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--rows", default="1,8,16,32")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--out", default=str(HERE / "results" / f"{time.strftime('%Y-%m-%d')}-stage-products.json"))
    args = ap.parse_args(argv)
    formats = args.formats.split(",")
    unknown = sorted(set(formats) - set(FORMATS))
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        ap.error(f"--rows {args.rows!r}: expected comma-separated whole numbers")
    if unknown:
        ap.error(f"--formats {args.formats!r}: unknown {', '.join(unknown)} (of {', '.join(FORMATS)})")
    if args.blocks < 1 or args.repeats < 1 or min(rows) < 1:
        ap.error(f"--blocks {args.blocks}, --repeats {args.repeats} and every --rows ({args.rows}) must be at least 1")
    out_dir = Path(args.out).resolve().parent
    if not out_dir.is_dir() or not os.access(out_dir, os.W_OK):
        ap.error(f"--out {args.out!r}: folder {str(out_dir)!r} does not exist or is not writable")
    if cpu.library() is None:
        print("the compiled kernels are not built", file=sys.stderr)
        return 1
    rng = np.random.default_rng(0)
    res = {"command": " ".join(["bench/bench_stage_products.py"] + (sys.argv[1:] if argv is None else argv)),
           "date": time.strftime("%Y-%m-%d %H:%M"), "hpcpipe_from": hpcpipe.__file__,
           "load_before": os.getloadavg(), "blocks": args.blocks, "rows": []}
    print(f"{'format':9} {'M':>4} {'ms':>8} {'GFLOP/s':>8} {'GB/s':>6}")
    for fmt in formats:
        blocks = [block_weights(fmt, rng) for _ in range(args.blocks)]
        nbytes = sum(w.nbytes for b in blocks for w in b)
        for m in rows:
            s = pass_seconds(blocks, m, args.repeats, rng)
            flop = 2.0 * m * args.blocks * sum(n * k for n, k in BLOCK)
            res["rows"].append({"format": fmt, "M": m, "seconds": s, "gflops": flop / s / 1e9,
                                "weight_bytes": nbytes, "gbytes_per_s": nbytes / s / 1e9})
            print(f"{fmt:9} {m:4d} {s * 1e3:8.2f} {flop / s / 1e9:8.1f} {nbytes / s / 1e9:6.1f}", flush=True)
        del blocks
    res["load_after"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
