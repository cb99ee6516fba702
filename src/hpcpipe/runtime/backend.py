"""Array backend: xp = numpy or cupy, chosen once per process; one GPU per node-local rank; TF32 on request.

``run.tf32`` (CuPy only) lets float32 matrix products use the TF32 matrix units. CuPy 14 reaches cuBLAS
two ways, so :func:`set_tf32` sets both: 2-D products (``x @ W``, cublasGemmEx) follow CuPy's compute
type for float32 (``cupy._core.set_compute_type``; the environment variable ``CUPY_TF32=1`` sets the same
thing, but only if it is set before the process's first float32 product), and batched products (ndim > 2:
attention's scores and mix, cublasGemmStridedBatchedEx with a legacy compute type) follow the math mode
of the device's cuBLAS handle (``CUBLAS_TF32_TENSOR_OP_MATH``). NumPy has no such mode: the switch is
ignored there with a note. ``NVIDIA_TF32_OVERRIDE=0`` in the environment still forbids TF32 everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hpcpipe.errors import ConfigError
from hpcpipe.runtime.host_memory import keep_freed_memory
from hpcpipe.runtime.launcher import local_rank


@dataclass(frozen=True)
class Backend:
    """The chosen array module plus what communication needs to know about it."""

    name: str          # "numpy" | "cupy"
    xp: Any
    device: int = -1   # CUDA device id, -1 on the CPU
    tf32: bool = False                 # float32 matrix products may use TF32 matrix units (run.tf32, CuPy only)
    notes: tuple[str, ...] = ()        # what the caller should tell the user once (e.g. run.tf32 ignored)

    @property
    def on_gpu(self) -> bool:
        """True when arrays live in GPU memory."""
        return self.name == "cupy"

    def to_host(self, array: Any) -> Any:
        """Return a NumPy copy (or the array itself on the CPU)."""
        return array.get() if self.on_gpu else array

    def asarray(self, array: Any, dtype: Any = None) -> Any:
        """Return array on this backend's device."""
        return self.xp.asarray(array, dtype=dtype)

    def synchronize(self) -> None:
        """Wait for queued device work, so MPI sees finished buffers."""
        if self.on_gpu:
            self.xp.cuda.get_current_stream().synchronize()


def _gpu_count() -> int:
    try:
        import cupy
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no CuPy, no driver or no device: the CPU path
        return 0


# cuBLAS's cublasMath_t values (CuPy 14 names only the first two)
CUBLAS_DEFAULT_MATH = 0
CUBLAS_TF32_TENSOR_OP_MATH = 3
TF32_IGNORED = "run.tf32 = true is ignored on the NumPy backend (TF32 is a mode of NVIDIA's matrix units; CuPy only)"


def set_tf32(xp: Any, enabled: bool) -> str:
    """Let (or stop) float32 matrix products of ``xp`` use TF32 matrix units; return a note, "" when applied.

    On NumPy nothing changes and the note says so. On CuPy both paths to cuBLAS are set (module docstring):
    the float32 compute type of 2-D products and the math mode of the current device's cuBLAS handle. A GPU
    older than compute capability 8.0 keeps full float32 (CuPy warns).
    """
    if getattr(xp, "__name__", "") != "cupy":
        return TF32_IGNORED if enabled else ""
    import numpy
    linalg = xp._core._routines_linalg
    xp._core.set_compute_type(numpy.float32, linalg.COMPUTE_TYPE_TF32 if enabled else linalg.COMPUTE_TYPE_DEFAULT)
    xp.cuda.cublas.setMathMode(xp.cuda.get_cublas_handle(),
                               CUBLAS_TF32_TENSOR_OP_MATH if enabled else CUBLAS_DEFAULT_MATH)
    return ""


def tf32_state(xp: Any) -> dict[str, Any]:
    """What a CuPy process's float32 products use now: CuPy's compute type name and the handle's math mode."""
    if getattr(xp, "__name__", "") != "cupy":
        return {"backend": getattr(xp, "__name__", "?"), "tf32": False}
    import numpy
    linalg = xp._core._routines_linalg
    kind = xp._core.get_compute_type(numpy.float32)
    mode = int(xp.cuda.cublas.getMathMode(xp.cuda.get_cublas_handle()))
    batched = (mode & CUBLAS_TF32_TENSOR_OP_MATH) == CUBLAS_TF32_TENSOR_OP_MATH
    return {"backend": "cupy", "compute_type": linalg.compute_type_to_str(kind), "math_mode": mode,
            "tf32": kind == linalg.COMPUTE_TYPE_TF32 and batched}


def no_gpu_error() -> ConfigError:
    """The refusal of run.backend = "cupy" where CuPy sees no GPU."""
    return ConfigError("run.backend = \"cupy\" but CuPy is not installed or sees no GPU "
                       "(install hpcpipe[gpu] on a GPU node, or use run.backend = \"numpy\")")


def check_backend(choice: str) -> None:
    """Raise ConfigError when run.backend cannot run here: in a command's setup, so that rank 0 says it once."""
    if choice == "cupy" and _gpu_count() == 0:
        raise no_gpu_error()


def runs_on_gpu(choice: str) -> bool:
    """Whether run.backend = ``choice`` runs on CuPy here (as select_backend picks it: "auto" where a GPU is seen)."""
    return choice == "cupy" or (choice == "auto" and _gpu_count() > 0)


def select_backend(choice: str, node_rank: int | None = None, tf32: bool = False) -> Backend:
    """Return the backend for run.backend = auto | numpy | cupy; auto picks CuPy when a GPU is visible.

    ``tf32`` (run.tf32): on CuPy, float32 matrix products may use TF32 (:func:`set_tf32`); on NumPy it is
    ignored and the returned backend's ``notes`` say so.
    """
    if choice not in ("auto", "numpy", "cupy"):
        raise ConfigError(f"run.backend {choice!r} is not one of auto, numpy, cupy")
    keep_freed_memory()
    gpus = _gpu_count() if choice in ("auto", "cupy") else 0
    if choice == "cupy" and gpus == 0:
        raise no_gpu_error()
    if gpus == 0:
        import numpy
        note = set_tf32(numpy, tf32)
        return Backend("numpy", numpy, notes=(note,) if note else ())
    import cupy
    device = (local_rank() if node_rank is None else node_rank) % gpus
    cupy.cuda.Device(device).use()
    set_tf32(cupy, tf32)      # also when off: a process that switched it on earlier gets full float32 back
    return Backend("cupy", cupy, device, tf32=tf32)
