"""Reading the part of a safetensors tensor one tensor-parallel rank holds, never the whole tensor.

A rank's part is ``index`` (a slice or sorted positions) along one axis of the tensor as hpcpipe lays it
out, which is the stored tensor or its transpose (a ``Linear`` weight is stored (out, in), hpcpipe holds
(in, out)). Along the stored first axis the part is whole stored rows: only their byte ranges are read.
Along the second axis every stored row is read, a block of rows (``CHUNK_BYTES``) at a time, and only the
part's columns kept: the peak is the part plus one block.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hpcpipe.errors import ConfigError
from hpcpipe.hf.safetensors import CHUNK_BYTES, READABLE, SafetensorsFile, _read_into


def _runs(positions: np.ndarray) -> list[tuple[int, int]]:
    """Contiguous runs [start, stop) of sorted positions."""
    if positions.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    return [(int(run[0]), int(run[-1]) + 1) for run in np.split(positions, breaks)]


def _widen(raw: np.ndarray, code: str, dtype: np.dtype) -> np.ndarray:
    """Stored values (as read) in ``dtype``: bfloat16 widened exactly to float32 first; a 16-bit float asked for as
    uint16 comes as its own bits."""
    if dtype == np.uint16 and code in ("BF16", "F16"):
        return raw.view(np.uint16)
    if code == "BF16":
        raw = (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(dtype, copy=False)


def read_part(file: SafetensorsFile, name: str, dtype: Any, transpose: bool, axis: int, index: Any) -> np.ndarray:
    """Return ``index`` along ``axis`` of tensor ``name`` (transposed first when ``transpose``), as ``dtype``
    (uint16 for a 16-bit tensor: its stored bits)."""
    info = file.tensors.get(name)
    if info is None:
        raise ConfigError(f"safetensors file {str(file.path)!r} holds no tensor {name!r}")
    if info.dtype not in READABLE or len(info.shape) not in (1, 2):
        raise ConfigError(f"safetensors file {str(file.path)!r}: tensor {name!r} ({info.dtype}, shape {info.shape}) "
                          f"cannot be read in parts (1-D or 2-D float16/bfloat16/float32/float64 only)")
    stored = np.dtype(READABLE[info.dtype])
    dtype = np.dtype(dtype) if dtype is not None else (np.dtype(np.float32) if info.dtype == "BF16" else stored)
    rows_total, cols = (info.shape[0], 1) if len(info.shape) == 1 else info.shape
    stored_axis = (1 - axis) if transpose and len(info.shape) == 2 else axis
    positions = np.arange(info.shape[stored_axis])[index]
    if stored_axis == 0:
        runs, keep = _runs(positions), slice(None)
        out = np.empty((positions.size, cols), dtype=dtype)
    else:
        runs, keep = [(0, rows_total)], positions
        out = np.empty((rows_total, positions.size), dtype=dtype)
    row_bytes = cols * stored.itemsize
    block = max(1, CHUNK_BYTES // row_bytes)
    filled = 0
    try:
        with open(file.path, "rb", buffering=0) as f:
            for start, stop in runs:
                for first in range(start, stop, block):
                    n = min(block, stop - first)
                    raw = np.empty(n * cols, dtype=stored)
                    f.seek(info.begin + first * row_bytes)
                    got = _read_into(f, memoryview(raw.view(np.uint8)))
                    file.bytes_read += got
                    if got != raw.nbytes:
                        raise ConfigError(f"safetensors file {str(file.path)!r} is truncated: tensor {name!r} "
                                          f"ends at byte {info.end} but the file ended before")
                    out[filled:filled + n] = _widen(raw, info.dtype, dtype).reshape(n, cols)[:, keep]
                    filled += n
    except OSError as exc:
        raise ConfigError(f"safetensors file {str(file.path)!r} cannot be read: {exc.strerror or exc}") from None
    if len(info.shape) == 1:
        return out.reshape(-1)
    return np.ascontiguousarray(out.T) if transpose else out
