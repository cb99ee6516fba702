"""A weight kept as stored (float32, bfloat16 / float16 bits or q8_0) standing in for a layer's float (in, out) matrix.

The NumPy steps of a decode stage multiply ``x @ weight`` with weights widened to float32 at load. Where the compiled
stage does not run them (a GPU: CuPy), a :class:`RowProduct` keeps the (out, in) :class:`RowWeight` on the device
as it is stored (half the bytes of float32 for a bfloat16 checkpoint, 34/32 bytes a weight for q8_0) and ``x @ it``
runs the backend's row product on it: :mod:`hpcpipe.kernels.cuda` on CuPy, :mod:`hpcpipe.kernels.cpu` on NumPy (what
the CPU tests check the wiring with). The products are float32, so the results are the widened weights' up to
summation order.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hpcpipe.kernels.formats import RowWeight

WIDEN_ROWS = 32          # rows of x from which a GPU row product widens the weight (see RowProduct.__init__)


class RowProduct:
    """A (out, in) row weight on the ``xp`` backend, multiplied from the left as an (in, out) matrix: ``x @ it``."""

    # NumPy's and CuPy's ``x @ self`` return NotImplemented for an operand that opts out of ufuncs, so Python calls
    # __rmatmul__ (NEP 13; cupy/_core/core.pyx: _should_use_rop)
    __array_ufunc__ = None
    __array_priority__ = 1000
    ndim = 2
    dtype = np.dtype(np.float32)

    def __init__(self, weight: RowWeight, xp: Any, widen_from: int | None = None):
        if not isinstance(weight, RowWeight):
            raise TypeError(f"row product: expected a RowWeight, got {type(weight).__name__}")
        self.xp = xp
        # from this many rows of x the weight is widened for the call and multiplied by xp's matmul (cuBLAS): the
        # GPU kernel reads a weight once per 8 rows of x, the widening about five times its bytes once (read,
        # write and read float32), so a prefill or a large decode batch is cheaper widened. 32 is that estimate,
        # not a measurement (no GPU lease yet). The CPU's compiled product has its own many-row path: never.
        self.widen_from = widen_from if widen_from is not None else (None if xp is np else WIDEN_ROWS)
        if xp is np:
            from hpcpipe.kernels import cpu
            if cpu.library() is None:
                raise RuntimeError("row product: the compiled CPU kernels are not built (install with a C compiler)")
            self.weight, self._matmul = weight, cpu.matmul
        else:
            from hpcpipe.kernels import cuda
            self.weight, self._matmul = cuda.to_device(weight), cuda.matmul

    @property
    def shape(self) -> tuple[int, int]:
        """(in, out): the layer's matrix it stands for."""
        rows, cols = self.weight.shape
        return cols, rows

    @property
    def kind(self) -> str:
        """The stored kind (float32, bfloat16, float16, q8_0)."""
        return self.weight.kind

    @property
    def nbytes(self) -> int:
        """Bytes held on the device (values and scales)."""
        return self.weight.nbytes

    def __rmatmul__(self, x: Any) -> Any:
        cols, rows = self.shape
        if x.shape[-1] != cols:
            raise ValueError(f"row product: input rows of {x.shape[-1]} values for a ({cols}, {rows}) weight")
        lead = x.shape[:-1]
        if not x.size:          # no rows: NumPy gives an empty array zero strides, which the products refuse
            return self.xp.zeros((*lead, rows), dtype=np.float32)
        flat = self.xp.ascontiguousarray(x.reshape(-1, cols), dtype=np.float32)
        if self.weight.kind == "float32" or (self.widen_from is not None and flat.shape[0] >= self.widen_from):
            # float32 values are multiplied as they are by the backend's BLAS; others widened for this call only
            return (flat @ self.weight.dense().T).reshape(*lead, rows)
        return self._matmul(self.weight, flat).reshape(*lead, rows)
