"""A 16-bit safetensors matrix made q8_0 as it is read (hpcpipe.hf.quantized_read): the same blocks as
quantizing the whole stored matrix, its non-finite values counted, its file's end checked."""

import numpy as np
import pytest

from hpcpipe.errors import ConfigError
from hpcpipe.hf.quantized_read import read_quantized
from hpcpipe.hf.safetensors import SafetensorsFile, write_safetensors
from hpcpipe.kernels.formats import RowWeight, row_weight


@pytest.mark.parametrize("dtype,kind", [("bfloat16", "bfloat16"), ("float16", "float16")])
def test_read_quantized_is_q8_0_of_the_stored_matrix(tmp_path, dtype, kind):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((1500, 96)) * rng.uniform(0.01, 2, (1500, 1))).astype(np.float32)   # 3 chunks
    path = tmp_path / "m.safetensors"
    write_safetensors(path, {"a": rng.standard_normal((3, 5)).astype(np.float32), "w": w}, dtype=dtype)
    f = SafetensorsFile(path)
    got, bad = read_quantized(f, "w")
    want = row_weight(RowWeight(kind, f.read("w", np.uint16)), "q8_0")
    assert bad == 0 and got.kind == "q8_0"
    np.testing.assert_array_equal(got.data, want.data)
    np.testing.assert_array_equal(got.scales, want.scales)


def test_read_quantized_counts_non_finite_values_and_finds_a_short_file(tmp_path):
    w = np.ones((40, 32), dtype=np.float32)
    w[3, 4], w[39, 0] = np.inf, np.nan
    path = tmp_path / "m.safetensors"
    write_safetensors(path, {"w": w}, dtype="bfloat16")
    assert read_quantized(SafetensorsFile(path), "w")[1] == 2
    f = SafetensorsFile(path)
    path.write_bytes(path.read_bytes()[:-64])               # the header still promises the whole matrix
    with pytest.raises(ConfigError, match="truncated"):
        read_quantized(f, "w")
