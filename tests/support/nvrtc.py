"""NVRTC (CUDA's runtime compiler) through ctypes, without CuPy or a GPU: the CUDA sources of hpcpipe.kernels.cuda
compiled to PTX here, so a syntax or type error is found before a GPU lease, not on it.

The library comes from the ``nvidia-cuda-nvrtc`` wheel (CUDA 13, as the GPU machine's CuPy 14 uses; .ci/run
installs it) or the system's; :func:`library` is None where neither is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os


def library() -> ctypes.CDLL | None:
    """The NVRTC library, or None when it is not installed."""
    candidates = []
    try:
        import nvidia
        for root in nvidia.__path__:
            candidates += sorted(glob.glob(os.path.join(root, "*", "lib", "libnvrtc.so*")))
    except ImportError:
        pass
    found = ctypes.util.find_library("nvrtc")
    if found:
        candidates.append(found)
    for path in candidates:
        if "builtins" in os.path.basename(path):
            continue
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def version(lib: ctypes.CDLL) -> tuple[int, int]:
    """NVRTC's (major, minor)."""
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return major.value, minor.value


def compile_ptx(lib: ctypes.CDLL, source: str, options: list[str]) -> tuple[int, str, int]:
    """Compile ``source``; return (NVRTC's status, 0 for success; the compiler's log; the PTX's size in bytes)."""
    prog = ctypes.c_void_p()
    status = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernel.cu", 0, None, None)
    if status:
        return status, "nvrtcCreateProgram failed", 0
    try:
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        status = lib.nvrtcCompileProgram(prog, len(options), opts)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        ptx = ctypes.c_size_t()
        if not status:
            lib.nvrtcGetPTXSize(prog, ctypes.byref(ptx))
        return status, log.value.decode(errors="replace"), ptx.value
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
