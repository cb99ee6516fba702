"""Array backend: xp = numpy or cupy, chosen once per process; one GPU per node-local rank."""

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


def select_backend(choice: str, node_rank: int | None = None) -> Backend:
    """Return the backend for run.backend = auto | numpy | cupy; auto picks CuPy when a GPU is visible."""
    if choice not in ("auto", "numpy", "cupy"):
        raise ConfigError(f"run.backend {choice!r} is not one of auto, numpy, cupy")
    keep_freed_memory()
    gpus = _gpu_count() if choice in ("auto", "cupy") else 0
    if choice == "cupy" and gpus == 0:
        raise ConfigError("run.backend = \"cupy\" but CuPy is not installed or sees no GPU "
                          "(install hpcpipe[gpu] on a GPU node, or use run.backend = \"numpy\")")
    if gpus == 0:
        import numpy
        return Backend("numpy", numpy)
    import cupy
    device = (local_rank() if node_rank is None else node_rank) % gpus
    cupy.cuda.Device(device).use()
    return Backend("cupy", cupy, device)
