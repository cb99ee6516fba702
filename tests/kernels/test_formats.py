"""Weight formats (hpcpipe.kernels.formats): 16-bit bits widened exactly, q8_0 as GGUF quantizes, rows and checks."""

import numpy as np
import pytest

from hpcpipe.kernels.formats import (
    RowWeight,
    inference_format,
    kept_values,
    quantize_q8_0,
    row_weight,
    stacked,
    widen_bf16,
)


def _bf16_bits(values):
    return (np.asarray(values, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


def test_bfloat16_and_float16_bits_widen_exactly():
    values = np.array([[1.0, -2.5, 3.140625, 0.0], [-0.0, 65504.0, 1e-3, -7.75]], dtype=np.float32)
    bits = _bf16_bits(values)
    np.testing.assert_array_equal(widen_bf16(bits), bits.astype(np.uint32).__lshift__(16).view(np.float32))
    assert RowWeight("bfloat16", bits).dense()[0, 1] == -2.5
    half = values.astype(np.float16)
    np.testing.assert_array_equal(RowWeight("float16", half.view(np.uint16)).dense(), half.astype(np.float32))


def _gguf_q8_0(w):
    """llama.cpp's quantize_row_q8_0_ref, written out block by block in Python floats."""
    rows, cols = w.shape
    q, d = np.zeros((rows, cols), np.int8), np.zeros((rows, cols // 32), np.float16)
    for r in range(rows):
        for b in range(cols // 32):
            block = w[r, b * 32:(b + 1) * 32].astype(np.float32)
            amax = np.float32(np.abs(block).max())
            scale = np.float32(amax / np.float32(127))
            inv = np.float32(1.0) / scale if scale else np.float32(0.0)
            d[r, b] = np.float16(scale)
            for j, x in enumerate(block):
                v = float(np.float32(x * inv))
                q[r, b * 32 + j] = int(np.sign(v) * np.floor(abs(v) + 0.5))
    return q, d


def test_q8_0_quantizes_as_gguf():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((5, 96)) * rng.uniform(0.01, 3, (5, 1))).astype(np.float32)
    w[2, 32:64] = 0.0                                       # an all-zero block: scale 0, values 0
    w[3, 5] = 0.5 * np.abs(w[3, :32]).max()                 # halfway cases round away from zero as roundf
    got = quantize_q8_0(w)
    q, d = _gguf_q8_0(w)
    np.testing.assert_array_equal(got.data, q)
    np.testing.assert_array_equal(got.scales, d.view(np.uint16))
    err = np.abs(got.dense() - w).max() / np.abs(w).max()
    assert 0 < err < 1 / 127                                # at most half a step of each block's scale
    assert got.nbytes == w.size + 2 * w.size // 32          # 1.0625 bytes a weight


def test_q8_0_needs_whole_blocks_and_row_weight_keeps_other_widths():
    with pytest.raises(ValueError, match="input width 40 is not a multiple of 32"):
        quantize_q8_0(np.ones((2, 40), np.float32))
    narrow, wide = np.ones((40, 3), np.float32), np.ones((64, 3), np.float32)      # (in, out)
    assert row_weight(narrow, "q8_0").kind == "float32" and row_weight(wide, "q8_0").kind == "q8_0"
    assert row_weight(wide, "q8_0").shape == (3, 64)


def test_row_weights_check_their_arrays():
    with pytest.raises(ValueError, match="kind must be one of"):
        RowWeight("int4", np.zeros((2, 2), np.int8))
    with pytest.raises(ValueError, match="C-contiguous 2-D uint16"):
        RowWeight("bfloat16", np.zeros((2, 2), np.float32))
    with pytest.raises(ValueError, match="q8_0 needs"):
        RowWeight("q8_0", np.zeros((2, 32), np.int8), np.zeros((2, 2), np.uint16))


def test_rows_stacking_gathering_and_non_finite_counts():
    rng = np.random.default_rng(1)
    a, b = (quantize_q8_0(rng.standard_normal((n, 64)).astype(np.float32)) for n in (3, 5))
    both = stacked([a, b])
    assert both.shape == (8, 64)
    np.testing.assert_array_equal(both.dense()[3:], b.dense())
    np.testing.assert_array_equal(both.rows_at(np.array([4, 0])), both.dense()[[4, 0]])
    with pytest.raises(ValueError, match="differ"):
        stacked([a, RowWeight("float32", np.zeros((2, 64), np.float32))])
    bits = _bf16_bits([[1.0, np.inf, np.nan, -2.0]])
    assert RowWeight("bfloat16", bits).non_finite() == 2
    assert RowWeight("float32", np.array([[1.0, np.nan]], np.float32)).non_finite() == 1


def test_kept_values_and_the_inference_default():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((64, 7)).astype(np.float32)     # (in, out)
    assert kept_values("attn/o/weight", w, "stored") is w
    kept = kept_values("attn/o/weight", w, "q8_0")
    assert kept.shape == w.shape and np.array_equal(kept, quantize_q8_0(w.T.copy()).dense().T)
    pos = rng.standard_normal((8, 64))
    assert kept_values("pos_emb", pos, "q8_0") is pos
    # "auto": as stored where the compiled stage runs (its results are float32's on the same weights), float32 else
    assert inference_format("auto") == "stored" and inference_format("auto", compiled=False) == "float32"
    assert inference_format("q8_0") == "q8_0" and inference_format("float32", compiled=True) == "float32"


def test_q8_0_quantizes_chunk_by_chunk_as_gguf():
    # 2100 rows of 32: the quantizer's scratch holds 2048 rows, so a second, ragged chunk reuses it
    rng = np.random.default_rng(5)
    w = (rng.standard_normal((2100, 32)) * rng.uniform(0.01, 3, (2100, 1))).astype(np.float32)
    w[2050] = 0.0
    q, d = _gguf_q8_0(w)
    for got in (quantize_q8_0(w), quantize_q8_0(w.shape, lambda start, stop, out: out.__setitem__(
            Ellipsis, w[start:stop]))):
        np.testing.assert_array_equal(got.data, q)
        np.testing.assert_array_equal(got.scales, d.view(np.uint16))


@pytest.mark.parametrize("kind", ["bfloat16", "float16"])
def test_q8_0_of_16_bit_rows_is_q8_0_of_their_values(kind):
    rng = np.random.default_rng(6)
    w = rng.standard_normal((2100, 64)).astype(np.float32)
    bits = _bf16_bits(w) if kind == "bfloat16" else w.astype(np.float16).view(np.uint16)
    stored = RowWeight(kind, bits)
    got, want = row_weight(stored, "q8_0"), quantize_q8_0(stored.dense())
    np.testing.assert_array_equal(got.data, want.data)
    np.testing.assert_array_equal(got.scales, want.scales)
