"""hf/safetensors.py: the hand-written reader and writers against the safetensors package and torch, reading only
what is asked for, and every malformed file as a one-line ConfigError naming it."""

import json

import numpy as np
import pytest

from hpcpipe.errors import ConfigError
from hpcpipe.hf.safetensors import (
    INDEX,
    SINGLE,
    SafetensorsFile,
    bfloat16_bits,
    open_tensors,
    write_safetensors,
    write_sharded,
)


def arrays(seed=0):
    rng = np.random.default_rng(seed)
    return {"a.weight": rng.standard_normal((5, 7)).astype(np.float32),
            "b.bias": rng.standard_normal(3).astype(np.float16),
            "c.table": rng.standard_normal((2, 3, 4)),
            "empty": np.zeros((0, 4), np.float32),
            "scalar": np.array(2.5, np.float32)}


def raw_file(path, header, data=b"", header_len=None):
    text = json.dumps(header).encode() if isinstance(header, dict) else header
    path.write_bytes((len(text) if header_len is None else header_len).to_bytes(8, "little") + text + data)
    return path


def failure(path_or_dir, action):
    with pytest.raises(ConfigError) as info:
        action()
    message = str(info.value)
    assert "\n" not in message and str(path_or_dir) in message, message
    return message


def test_written_files_read_back_here_and_in_the_safetensors_package(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    tensors = arrays()
    path = tmp_path / "x.safetensors"
    write_safetensors(path, tensors, {"format": "pt", "note": "hpcpipe"})
    assert int.from_bytes(path.read_bytes()[:8], "little") % 8 == 0
    theirs = st.load_file(str(path))
    f = SafetensorsFile(path)
    assert f.metadata == {"format": "pt", "note": "hpcpipe"}
    for name, value in tensors.items():
        assert theirs[name].dtype == value.dtype and np.array_equal(theirs[name], value)
        mine = f.read(name)
        assert mine.dtype == value.dtype and mine.shape == value.shape and np.array_equal(mine, value)
    assert f.read("c.table", np.float32).dtype == np.float32
    other = tmp_path / "theirs.safetensors"
    st.save_file(tensors, str(other))
    assert all(np.array_equal(SafetensorsFile(other).read(n), v) for n, v in tensors.items())
    assert not list(tmp_path.glob(".*tmp*"))


def test_bfloat16_widens_exactly_and_narrows_as_torch(tmp_path):
    torch = pytest.importorskip("torch")
    st = pytest.importorskip("safetensors.torch")
    values = torch.cat([torch.randn(1000) * 10.0 ** torch.randint(-30, 30, (1000,)),
                        torch.tensor([0.0, -0.0, 1.0, 1.00390625, 1.01171875, 3.4e38, -3.4e38, 1e-40,
                                      float("inf"), float("-inf")])])
    bf = values.to(torch.bfloat16)
    st.save_file({"v": bf}, str(tmp_path / "b.safetensors"))
    widened = SafetensorsFile(tmp_path / "b.safetensors").read("v")
    assert widened.dtype == np.float32 and np.array_equal(widened, bf.float().numpy())
    bits = bfloat16_bits(values.numpy())
    assert np.array_equal(bits, bf.view(torch.int16).numpy().view(np.uint16))
    nan_bits = bfloat16_bits(np.array([np.nan, -np.nan, 1.0], np.float32)).astype(np.uint32) << 16
    assert np.isnan(nan_bits.view(np.float32)).tolist() == [True, True, False]   # NaN stays NaN (torch: 0xFFFF)
    write_safetensors(tmp_path / "w.safetensors", {"v": values.numpy()}, dtype="bfloat16")
    back = st.load_file(str(tmp_path / "w.safetensors"))["v"]
    assert back.dtype == torch.bfloat16 and torch.equal(back, bf)


def test_only_the_asked_tensor_is_read(tmp_path):
    tensors = {f"t{i}": np.full((100, 10), i, np.float32) for i in range(6)}
    names = write_sharded(tmp_path, tensors, max_shard_bytes=8000)
    assert names == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)] + [INDEX]
    index = json.loads((tmp_path / INDEX).read_text())
    assert index["metadata"] == {"total_parameters": 6000, "total_size": 24000}
    assert index["weight_map"]["t3"] == "model-00002-of-00003.safetensors"
    t = open_tensors(tmp_path)
    assert t.opened == [] and t.names() == sorted(tensors)
    assert np.array_equal(t.read("t3"), tensors["t3"])
    assert t.opened == ["model-00002-of-00003.safetensors"] and t.bytes_read == 4000
    assert t.info("t5").shape == (100, 10) and t.bytes_read == 4000
    assert t.opened == ["model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors"]


def test_a_smaller_export_removes_the_old_shards(tmp_path):
    tensors = {f"t{i}": np.ones((100, 10), np.float32) for i in range(6)}
    write_sharded(tmp_path, tensors, max_shard_bytes=8000)
    (tmp_path / "keep.txt").write_text("x")
    assert write_sharded(tmp_path, tensors, max_shard_bytes=10**6) == [SINGLE]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt", SINGLE]
    assert sorted(open_tensors(tmp_path).names()) == sorted(tensors)
    assert len(write_sharded(tmp_path, tensors, max_shard_bytes=5000, dtype="float16")) == 4
    t = open_tensors(tmp_path)
    assert not (tmp_path / SINGLE).exists() and t.read("t0").dtype == np.float16


def test_truncated_files(tmp_path):
    path = tmp_path / SINGLE
    write_safetensors(path, arrays())
    whole = path.read_bytes()
    path.write_bytes(whole[:-3])
    assert "shorter than its header says" in failure(path, lambda: open_tensors(tmp_path))
    path.write_bytes(whole[:20])
    assert "truncated" in failure(path, lambda: open_tensors(tmp_path))
    path.write_bytes(whole[:5])
    assert "truncated" in failure(path, lambda: open_tensors(tmp_path))


@pytest.mark.parametrize("header, data, words", [
    (b"{not json", b"", ["not valid JSON"]),
    (b"[1, 2]", b"", ["must be a JSON object"]),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12), ["'a'", "'b'", "overlap"]),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(8), ["'a'", "16", "8 bytes of data"]),
    ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8), ["'a'", "needs 12 bytes", "span 8"]),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, bytes(8), ["'a'", "[8, 0]"]),
    ({"a": {"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}}, bytes(8), ["'a'", "shape '2'"]),
    ({"a": [1]}, b"", ["'a'", "must be an object"]),
    ({"__metadata__": {"x": 1}}, b"", ["__metadata__"]),
])
def test_malformed_headers(tmp_path, header, data, words):
    path = raw_file(tmp_path / SINGLE, header, data)
    message = failure(path, lambda: open_tensors(tmp_path))
    for word in words:
        assert word in message, message


def test_header_length_beyond_the_file_and_unsupported_dtype(tmp_path):
    path = raw_file(tmp_path / SINGLE, b"{}", header_len=10**6)
    assert "truncated" in failure(path, lambda: open_tensors(tmp_path))
    path = raw_file(tmp_path / SINGLE, {"q": {"dtype": "I8", "shape": [4], "data_offsets": [0, 4]},
                                        "f": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, bytes(8))
    t = open_tensors(tmp_path)
    assert t.read("f").tolist() == [0.0]
    assert "dtype I8" in failure(path, lambda: t.read("q"))
    assert "'nothing'" in failure(path, lambda: t.read("nothing"))


def test_sharded_index_errors(tmp_path):
    tensors = {f"t{i}": np.ones((100, 10), np.float32) for i in range(3)}
    write_sharded(tmp_path, tensors, max_shard_bytes=4000)
    index = tmp_path / INDEX
    doc = json.loads(index.read_text())
    (tmp_path / "model-00002-of-00003.safetensors").unlink()
    message = failure(index, lambda: open_tensors(tmp_path))
    assert "model-00002-of-00003.safetensors" in message and "missing" in message
    index.write_text(json.dumps({**doc, "weight_map": {"t0": "../elsewhere.safetensors"}}))
    assert "not a file name" in failure(index, lambda: open_tensors(tmp_path))
    index.write_text(json.dumps({"metadata": {}}))
    assert "weight_map" in failure(index, lambda: open_tensors(tmp_path))
    index.write_text("{")
    assert "not valid JSON" in failure(index, lambda: open_tensors(tmp_path))
    index.write_text(json.dumps({**doc, "weight_map": {**doc["weight_map"], "t1": "model-00001-of-00003.safetensors"}}))
    (tmp_path / "model-00002-of-00003.safetensors").write_bytes(b"")
    t = open_tensors(tmp_path)
    message = failure(index, lambda: t.read("t1"))
    assert "'t1'" in message and "model-00001-of-00003.safetensors" in message
    assert "'t9'" in failure(index, lambda: t.read("t9"))


def test_a_directory_without_safetensors(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    message = failure(tmp_path, lambda: open_tensors(tmp_path))
    assert "pytorch_model.bin" in message


def test_writer_refuses_non_float_tensors(tmp_path):
    with pytest.raises(ValueError, match="floating-point"):
        write_safetensors(tmp_path / "x.safetensors", {"i": np.arange(3)})
    assert not list(tmp_path.iterdir())
