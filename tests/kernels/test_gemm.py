"""The widened-panel product for many rows (csrc/gemm.c) against the float64 product of the same values, at ragged
shapes: every format, row counts around its 12-row tile, outputs around its 32-wide panel, strided rows,
accumulation; and the switch in hp_matmul (from 64 rows; q8_0 from 32, or 128 with int8 activations) giving the
row tiles' results to float32 rounding."""

import numpy as np
import pytest

from hpcpipe.kernels import cpu
from hpcpipe.kernels.formats import RowWeight, quantize_q8_0

pytestmark = pytest.mark.skipif(cpu.vector_paths() != "avx512",
                                reason="the panel product is an AVX-512 path (kernels not built or no AVX-512)")


@pytest.fixture
def panel_always():
    int8 = cpu.int8_activations()
    cpu.int8_activations(False)            # q8_0 with int8 activations keeps its tiles to twice the switch
    cpu.gemm_rows(1)
    yield
    cpu.gemm_rows(64)
    cpu.int8_activations(int8)


def _weight(kind, w):
    if kind == "float32":
        return RowWeight("float32", w)
    if kind == "bfloat16":
        return RowWeight("bfloat16", (w.view(np.uint32) >> 16).astype(np.uint16))
    if kind == "float16":
        return RowWeight("float16", w.astype(np.float16).view(np.uint16))
    return quantize_q8_0(w)


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "float16", "q8_0"])
@pytest.mark.parametrize("m", [1, 5, 12, 13, 25, 40])
def test_panel_products_equal_the_reference_at_ragged_shapes(panel_always, kind, m):
    rng = np.random.default_rng(m)
    for n, k in ((1, 32), (3, 15), (17, 64), (32, 33), (33, 100), (70, 96), (65, 576), (9, 200), (20, 224)):
        if kind == "q8_0" and k % 32:
            continue
        rw = _weight(kind, rng.standard_normal((n, k)).astype(np.float32))
        x = rng.standard_normal((m, k)).astype(np.float32)
        want = x.astype(np.float64) @ rw.dense(np.float64).T
        scale = np.abs(x).astype(np.float64) @ np.abs(rw.dense(np.float64)).T
        got = cpu.matmul(rw, x)
        assert np.all(np.abs(got - want) <= 1e-5 * scale + 1e-30), (kind, m, n, k)
        base = rng.standard_normal((m, n)).astype(np.float32)
        added = cpu.matmul(rw, x, base.copy(), accumulate=True)        # added block by block: rounding differs
        assert np.all(np.abs(added - (base + want)) <= 1e-5 * (scale + np.abs(base)) + 1e-30), (kind, m, n, k)


def test_panel_products_read_strided_rows_and_write_into_wider_outputs(panel_always):
    rng = np.random.default_rng(7)
    rw = _weight("q8_0", rng.standard_normal((37, 64)).astype(np.float32))
    x = rng.standard_normal((14, 100)).astype(np.float32)[:, 16:80]     # rows 100 apart
    out = np.full((14, 50), 7.0, np.float32)
    cpu.matmul(rw, x, out[:, 5:42])
    np.testing.assert_allclose(out[:, 5:42], x.astype(np.float64) @ rw.dense(np.float64).T, rtol=1e-5, atol=1e-5)
    assert np.all(out[:, :5] == 7.0) and np.all(out[:, 42:] == 7.0)       # nothing written past the outputs


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "q8_0"])
def test_many_rows_take_the_panel_and_agree_with_the_row_tiles(kind):
    rng = np.random.default_rng(11)
    rw = _weight(kind, rng.standard_normal((96, 192)).astype(np.float32))
    x = rng.standard_normal((64, 192)).astype(np.float32)
    int8 = cpu.int8_activations()
    cpu.int8_activations(False)            # the row tiles multiply float activations, as the panel does
    try:
        panel = cpu.matmul(rw, x)                                           # 64 rows: past the default switch
        cpu.gemm_rows(1 << 40)
        tiles = cpu.matmul(rw, x)
    finally:
        cpu.gemm_rows(64)
        cpu.int8_activations(int8)
    scale = np.abs(x) @ np.abs(rw.dense()).T
    assert np.all(np.abs(panel - tiles) <= 1e-5 * scale)
    assert not np.array_equal(panel, tiles)          # another summation order: the switch happened


def test_q8_int8_tiles_run_up_to_twice_the_switch_then_the_panel():
    """With int8 activations q8_0 keeps its VNNI tiles to 127 rows (faster there) and takes the panel from 128."""
    if not cpu.int8_activations():
        pytest.skip("no AVX512-VNNI here: q8_0 multiplies float activations")
    rng = np.random.default_rng(12)
    rw = _weight("q8_0", rng.standard_normal((40, 64)).astype(np.float32))
    for m, panel_expected in ((127, False), (128, True)):
        x = rng.standard_normal((m, 64)).astype(np.float32)
        got = cpu.matmul(rw, x)
        cpu.int8_activations(False)
        try:
            cpu.gemm_rows(1)
            panel = cpu.matmul(rw, x)
        finally:
            cpu.gemm_rows(64)
            cpu.int8_activations(True)
        assert np.array_equal(got, panel) == panel_expected
