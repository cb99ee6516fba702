"""A stored 16-bit matrix made q8_0 as it is read from its safetensors file, a few stored rows at a time.

Reading the whole matrix first and quantizing it then held its 16-bit copy (a 49152 x 576 table: 54 MiB)
beside the result, and the many freed copies of a model's matrices stayed in the C heap: a q8_0 generate of a
135 M-parameter model peaked at 327 MB while loading, for 143 MB of weights. Here only one chunk of stored rows
(~128 KiB) and the quantizer's float32 scratch exist at a time.
"""

from __future__ import annotations

import numpy as np

from hpcpipe.errors import ConfigError
from hpcpipe.hf.safetensors import SafetensorsFile, _read_into
from hpcpipe.kernels.formats import RowWeight, quantize_q8_0, widen_rows

KINDS = {"BF16": "bfloat16", "F16": "float16"}


def read_quantized(file: SafetensorsFile, name: str) -> tuple[RowWeight, int]:
    """Tensor ``name`` (a 2-D BF16 / F16 (out, in) matrix, in a multiple of 32) as q8_0, and how many of its
    stored values are Inf or NaN (the result is not to be used when any are)."""
    info = file.tensors[name]
    kind = KINDS[info.dtype]
    rows, cols = info.shape
    bad = 0
    bits = np.empty(0, dtype=np.uint16)

    def widen(start: int, stop: int, out: np.ndarray) -> None:
        nonlocal bad, bits
        if bits.size < (stop - start) * cols:
            bits = np.empty((stop - start) * cols, dtype=np.uint16)
        chunk = bits[:(stop - start) * cols].reshape(stop - start, cols)
        try:
            with open(file.path, "rb", buffering=0) as f:
                f.seek(info.begin + start * cols * 2)
                got = _read_into(f, memoryview(chunk.view(np.uint8).reshape(-1)))
        except OSError as exc:
            raise ConfigError(f"safetensors file {str(file.path)!r} cannot be read: {exc.strerror or exc}") from None
        file.bytes_read += got
        if got != chunk.nbytes:
            raise ConfigError(f"safetensors file {str(file.path)!r} is truncated: tensor {name!r} needs bytes "
                              f"{info.begin}..{info.end} but the file ended after "
                              f"{info.begin + start * cols * 2 + got}")
        part = RowWeight(kind, chunk)
        bad += part.non_finite()
        widen_rows(part, 0, stop - start, out)

    with np.errstate(invalid="ignore", over="ignore"):     # Inf / NaN values are counted, then refused
        return quantize_q8_0((rows, cols), widen), bad
