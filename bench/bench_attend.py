"""The compiled attention step alone (csrc/attend.c, ``hp_attend``): a 512-token prompt's attention in one block,
as one call, in chunks, and as 512 decode rows, through this checkout's kernels and, alternating in the same
process, another build's (``--other-lib``: e.g. the kernels before a change), so both see the same machine.

    python bench/bench_attend.py [--other-lib PATH/_cpu....so] [--repeats 5] [--out FILE]

Shapes: SmolLM2-135M's attention (9 heads over 3 kv heads of 64) and AMD-Llama-135m's (12 over 12 of 64), a
paged cache of 16-position blocks; the KV cache holds random values, the rows' keys and values are written
by the call as in a prefill. Reported: the best of --repeats, ms for one block (a model's prefill runs it once
per block: x30 for SmolLM2-135M, x12 for AMD-Llama-135m).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SHAPES = {"smollm2-135m": (9, 3, 64), "amd-llama-135m": (12, 12, 64)}
TOKENS, PAGE, SEQ_LEN = 512, 16, 1024


def time_attend(lib, shape: tuple[int, int, int], chunk: int, repeats: int, rng) -> float:
    """Best-of-``repeats`` seconds of a 512-row prompt's attention in calls of ``chunk`` rows (1: decode rows)."""
    from hpcpipe.kernels.cpu import Stage
    heads, kv, hd = shape
    pages = SEQ_LEN // PAGE
    cache = rng.standard_normal((2, kv, pages, PAGE, hd)).astype(np.float32)
    tables = rng.permutation(pages).astype(np.int64).reshape(1, -1)
    qkv = rng.standard_normal((TOKENS, (heads + 2 * kv) * hd)).astype(np.float32)
    out = np.empty((TOKENS, heads * hd), np.float32)
    stage = Stage(0, 0, heads, kv, hd, 0, 1, SEQ_LEN, 0, 0, 0, 0, 0.0, 0.0, 1.0 / np.sqrt(hd), 0.0, None, None, None,
                  PAGE, pages, pages, tables.ctypes.data)
    pointers = 2 * SEQ_LEN * 2
    scratch = np.zeros(pointers + max(heads // kv, 16) * SEQ_LEN + 16 * hd + 64, np.float32)
    fn = lib.hp_attend
    fn.argtypes = [ctypes.POINTER(Stage), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = None
    slots, positions = np.zeros(TOKENS, np.int64), np.arange(TOKENS, dtype=np.int64)
    width, best = qkv.shape[1], float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for a in range(0, TOKENS, chunk):
            fn(ctypes.byref(stage), cache.ctypes.data, qkv.ctypes.data + 4 * a * width, min(chunk, TOKENS - a),
               slots.ctypes.data + 8 * a, positions.ctypes.data + 8 * a, 0, out.ctypes.data + 4 * a * heads * hd,
               scratch[pointers:].ctypes.data, scratch.ctypes.data)
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> int:
    """Time every shape and chunk through each build, alternating; print and write the JSON results."""
    from hpcpipe.kernels import cpu
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--other-lib", default="", help="another build of the kernels (_cpu*.so) to time beside")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(HERE / "results" / f"{time.strftime('%Y-%m-%d')}-attend.json"))
    args = ap.parse_args(argv)
    if args.repeats < 1 or (args.other_lib and not Path(args.other_lib).is_file()):
        ap.error("--repeats must be >= 1 and --other-lib an existing file")
    libs = {"this": cpu.library()}
    if libs["this"] is None:
        ap.error("the compiled kernels are not built here (python setup.py build_ext --inplace)")
    if args.other_lib:
        libs["other"] = ctypes.CDLL(str(Path(args.other_lib).resolve()))
        libs["other"].hp_init()
    res = {"date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(["python", *sys.argv]),
           "load_before": os.getloadavg(), "other_lib": args.other_lib, "vector_paths": cpu.vector_paths(),
           "rows": []}
    for name, shape in SHAPES.items():
        for chunk in (TOKENS, 128, 1):
            row = {"shape": name, "chunk": chunk}
            for which, lib in libs.items():
                row[f"{which}_ms"] = 1e3 * time_attend(lib, shape, chunk, args.repeats, np.random.default_rng(0))
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
    res["load_after"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
