"""Weight matrices kept as stored: float32, bfloat16 or float16 bits, or q8_0 blocks, in (out, in) rows.

``model.weight_format`` picks one for serving, generation and evaluation: ``float32`` widens every weight
on load (the training layout), ``stored`` keeps a checkpoint's 16-bit values as they are (widening them in
registers gives the float32 computation on the same weights: exact, half the bytes), ``q8_0`` quantizes to
GGUF's q8_0 (blocks of 32 values along ``in`` as int8 with one float16 scale d = max|w| / 127; each value
round(w / d), halves away from zero as llama.cpp's ``roundf``): 1.0625 bytes a weight, not exact.

A :class:`RowWeight` is what the compiled kernels multiply by: ``y = x @ W.T`` with W (out, in) row-major,
Hugging Face's nn.Linear layout, so a 16-bit checkpoint's matrix is used without a transposed copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hpcpipe.kernels.mapped import mapped_zeros

FORMATS = ("float32", "stored", "q8_0")     # model.weight_format, once "auto" is resolved
# what "auto" means for generate, serve and evaluate: as stored where the compiled kernels run the stage (the
# float32 computation on the same weights, half the bytes and faster: docs/kernels.md), float32 elsewhere
INFERENCE_DEFAULT = "stored"
KINDS = ("float32", "bfloat16", "float16", "q8_0")
Q8_BLOCK = 32


def inference_format(configured: str, compiled: bool = True) -> str:
    """The weight format generate, serve and evaluate use for model.weight_format ``configured`` (``compiled``:
    whether the compiled kernels run the stage; without them "auto" widens to float32 at load, as before)."""
    if configured != "auto":
        return configured
    return INFERENCE_DEFAULT if compiled else "float32"


@dataclass(frozen=True)
class RowWeight:
    """A (out, in) weight as stored: ``kind`` float32 (float32 values), bfloat16 / float16 (uint16 bits), or
    q8_0 (int8 values and uint16 float16 scales, one per block of 32 along ``in``)."""

    kind: str
    data: np.ndarray
    scales: np.ndarray | None = None

    def __post_init__(self):
        want = {"float32": np.float32, "bfloat16": np.uint16, "float16": np.uint16, "q8_0": np.int8}.get(self.kind)
        if want is None:
            raise ValueError(f"row weight: kind must be one of {KINDS}, got {self.kind!r}")
        if self.data.dtype != want or self.data.ndim != 2 or not self.data.flags.c_contiguous:
            raise ValueError(f"row weight: {self.kind} data must be a C-contiguous 2-D {np.dtype(want).name} array, "
                             f"got {self.data.dtype} {self.data.shape}")
        if self.kind == "q8_0":
            rows, cols = self.data.shape
            if cols % Q8_BLOCK or self.scales is None or self.scales.dtype != np.uint16 \
                    or self.scales.shape != (rows, cols // Q8_BLOCK) or not self.scales.flags.c_contiguous:
                raise ValueError(f"row weight: q8_0 needs in % 32 == 0 and (out, in / 32) uint16 scales, got "
                                 f"{self.data.shape} and {None if self.scales is None else self.scales.shape}")

    @property
    def shape(self) -> tuple[int, int]:
        """(out, in)."""
        return tuple(self.data.shape)

    @property
    def nbytes(self) -> int:
        """Bytes held (values and scales)."""
        return int(self.data.nbytes + (0 if self.scales is None else self.scales.nbytes))

    def dense(self, dtype: Any = np.float32) -> np.ndarray:
        """The (out, in) values widened (dequantized) to ``dtype``: the reference the kernels are tested against."""
        if self.kind == "float32":
            return self.data.astype(dtype, copy=False)
        if self.kind == "bfloat16":
            return widen_bf16(self.data).astype(dtype, copy=False)
        if self.kind == "float16":
            return self.data.view(np.float16).astype(dtype)
        d = self.scales.view(np.float16).astype(np.float32)
        blocks = self.data.reshape(self.shape[0], -1, Q8_BLOCK).astype(np.float32) * d[:, :, None]
        return blocks.reshape(self.shape).astype(dtype, copy=False)

    def non_finite(self) -> int:
        """How many values are Inf or NaN (16-bit: read from the exponent bits; q8_0: its scales)."""
        if self.kind == "float32":
            return int(self.data.size - np.count_nonzero(np.isfinite(self.data)))
        bits, mask = (self.scales, 0x7C00) if self.kind == "q8_0" else \
            (self.data, 0x7F80 if self.kind == "bfloat16" else 0x7C00)
        return int(np.count_nonzero((bits & mask) == mask))

    def rows_at(self, ids: np.ndarray) -> np.ndarray:
        """Rows ``ids`` widened (dequantized) to float32: an embedding's gather from the table a head multiplies by."""
        scales = None if self.scales is None else np.ascontiguousarray(self.scales[ids])
        return RowWeight(self.kind, np.ascontiguousarray(self.data[ids]), scales).dense()

    def rows(self, start: int, stop: int) -> RowWeight:
        """Rows [start, stop) (outputs), as views."""
        return RowWeight(self.kind, self.data[start:stop], None if self.scales is None else self.scales[start:stop])


def widen_bf16(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) as float32 values, exactly (bfloat16 is the high half of a float32)."""
    wide = bits.astype(np.uint32)
    wide <<= 16
    return wide.view(np.float32)


def quantize_q8_0(w: Any, widen: Any = None) -> RowWeight:
    """Return GGUF's q8_0 of a float (out, in) matrix (in a multiple of 32), block by block along ``in``
    (``w``: the matrix, or its (out, in) shape when ``widen`` gives its rows).

    Rows are quantized a chunk at a time (``widen(start, stop, out)`` writes rows [start, stop) as float32 into
    ``out`` when ``w`` is stored otherwise) through scratch made once per matrix, so the float temporaries stay
    under a MiB whatever the matrix (a 49152 x 576 head quantized at once took ~20 bytes a weight, 560 MB, above
    the model): 4 MiB chunks, each temporary made afresh, left ~16 MiB of freed heap between the kept matrices of
    a 135 M model, resident to the end.
    """
    rows, cols = w if isinstance(w, tuple) else w.shape
    if cols % Q8_BLOCK:
        raise ValueError(f"q8_0: the input width {cols} is not a multiple of {Q8_BLOCK}")
    q = mapped_zeros((rows, cols), np.int8)                          # kept: its own pages (kernels/mapped.py)
    d = np.empty((rows, cols // Q8_BLOCK), dtype=np.float16)
    step = min(rows, max(1, (1 << 16) // cols))                      # ~256 KiB of float32 a chunk
    nb = cols // Q8_BLOCK
    chunk_buf, scaled_buf = np.empty((2, step, cols), dtype=np.float32)
    half_buf = np.empty((step, cols), dtype=np.float32)
    amax_buf, inv_buf = np.empty((2, step, nb), dtype=np.float32)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        n = stop - start
        chunk, scaled, half, amax, inv = chunk_buf[:n], scaled_buf[:n], half_buf[:n], amax_buf[:n], inv_buf[:n]
        if widen is not None:
            widen(start, stop, chunk)
        else:
            chunk[...] = w[start:stop]
        blocks = chunk.reshape(n, nb, Q8_BLOCK)
        np.abs(chunk, out=scaled)
        np.max(scaled.reshape(n, nb, Q8_BLOCK), axis=2, out=amax)
        amax /= np.float32(127.0)                                    # d, float32
        d[start:stop] = amax
        # as llama.cpp: values scaled by the inverse of the float32 scale, the scale stored rounded to float16
        inv[...] = 0
        np.divide(np.float32(1.0), amax, out=inv, where=amax != 0)
        sb = scaled.reshape(n, nb, Q8_BLOCK)
        np.multiply(blocks, inv[:, :, None], out=sb)
        np.copysign(np.float32(0.5), scaled, out=half)
        scaled += half
        np.trunc(scaled, out=scaled)                                 # half away from zero (C's roundf)
        np.clip(scaled, -127, 127, out=scaled)
        q[start:stop] = scaled
    return RowWeight("q8_0", q, d.view(np.uint16))


def widen_rows(w: RowWeight, start: int, stop: int, out: np.ndarray) -> None:
    """Write rows [start, stop) of a float32 / bfloat16 / float16 row weight into ``out`` as float32."""
    bits = w.data[start:stop]
    if w.kind == "bfloat16":
        wide = out.view(np.uint32)
        wide[...] = bits
        wide <<= 16
    elif w.kind == "float16":
        out[...] = bits.view(np.float16)
    else:
        out[...] = w.rows(start, stop).dense()


def row_weight(value: Any, fmt: str) -> RowWeight:
    """The (out, in) row weight of ``value`` in weight format ``fmt``.

    ``value`` is a RowWeight (taken as it is, or quantized for q8_0) or a float (in, out) array as the
    training layout holds it (transposed once here). q8_0 quantizes matrices whose input width is a multiple
    of 32, as GGUF does; others stay as they are.
    """
    if isinstance(value, RowWeight):
        if fmt == "q8_0" and value.kind != "q8_0" and value.shape[1] % Q8_BLOCK == 0:
            return quantize_q8_0(value.data, lambda start, stop, out: widen_rows(value, start, stop, out))
        return value
    rows = np.ascontiguousarray(np.asarray(value, dtype=np.float32).T)
    return quantize_q8_0(rows) if fmt == "q8_0" and rows.shape[1] % Q8_BLOCK == 0 else RowWeight("float32", rows)


def stacked(parts: list[RowWeight]) -> RowWeight:
    """The row weights one above the other (their outputs in order: q | k | v, gate | up): one product for all.

    Parts stored in different float kinds (a checkpoint with k_proj in float32 beside bfloat16 ones, or bfloat16
    beside float16) are widened to float32 first, exactly: one product needs one kind.
    """
    kinds = {p.kind for p in parts}
    if len(kinds) > 1 and "q8_0" not in kinds:
        parts = [RowWeight("float32", np.ascontiguousarray(p.dense(np.float32))) for p in parts]
        kinds = {"float32"}
    if len(kinds) != 1 or len({p.shape[1] for p in parts}) != 1:
        raise ValueError(f"stacked: parts of kinds {sorted(kinds)} and inputs {[p.shape[1] for p in parts]} differ")
    data = np.concatenate([p.data for p in parts])
    scales = np.concatenate([p.scales for p in parts]) if parts[0].scales is not None else None
    return RowWeight(parts[0].kind, data, scales)


def kept_values(name: str, value: Any, fmt: str) -> Any:
    """A parameter's values as weight format ``fmt`` keeps them, in its own layout (a float (in, out) matrix stays
    (in, out); an embedding table (vocab, d)): q8_0 rounds every matrix whose input width allows, widened back."""
    array = np.asarray(value)
    if fmt != "q8_0" or array.ndim != 2 or name == "pos_emb":
        return value
    if name == "tok_emb":          # (vocab, d) rows: the head's (out, in) already
        return row_weight(RowWeight("float32", np.ascontiguousarray(array, dtype=np.float32)), fmt).dense()
    return row_weight(array, fmt).dense().T
