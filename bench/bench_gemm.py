"""The compiled weight product at many rows: matmul.c's row tiles against gemm.c's widened panel, and NumPy's sgemm.

    python bench/bench_gemm.py [--rows 8,16,32,64,512] [--matrices qkv,o,gate_up,down,head] [--formats q8_0]
                               [--cold] [--out FILE]

For each SmolLM2-135M matrix shape (fused q|k|v, o, gate|up, down) and format (float32, bfloat16, q8_0) and rows
of x: seconds per product (best of several) and GFLOP/s (2 M N K / s) on one thread. ``tiles``: hp_matmul with
the panel product off; ``panel``: with it for every row count; ``sgemm``: NumPy's x @ W.T on the float32 values
(OpenBLAS, one thread). Sets where hp_matmul switches (csrc/matmul.c: gemm_rows). ``--cold``: each call takes the
next of enough copies of the matrix to fill 64 MiB, so its weights come from L3 or memory, as in a served model
(whose 145 MiB of weights never stay in a core's L2), not from the L2 the previous call left them in.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from hpcpipe.kernels import cpu  # noqa: E402
from hpcpipe.kernels.formats import RowWeight, quantize_q8_0  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}
DEFAULT_MATRICES = "qkv,o,gate_up,down"
HERE = Path(__file__).resolve().parent


def best(fn, seconds: float = 0.3) -> float:
    """The fastest of repeated calls within about ``seconds``."""
    fn()
    times, start = [], time.perf_counter()
    while time.perf_counter() - start < seconds or len(times) < 3:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def weights(n: int, k: int, rng) -> dict:
    """The same matrix in each format."""
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    bits = (w.view(np.uint32) >> 16).astype(np.uint16)
    return {"float32": RowWeight("float32", w), "bfloat16": RowWeight("bfloat16", bits),
            "q8_0": quantize_q8_0(w)}


def copies(data: np.ndarray, cold: bool) -> int:
    """How many copies of ``data`` fill 64 MiB (cold) or 1."""
    return -(-(64 << 20) // data.nbytes) if cold else 1


def rotating(w, copies: int):
    """A function returning the next of ``copies`` copies of ``w`` (a RowWeight or array) each call."""
    if copies <= 1:
        return lambda: w
    if isinstance(w, np.ndarray):
        pool = [w.copy() for _ in range(copies)]
    else:
        pool = [RowWeight(w.kind, w.data.copy(), None if w.scales is None else w.scales.copy()) for _ in range(copies)]
    state = itertools.cycle(pool)
    return lambda: next(state)


def main(argv: list[str] | None = None) -> int:
    """Measure and print every row; write the JSON results."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="8,16,32,64,512")
    ap.add_argument("--matrices", default=DEFAULT_MATRICES, help=f"of {','.join(SHAPES)}")
    ap.add_argument("--formats", default="float32,bfloat16,q8_0")
    ap.add_argument("--cold", action="store_true", help="weights from L3 / memory (copies rotate)")
    ap.add_argument("--out", default=str(HERE / "results" / f"{time.strftime('%Y-%m-%d')}-gemm.json"))
    args = ap.parse_args(argv)
    matrices, formats_wanted = args.matrices.split(","), args.formats.split(",")
    unknown = sorted(set(matrices) - set(SHAPES)) + sorted(set(formats_wanted) - {"float32", "bfloat16", "q8_0"})
    if unknown:
        ap.error(f"unknown matrices or formats: {', '.join(unknown)}")
    if cpu.library() is None:
        print("the compiled kernels are not built", file=sys.stderr)
        return 1
    rng = np.random.default_rng(0)
    res = {"command": " ".join(["bench/bench_gemm.py"] + (sys.argv[1:] if argv is None else argv)),
           "date": time.strftime("%Y-%m-%d %H:%M"), "load_before": os.getloadavg(), "cold": args.cold, "rows": []}
    print(f"{'matrix':8} {'format':9} {'M':>4} {'tiles GF/s':>10} {'panel GF/s':>10} {'sgemm GF/s':>10}")
    for name in matrices:
        n, k = SHAPES[name]
        every = weights(n, k, rng)
        dense = rotating(every["float32"].data, copies(every["float32"].data, args.cold))
        formats = {f: rotating(w, copies(w.data, args.cold)) for f, w in every.items() if f in formats_wanted}
        for m in (int(r) for r in args.rows.split(",")):
            x = rng.standard_normal((m, k)).astype(np.float32)
            y = np.empty((m, n), dtype=np.float32)
            flop = 2.0 * m * n * k
            sgemm = best(lambda x=x, dense=dense, y=y: np.matmul(x, dense().T, out=y))
            for fmt, w in formats.items():
                cpu.gemm_rows(1 << 40)
                tiles = best(lambda w=w, x=x, y=y: cpu.matmul(w(), x, y))
                cpu.gemm_rows(1)
                panel = best(lambda w=w, x=x, y=y: cpu.matmul(w(), x, y))
                row = {"matrix": name, "format": fmt, "M": m, "N": n, "K": k, "tiles_s": tiles, "panel_s": panel,
                       "sgemm_s": sgemm}
                res["rows"].append(row)
                print(f"{name:8} {fmt:9} {m:4d} {flop / tiles / 1e9:10.1f} {flop / panel / 1e9:10.1f} "
                      f"{flop / sgemm / 1e9:10.1f}", flush=True)
    cpu.gemm_rows(64)
    res["load_after"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
