"""What the device machine has, as the GPU check needs it: GPU, CUDA, CuPy, NumPy, torch, MPI and its CUDA awareness,
what run.tf32 sets, and what CuPy does with bfloat16. Prints a readable block and writes it as JSON.

    python bench/gpu/env_report.py --out $OUT/env.json

Nothing here fails the check: a missing piece is recorded as its error message. The bfloat16 probe runs, on
small random operands, the operations hpcpipe's layers would need for ``model.dtype = "bfloat16"``: a 2-D
product (x @ W), a batched one (attention's q @ k^T), a reduction, exp and a float32 round trip, each with its
relative error against float32.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys

from gpu_common import mpiexec


def _try(fn):
    try:
        return fn()
    except Exception as exc:   # a missing piece is a finding, not a failure
        return f"error: {type(exc).__name__}: {str(exc)[:300]}"


def gpu_info() -> dict:
    """nvidia-smi's view and CuPy's: device name, compute capability, SMs, memory, CUDA runtime and driver."""
    out = {}
    if shutil.which("nvidia-smi"):
        out["nvidia_smi"] = _try(lambda: subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30).stdout.strip())
    try:
        import cupy
    except ImportError as exc:
        out["cupy"] = f"not installed ({exc})"
        return out
    out["cupy"] = cupy.__version__
    rt = cupy.cuda.runtime
    out["cuda_runtime"] = _try(rt.runtimeGetVersion)
    out["cuda_driver"] = _try(rt.driverGetVersion)
    out["devices"] = _try(rt.getDeviceCount)
    props = _try(lambda: rt.getDeviceProperties(0))
    if isinstance(props, dict):
        out["device"] = {"name": props["name"].decode(), "cc": f"{props['major']}.{props['minor']}",
                         "sms": props["multiProcessorCount"], "memory_gib": props["totalGlobalMem"] / 2 ** 30}
    out["cupy_env"] = {k: v for k, v in os.environ.items() if k.startswith(("CUPY_", "NVIDIA_TF32", "CUDA_"))}
    return out


def mpi_info() -> dict:
    """mpi4py, the MPI library it loaded, MPI.Query_cuda_support() and what hpcpipe concludes (comm.cuda_aware)."""
    launcher = mpiexec()
    out = {"mpiexec": launcher if shutil.which(launcher) else None, "mpiexec_on_path": shutil.which("mpiexec"),
           "MPI4PY_LIBMPI": os.environ.get("MPI4PY_LIBMPI", "")}
    try:
        import mpi4py
        from mpi4py import MPI
    except Exception as exc:
        out["mpi4py"] = f"error: {type(exc).__name__}: {exc}"
        return out
    out["mpi4py"] = mpi4py.__version__
    out["library"] = MPI.Get_library_version().strip().splitlines()[0]
    out["standard"] = ".".join(map(str, MPI.Get_version()))
    query = getattr(MPI, "Query_cuda_support", None)
    out["MPI.Query_cuda_support"] = _try(query) if query else f"not provided by mpi4py {mpi4py.__version__}"
    from hpcpipe.runtime.comm import cuda_aware
    from hpcpipe.runtime.mpix import library_cuda_support, loaded_libmpi
    out["libmpi"] = loaded_libmpi()
    out["MPIX_Query_cuda_support"] = _try(library_cuda_support)    # the C extension, from the loaded library
    out["hpcpipe_cuda_aware"] = cuda_aware()
    out["staging"] = "device arrays pass to MPI directly" if out["hpcpipe_cuda_aware"] else \
        "device arrays are staged through host memory (counted in host_device_bytes)"
    if out["mpiexec"]:
        hello = "from mpi4py import MPI; c = MPI.COMM_WORLD; print('rank', c.Get_rank(), 'of', c.Get_size())"
        proc = _try(lambda: subprocess.run([out["mpiexec"], "-n", "2", sys.executable, "-c", hello],
                                           capture_output=True, text=True, timeout=60))
        out["two_ranks"] = proc if isinstance(proc, str) else (proc.stdout + proc.stderr).strip()
    return out


def tf32_info() -> dict:
    """What select_backend(tf32=...) sets on this machine (CuPy's compute type and the cuBLAS math mode)."""
    from hpcpipe.runtime.backend import select_backend, set_tf32, tf32_state
    try:
        backend = select_backend("auto", node_rank=0, tf32=True)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    on = tf32_state(backend.xp)
    set_tf32(backend.xp, False)
    return {"backend": backend.name, "notes": list(backend.notes), "with_tf32": on, "after_off": tf32_state(backend.xp)}


def bf16_probe() -> dict:
    """Which operations CuPy does on ml_dtypes.bfloat16, and their relative error against float32."""
    try:
        import cupy
        import ml_dtypes
    except ImportError as exc:
        return {"skipped": str(exc)}
    bf16 = ml_dtypes.bfloat16
    rng = cupy.random.default_rng(3)
    x, w = rng.standard_normal((256, 512), dtype=cupy.float32), rng.standard_normal((512, 384), dtype=cupy.float32)
    q, k = rng.standard_normal((8, 64, 32), dtype=cupy.float32), rng.standard_normal((8, 32, 64), dtype=cupy.float32)

    def rel(got, want):
        got = got.astype(cupy.float32)
        return float(cupy.linalg.norm(got - want) / cupy.linalg.norm(want))

    ops = {"2d_matmul": lambda: rel(x.astype(bf16) @ w.astype(bf16), x @ w),
           "2d_matmul_result_dtype": lambda: str((x.astype(bf16) @ w.astype(bf16)).dtype),
           "batched_matmul": lambda: rel(q.astype(bf16) @ k.astype(bf16), q @ k),
           "sum_axis": lambda: rel(x.astype(bf16).sum(axis=1), x.sum(axis=1)),
           "exp": lambda: rel(cupy.exp(x.astype(bf16) * 0.1), cupy.exp(x * 0.1)),
           "max_axis": lambda: rel(x.astype(bf16).max(axis=1), x.max(axis=1)),
           "round_trip_f32": lambda: rel(x.astype(bf16), x)}
    return {name: _try(op) for name, op in ops.items()} | {"ml_dtypes": ml_dtypes.__version__}


def main() -> None:
    """Collect everything, print it, write the JSON."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import numpy
    info = {"python": sys.version.split()[0], "executable": sys.executable, "machine": platform.machine(),
            "cpus": os.cpu_count(), "numpy": numpy.__version__}
    info["torch"] = _try(lambda: __import__("torch").__version__ + " cuda " + str(__import__("torch").version.cuda))
    import hpcpipe
    info["hpcpipe"] = os.path.dirname(hpcpipe.__file__)
    info["gpu"] = gpu_info()
    info["mpi"] = mpi_info()
    info["tf32"] = tf32_info()
    info["bf16"] = bf16_probe()
    with open(args.out, "w") as f:
        json.dump(info, f, indent=1, default=str)
    for key, value in info.items():
        print(f"{key:9s} {json.dumps(value, default=str) if isinstance(value, dict) else value}", flush=True)


if __name__ == "__main__":
    main()
