"""An embedding table kept in its 16-bit storage form (bfloat16 or float16 bits), widened row by row on gather.

A model stored in 16 bits (most published checkpoints are bfloat16) computes in float32 here, and
widening is exact, so a table that is only ever gathered from (a decode stage's embedding, when the
tied head lives on another stage) can stay 16-bit: half the bytes of the largest array of a
large-vocabulary model (Llama 3's 128256 x 2048 table: 0.5 GiB instead of 1 GiB), the same rows.
"""

from __future__ import annotations

from typing import Any

import numpy as np

KINDS = ("bfloat16", "float16")
_INF_NAN = {"bfloat16": 0x7F80, "float16": 0x7C00}     # exponent bits all ones: Inf or NaN


class HalfTable:
    """A (rows, width) table of 16-bit values; ``table[ids]`` returns the rows widened to ``dtype``."""

    def __init__(self, bits: Any, kind: str, dtype: Any = np.float32):
        if kind not in KINDS:
            raise ValueError(f"half table: kind must be one of {KINDS}, got {kind!r}")
        if getattr(bits, "dtype", None) != np.uint16 or getattr(bits, "ndim", 0) != 2:
            raise ValueError("half table: bits must be a 2-D uint16 array")
        self.bits, self.kind, self.dtype = bits, kind, np.dtype(dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        """The table's (rows, width)."""
        return tuple(self.bits.shape)

    @property
    def nbytes(self) -> int:
        """Bytes held: two per value."""
        return int(self.bits.nbytes)

    def on(self, xp: Any) -> HalfTable:
        """The same table with its bits on the xp backend."""
        return HalfTable(xp.asarray(self.bits), self.kind, self.dtype)

    def widen(self, rows: Any) -> Any:
        """Return 16-bit rows (uint16 bits) as values of the table's dtype, exactly."""
        if self.kind == "bfloat16":    # bfloat16 is the high half of a float32
            wide = rows.astype(np.uint32)
            wide <<= 16
            return wide.view(np.float32).astype(self.dtype, copy=False)
        return rows.view(np.float16).astype(self.dtype)

    def __getitem__(self, ids: Any) -> Any:
        return self.widen(self.bits[ids])

    def dense(self) -> Any:
        """The whole table widened (for a tied head on the same stage, which multiplies by all of it)."""
        return self.widen(self.bits)

    def non_finite(self) -> int:
        """How many values are Inf or NaN (read from the exponent bits)."""
        mask = _INF_NAN[self.kind]
        return int(((self.bits & mask) == mask).sum())


class ColumnTable:
    """An embedding table kept transposed, (width, rows) C-contiguous, as a tied head multiplies by it.

    A decode step's head reads the whole table for one or a few rows of activations: ``x @ table_t``
    streams it at the fast matrix-vector rate (measured on one core: 25 GB/s, against 12.6 GB/s for
    ``x @ table.T`` of the (rows, width) table), while the embedding gathers only the few columns of the
    step's tokens. So a stage holding both the embedding and the tied head keeps one copy, this one.
    """

    def __init__(self, table_t: Any):
        self.t = table_t

    @property
    def shape(self) -> tuple[int, ...]:
        """The table's (rows, width), as the (rows, width) table it stands for."""
        return (int(self.t.shape[1]), int(self.t.shape[0]))

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return int(self.t.nbytes)

    def __getitem__(self, ids: Any) -> Any:
        """Rows ``ids`` of the table (a fresh (len(ids), width) array)."""
        return self.t[:, ids].T.copy()
