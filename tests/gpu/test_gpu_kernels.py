"""The weight products on the GPU (hpcpipe.kernels.cuda) equal the NumPy reference (x @ W.dense().T) for every
row-weight kind at ragged shapes (rows of x not a multiple of the eight a warp takes at once, widths not a
multiple of a warp's 32 lanes), accumulating too. A rehearsal (no GPU) runs the same checks on the compiled CPU
kernels, which share the interface."""

import numpy as np
import pytest
from support.gpu import device_backend

from hpcpipe.kernels.formats import RowWeight, quantize_q8_0

pytestmark = pytest.mark.gpu


def _weights(rng, rows, cols):
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    out = {"float32": RowWeight("float32", w),
           "bfloat16": RowWeight("bfloat16", np.ascontiguousarray((w.view(np.uint32) >> 16).astype(np.uint16))),
           "float16": RowWeight("float16", w.astype(np.float16).view(np.uint16))}
    if cols % 32 == 0:
        out["q8_0"] = quantize_q8_0(w)
    return out


def _product(backend):
    if backend == "cupy":
        import cupy

        from hpcpipe.kernels import cuda

        def run(w, x, out=None, accumulate=False):
            dev_out = None if out is None else cupy.asarray(out)
            got = cuda.matmul(cuda.to_device(w), cupy.asarray(x), dev_out, accumulate)
            return cupy.asnumpy(got)
        return run
    from hpcpipe.kernels import cpu
    if cpu.library() is None:
        pytest.skip("rehearsal: the compiled CPU kernels are not built")

    def rehearse(w, x, out=None, accumulate=False):
        # the GPU kernels multiply float activations; the CPU's q8_0 default (int8 ones, VNNI) is not exact
        before = cpu.int8_activations()
        cpu.int8_activations(False)
        try:
            return cpu.matmul(w, x, out, accumulate)
        finally:
            cpu.int8_activations(before)
    return rehearse


@pytest.mark.parametrize("rows,cols", [(1, 32), (37, 96), (129, 576), (8, 45)])
@pytest.mark.parametrize("m", [1, 3, 8, 17])
def test_products_equal_numpy(rows, cols, m):
    product = _product(device_backend())
    rng = np.random.default_rng(rows * 1000 + cols + m)
    x = rng.standard_normal((m, cols)).astype(np.float32)
    for kind, w in _weights(rng, rows, cols).items():
        want = x.astype(np.float64) @ w.dense(np.float64).T
        got = product(w, x)
        scale = np.abs(want).max()
        assert np.abs(got - want).max() <= 1e-5 * scale * np.sqrt(cols), (kind, rows, cols, m)
        base = rng.standard_normal((m, rows)).astype(np.float32)
        again = product(w, x, base.copy(), True)
        assert np.abs(again - (base + want)).max() <= 1e-5 * (scale + np.abs(base).max()) * np.sqrt(cols), kind
