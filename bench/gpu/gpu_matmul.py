"""Matrix-product rates measured in the benchmark run: the ceilings its MFU figures divide by.

    python bench/gpu/gpu_matmul.py [--n 8192] [--reps 10]     # prints one JSON line

Through CuPy (what hpcpipe computes with): an n x n x n product in float32 (full precision), float32 with
TF32 (hpcpipe's run.tf32: both CuPy roads to cuBLAS switched) and bfloat16 (ml_dtypes; CuPy 14's 2-D path
is cublasGemmEx with CUDA_R_16BF in and out, float32 accumulation); and an attention-shaped batched product
(b*heads, T, 128) @ (b*heads, 128, T) in the same three, which goes through CuPy's other road
(cublasGemmStridedBatchedEx). Through PyTorch, the same n^3 product in float32, TF32 and bfloat16, as a
reference of what cuBLAS gives a framework. Random normal operands (never zeros), 3 warm-ups, then the
median of ``reps`` products timed with CUDA events. A failure (e.g. a dtype a path does not take) is
recorded as its message; each product's first 256 rows are checked against float64 (``*_relerr``). Without
CuPy: NumPy's float32 rate on this CPU, for the rehearsal.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _median(fn, once, reps: int) -> float:
    """Median seconds of ``once(fn)`` (one timed run) over reps runs, after 3 warm-ups."""
    for _ in range(3):
        once(fn)
    return statistics.median(once(fn) for _ in range(reps))


def _relerr(cupy, a32, b32, c) -> float | str:
    """The first 256 rows (of the first batch) of c against float64: fp32 ~1e-6, TF32 ~1e-4, bf16 ~1e-3."""
    try:
        ref = a32[..., :256, :].astype(cupy.float64) @ b32.astype(cupy.float64)
        got = c[..., :256, :].astype(cupy.float64)
        return float(cupy.linalg.norm(got - ref) / cupy.linalg.norm(ref))
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc)[:200]}"


def cupy_rates(n: int, reps: int, batch: int = 32, t: int = 1024, hd: int = 128) -> dict:
    """TFLOP/s of CuPy products: 2-D n^3 and attention-shaped batched, in float32, TF32 and bfloat16."""
    import cupy
    import ml_dtypes

    from hpcpipe.runtime.backend import set_tf32

    def once(fn) -> float:
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        return cupy.cuda.get_elapsed_time(start, end) / 1e3

    rng = cupy.random.default_rng(0)
    shapes = {"2d": ((n, n), (n, n), 2 * n ** 3), "batched": ((batch, t, hd), (batch, hd, t), 2 * batch * t * t * hd)}
    out = {}
    for path, (sa, sb, flops) in shapes.items():
        a32, b32 = rng.standard_normal(sa, dtype=cupy.float32), rng.standard_normal(sb, dtype=cupy.float32)
        for mode in ("fp32", "tf32", "bf16"):
            key = f"cupy_{path}_{mode}"
            try:
                set_tf32(cupy, mode == "tf32")
                bf16 = ml_dtypes.bfloat16
                a, b = (a32, b32) if mode != "bf16" else (a32.astype(bf16), b32.astype(bf16))
                c = a @ b
                if mode == "bf16":
                    out[f"{key}_result_dtype"] = str(c.dtype)
                out[key] = flops / _median(lambda a=a, b=b: a @ b, once, reps) / 1e12
                out[f"{key}_relerr"] = _relerr(cupy, a32, b32, c)
            except Exception as exc:   # a path that does not take the dtype: the finding itself
                out[key] = None
                out[f"{key}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            finally:
                set_tf32(cupy, False)
        del a32, b32
    cupy.get_default_memory_pool().free_all_blocks()
    return out


def torch_rates(n: int, reps: int) -> dict:
    """TFLOP/s of torch.matmul n^3 on the GPU in float32, TF32 and bfloat16 (None without torch or CUDA)."""
    try:
        import torch
    except ImportError as exc:
        return {"torch_error": str(exc)}
    if not torch.cuda.is_available():
        return {"torch_error": "torch sees no CUDA device"}

    def once(fn) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    g = torch.Generator(device="cuda").manual_seed(0)
    a32 = torch.randn(n, n, device="cuda", generator=g)
    b32 = torch.randn(n, n, device="cuda", generator=g)
    out = {"torch": torch.__version__}
    before = torch.get_float32_matmul_precision()
    try:
        for mode, precision, dtype in (("fp32", "highest", torch.float32), ("tf32", "high", torch.float32),
                                       ("bf16", "highest", torch.bfloat16)):
            torch.set_float32_matmul_precision(precision)
            a, b = a32.to(dtype), b32.to(dtype)
            out[f"torch_2d_{mode}"] = 2 * n ** 3 / _median(lambda a=a, b=b: a @ b, once, reps) / 1e12
    finally:
        torch.set_float32_matmul_precision(before)
    return out


def numpy_rate(n: int, reps: int) -> dict:
    """NumPy float32 n^3 TFLOP/s on this CPU (the rehearsal's stand-in for the GPU ceilings)."""
    import numpy as np
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((n, n), dtype=np.float32), rng.standard_normal((n, n), dtype=np.float32)

    def once(fn) -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    return {"numpy_2d_fp32": 2 * n ** 3 / _median(lambda: a @ b, once, reps) / 1e12}


def main() -> None:
    """Measure every rate this machine has and print them as one JSON line."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--cpu", action="store_true", help="NumPy only (the rehearsal without CuPy)")
    args = ap.parse_args()
    result = {"n": args.n, "reps": args.reps}
    if args.cpu:
        result.update(numpy_rate(args.n, args.reps))
    else:
        result.update(cupy_rates(args.n, args.reps))
        result.update(torch_rates(args.n, args.reps))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
