"""The compiled CPU kernels against the NumPy reference: products of every weight format at ragged shapes, on the
AVX-512 and the portable paths, and the norms (float32: within 1e-5 of a float64 product of the same values)."""

import shutil

import numpy as np
import pytest

from hpcpipe.kernels import cpu
from hpcpipe.kernels.formats import RowWeight, quantize_q8_0

needs_kernels = pytest.mark.skipif(cpu.library() is None, reason="compiled kernels not built (no C compiler)")


@pytest.fixture(params=["vector", "portable"])
def paths(request):
    if request.param == "vector" and cpu.vector_paths() != "avx512":
        pytest.skip("this CPU has no AVX-512: the portable paths are the only ones")
    int8 = cpu.int8_activations()
    cpu.use_portable(request.param == "portable")
    cpu.int8_activations(False)      # q8_0 times float activations here; test_q8_int8.py checks the int8 path
    yield request.param
    cpu.use_portable(False)
    cpu.int8_activations(int8)


def test_the_kernels_are_built_wherever_a_compiler_is():
    # CI has a C compiler: the compiled path must be what its tests exercise, not silently the NumPy one
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on this machine")
    assert cpu.library() is not None


def _weight(kind, w):
    if kind == "float32":
        return RowWeight("float32", w)
    if kind == "bfloat16":
        return RowWeight("bfloat16", (w.view(np.uint32) >> 16).astype(np.uint16))
    if kind == "float16":
        return RowWeight("float16", w.astype(np.float16).view(np.uint16))
    return quantize_q8_0(w)


@needs_kernels
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "float16", "q8_0"])
@pytest.mark.parametrize("m", [1, 2, 4, 5, 9, 33])
def test_products_equal_the_reference_at_ragged_shapes(paths, kind, m):
    rng = np.random.default_rng(m)
    for n, k in ((1, 32), (3, 15), (4, 16), (8, 17), (9, 64), (33, 100), (13, 576), (70, 96)):
        if kind == "q8_0" and k % 32:
            continue
        rw = _weight(kind, rng.standard_normal((n, k)).astype(np.float32))
        x = rng.standard_normal((m, k)).astype(np.float32)
        want = x.astype(np.float64) @ rw.dense(np.float64).T
        scale = np.abs(x).astype(np.float64) @ np.abs(rw.dense(np.float64)).T
        got = cpu.matmul(rw, x)
        assert np.all(np.abs(got - want) <= 1e-5 * scale + 1e-30), (kind, m, n, k)
        base = rng.standard_normal((m, n)).astype(np.float32)
        added = cpu.matmul(rw, x, base.copy(), accumulate=True)
        np.testing.assert_allclose(added, base + got, rtol=1e-6, atol=1e-6)


@needs_kernels
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "float16", "q8_0"])
def test_a_rows_product_is_the_same_whichever_row_tile_computes_it(paths, kind):
    # a row alone (m = 1), in a 4 x 4 tile, or left over beside one: bit for bit the same outputs, so below the
    # switch to the panel product (64 rows) a decode row's logits do not depend on which others share its step
    rng = np.random.default_rng(5)
    for n, k in ((13, 576), (9, 100), (4, 32)):
        if kind == "q8_0" and k % 32:
            continue
        rw = _weight(kind, rng.standard_normal((n, k)).astype(np.float32))
        x = rng.standard_normal((7, k)).astype(np.float32)
        together = cpu.matmul(rw, x)
        for r in range(7):
            np.testing.assert_array_equal(cpu.matmul(rw, x[r:r + 1])[0], together[r], err_msg=f"{kind} {n}x{k}")
        np.testing.assert_array_equal(cpu.matmul(rw, x[2:7]), together[2:7])
        base = rng.standard_normal((7, n)).astype(np.float32)
        added = cpu.matmul(rw, x, base.copy(), accumulate=True)
        for r in (0, 5):
            np.testing.assert_array_equal(cpu.matmul(rw, x[r:r + 1], base[r:r + 1].copy(), accumulate=True)[0],
                                          added[r])


@needs_kernels
def test_products_read_strided_rows_and_write_into_wider_outputs(paths):
    rng = np.random.default_rng(7)
    rw = _weight("bfloat16", rng.standard_normal((6, 48)).astype(np.float32))
    x = rng.standard_normal((5, 80)).astype(np.float32)[:, 16:64]      # rows 80 apart
    out = np.zeros((5, 10), np.float32)[:, 2:8]
    cpu.matmul(rw, x, out)
    np.testing.assert_allclose(out, x @ rw.dense().T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="expected float32 rows of 48"):
        cpu.matmul(rw, x.astype(np.float64))


@needs_kernels
def test_norms_equal_the_layers(paths):
    from hpcpipe.nn.core.norms import LayerNorm, RMSNorm
    rng = np.random.default_rng(3)
    for d in (1, 7, 16, 33, 576):
        x = rng.standard_normal((5, d)).astype(np.float32) * 3
        w, b = (rng.standard_normal(d).astype(np.float32) for _ in range(2))
        ref = RMSNorm(w, None, 1e-6, np).forward(x)[0]
        np.testing.assert_allclose(cpu.rms_norm(x, w, 1e-6), ref, rtol=1e-5, atol=1e-6)
        ref = LayerNorm(w, b, None, None, np).forward(x)[0]
        np.testing.assert_allclose(cpu.layer_norm(x, w, b, 1e-5), ref, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_an_overflowing_row_behaves_as_in_numpy(paths):
    # float32 sums, as NumPy's: a row of 3e38 overflows on both paths alike (LayerNorm: NaN, RMSNorm: 0), so a
    # poisoned sequence fails (or not) the same way whichever path computes it
    from hpcpipe.nn.core.norms import LayerNorm, RMSNorm
    x = np.full((2, 16), 3e38, np.float32)
    x[1] = 1.0
    ones, zeros = np.ones(16, np.float32), np.zeros(16, np.float32)
    with np.errstate(all="ignore"):
        for got, ref in ((cpu.layer_norm(x, ones, zeros, 1e-5), LayerNorm(ones, zeros, None, None, np).forward(x)[0]),
                         (cpu.rms_norm(x, ones, 1e-5), RMSNorm(ones, None, 1e-5, np).forward(x)[0])):
            np.testing.assert_array_equal(np.isfinite(got), np.isfinite(ref))
            np.testing.assert_allclose(got[np.isfinite(ref)], ref[np.isfinite(ref)], rtol=1e-6)
    assert not np.isfinite(cpu.layer_norm(x, ones, zeros, 1e-5)[0]).any()
