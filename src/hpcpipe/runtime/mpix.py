"""An MPI extension that mpi4py does not wrap, read from the MPI library this process loaded: CUDA awareness.

mpi4py 4.1 has no ``MPI.Query_cuda_support``; the C function ``MPIX_Query_cuda_support`` is in MPICH (4.0 and
later, including the PyPI ``mpich`` wheel, whose answer is 0: it is built without CUDA) and in Open MPI's CUDA
extension. It is looked up in the libmpi already mapped into the process (mpi4py loads it privately, so the
process's global symbols do not have it). No mpi4py import here: :mod:`hpcpipe.runtime.comm` stays the one
module that loads MPI, and calls this after MPI is initialised.
"""

from __future__ import annotations

import ctypes
import os

LIBRARY_PREFIXES = ("libmpi.so", "libmpi_abi.so", "libmpich.so")


def loaded_libmpi(maps: str = "/proc/self/maps") -> str | None:
    """Path of the MPI library mapped into this process, or None (MPI not loaded yet, or no /proc)."""
    try:
        with open(maps) as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 6 and os.path.basename(fields[-1]).startswith(LIBRARY_PREFIXES):
                    return fields[-1]
    except OSError:
        return None
    return None


def library_cuda_support() -> bool | None:
    """``MPIX_Query_cuda_support()`` of the loaded MPI library: True or False, None when it has no such function.

    Call after MPI_Init (importing ``mpi4py.MPI`` does it).
    """
    path = loaded_libmpi()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path)
    except OSError:
        return None
    query = getattr(lib, "MPIX_Query_cuda_support", None)
    if query is None:
        return None
    query.restype, query.argtypes = ctypes.c_int, []
    return bool(query())
