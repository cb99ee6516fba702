"""A tensor-parallel rank reads only its part of a tensor: safetensors parts (rows: only their bytes; columns:
block by block) and HDF5 hyperslabs equal the same part of the whole tensor, for slices and sorted positions,
transposed or not, float32, float16 and bfloat16 (widened exactly)."""

from __future__ import annotations

import numpy as np
import pytest

from hpcpipe.errors import ConfigError
from hpcpipe.hf import safetensors_part
from hpcpipe.hf.safetensors import SafetensorsFile, bfloat16_bits, write_safetensors
from hpcpipe.nn.core.sharding import Shard
from hpcpipe.state.weights import read_layers, read_optimizer, write_weights

PARTS = [(0, slice(2, 5)), (1, slice(0, 3)), (1, np.array([0, 1, 4, 5])), (0, np.array([1, 3, 4]))]


@pytest.fixture
def stored(tmp_path):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 7)).astype(np.float32)
    write_safetensors(tmp_path / "m.safetensors", {"w32": w, "w16": w.astype(np.float16)})
    return tmp_path, w


@pytest.mark.parametrize("axis,index", PARTS)
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("name", ["w32", "w16"])
def test_a_safetensors_part_equals_that_part_of_the_whole(stored, axis, index, transpose, name):
    tmp, _ = stored
    f = SafetensorsFile(tmp / "m.safetensors")
    whole = f.read(name, np.float64, transpose=transpose)
    f.bytes_read = 0
    part = safetensors_part.read_part(f, name, np.float64, transpose, axis, index)
    key = [slice(None)] * 2
    key[axis] = index
    assert part.dtype == np.float64 and part.flags.c_contiguous
    np.testing.assert_array_equal(part, whole[tuple(key)])
    stored_axis = 1 - axis if transpose else axis
    itemsize = 4 if name == "w32" else 2
    if stored_axis == 0:    # whole stored rows: only the part's bytes are read
        assert f.bytes_read == part.size * itemsize
    else:
        assert f.bytes_read == whole.size * itemsize


def test_a_one_dimensional_part_and_bfloat16_widening(tmp_path):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((4, 6)).astype(np.float32)
    path = tmp_path / "bf.safetensors"
    bits = bfloat16_bits(w)
    header_tensors = {"wbf": bits, "bias": w[1].copy()}
    _write_bf16(path, header_tensors)
    f = SafetensorsFile(path)
    whole = f.read("wbf", np.float32, transpose=True)
    part = safetensors_part.read_part(f, "wbf", np.float32, True, 1, slice(1, 3))
    np.testing.assert_array_equal(part, whole[:, 1:3])
    np.testing.assert_array_equal(safetensors_part.read_part(f, "bias", np.float32, False, 0, slice(2, 5)),
                                  w[1, 2:5])


def _write_bf16(path, tensors):
    """A safetensors file with "wbf" stored as BF16 bits and the rest as F32 (by hand: the format is simple)."""
    import json
    header, blobs, offset = {}, [], 0
    for name, value in tensors.items():
        raw = np.ascontiguousarray(value).tobytes()
        header[name] = {"dtype": "BF16" if value.dtype == np.uint16 else "F32", "shape": list(value.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + b"".join(blobs))


def test_hdf5_hyperslabs_equal_the_parts_of_the_whole(tmp_path):
    rng = np.random.default_rng(2)
    groups = {0: {"weight": rng.standard_normal((6, 8)), "bias": rng.standard_normal(8)},
              1: {"weight": rng.standard_normal((8, 4)), "bias": rng.standard_normal(4)}}
    path = tmp_path / "w.h5"
    write_weights(path, groups, n_layers=2)
    cuts = {0: {"weight": Shard(1, np.array([0, 1, 2, 5])), "bias": Shard(0, np.array([0, 1, 2, 5]))},
            1: {"weight": Shard(0, slice(4, 8)), "bias": Shard(None)}}
    got = read_layers(path, [0, 1], lambda i, names: {n: cuts[i][n] for n in names})
    for i, group in groups.items():
        for name, whole in group.items():
            np.testing.assert_array_equal(got[i][name], cuts[i][name].take(whole))
    with pytest.raises(ConfigError, match="no optimizer state"):
        read_optimizer(path, [0], lambda i, names: {})      # a weights file holds no optimizer state
