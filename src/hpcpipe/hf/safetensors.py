"""The safetensors format by hand: read only the tensors asked for, write single files and transformers' shards.

A file is an 8-byte little-endian header length N, N bytes of JSON header ``{name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {str: str}}`` (offsets relative to the byte after the header),
then the raw little-endian tensor bytes. A model directory holds one ``model.safetensors`` or shards named by
``model.safetensors.index.json``'s ``weight_map``. Reading opens a shard only when one of its tensors is asked
for and reads just that tensor's byte range (seek + readinto), so a pipeline rank holds its own stage's tensors
only. Every problem is a one-line ConfigError naming the file.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hpcpipe.errors import ConfigError
from hpcpipe.hf.config import read_json_file
from hpcpipe.hf.json_text import JSONTextError, loads
from hpcpipe.hf.model_files import model_file

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
MAX_HEADER = 100_000_000   # the format's own limit
# hpcpipe's: a header takes ~100 bytes a tensor (a real shard's is well under 1 MiB), and parsing takes ~14 times
# its size on every rank that opens the file (an 82 MB header cost 1.3 GB a rank; 16 MiB peaks near 220 MB)
HEADER_LIMIT = 16 << 20
CHUNK_BYTES = 32 << 20     # stored bytes read and converted at a time
ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
            "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
READABLE = {"F16": "<f2", "BF16": "<u2", "F32": "<f4", "F64": "<f8"}
WRITABLE = {"float16": "F16", "bfloat16": "BF16", "float32": "F32", "float64": "F64"}
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies: its dtype name, shape and absolute byte range in its file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int
    path: Path


class SafetensorsFile:
    """One .safetensors file, its header read and checked on open; :meth:`read` fetches one tensor's bytes."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.bytes_read = 0
        self.tensors, self.metadata = _read_header(self.path)

    def read(self, name: str, dtype: Any = None, transpose: bool = False) -> np.ndarray:
        """Return tensor ``name`` (float16/bfloat16/float32/float64 on disk) as an array of ``dtype`` (default: as
        stored, bfloat16 widened exactly to float32); ``transpose``: a 2-D tensor comes back transposed, C-contiguous,
        written slice by slice into its place (no second full-size copy)."""
        info = self.tensors.get(name)
        if info is None:
            raise ConfigError(f"safetensors file {str(self.path)!r} holds no tensor {name!r}")
        if info.dtype not in READABLE:
            raise ConfigError(f"safetensors file {str(self.path)!r}: tensor {name!r} has dtype {info.dtype}, which "
                              f"hpcpipe does not read (supported: {', '.join(READABLE)})")
        stored = np.dtype(READABLE[info.dtype])
        natural = np.dtype(np.float32) if info.dtype == "BF16" else stored.newbyteorder("=")
        if transpose and len(info.shape) != 2:
            raise ValueError(f"safetensors: only a 2-D tensor can be read transposed, {name!r} has shape {info.shape}")
        out_dtype = np.dtype(dtype) if dtype is not None else natural
        out = np.empty(info.shape[::-1] if transpose else info.shape, dtype=out_dtype)
        # transposed: each slice is whole stored rows, converted in a scratch and written into out's columns
        scratch = np.empty(0, dtype=out_dtype)
        flat = scratch if transpose else out.reshape(-1)
        size = out.size
        row = info.shape[1] if transpose else 1
        # the stored bytes as they are: the same dtype, or a 16-bit float's bits asked for as uint16
        raw_bits = out.dtype == np.uint16 and info.dtype in ("BF16", "F16")
        direct = (raw_bits or (info.dtype != "BF16" and stored == out.dtype)) and not transpose
        # read in slices converted into the result as they come: the peak is the result plus one slice, not
        # the stored tensor, its widened copy and the result (a 128k x 2048 bfloat16 table: 1 GiB + 32 MiB)
        step = max(row, CHUNK_BYTES // stored.itemsize // row * row)
        buffer = None if direct else np.empty(min(step, size) * stored.itemsize, dtype=np.uint8)
        if transpose:
            scratch = np.empty(min(step, size), dtype=out_dtype)
        got = 0
        try:
            with open(self.path, "rb", buffering=0) as f:
                f.seek(info.begin)
                for start in range(0, size, step):
                    stop = min(start + step, size)
                    target = flat[start:stop].view(np.uint8) if direct else buffer[:(stop - start) * stored.itemsize]
                    n = _read_into(f, memoryview(target))
                    got += n
                    if n != target.size:
                        break
                    if direct:
                        continue
                    piece = target.view(stored)
                    dest = scratch[:stop - start] if transpose else flat[start:stop]
                    if info.dtype == "BF16" and dest.dtype == np.float32:
                        wide = dest.view(np.uint32)   # bfloat16 is the high half of a float32: widen in place
                        wide[...] = piece
                        wide <<= 16
                    elif info.dtype == "BF16":
                        dest[...] = (piece.astype(np.uint32) << 16).view(np.float32)
                    else:
                        dest[...] = piece
                    if transpose:
                        out[:, start // row:stop // row] = dest.reshape(-1, row).T
        except OSError as exc:
            raise ConfigError(f"safetensors file {str(self.path)!r} cannot be read: {exc.strerror or exc}") from None
        self.bytes_read += got
        if got != info.end - info.begin:
            raise ConfigError(f"safetensors file {str(self.path)!r} is truncated: tensor {name!r} needs bytes "
                              f"{info.begin}..{info.end} but the file ended after {info.begin + got}")
        return out


def _read_into(f: Any, view: memoryview) -> int:
    """Fill view from f (one read(2) returns at most ~2 GiB); return the bytes read (fewer at the file's end)."""
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            break
        got += n
    return got


def _read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and check a file's header: JSON, known fields, sizes matching shapes, no overlap, all within the file."""
    label = f"safetensors file {str(path)!r}"
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 0 or size < 8 + n:
                have = max(size - 8, 0)
                raise ConfigError(f"{label} is truncated: {size} bytes, shorter than its header says "
                                  f"({'an 8-byte header length' if n < 0 else f'a {n}-byte header, have {have}'})")
            if n > MAX_HEADER:
                raise ConfigError(f"{label}: its header length {n} is over the format's limit of {MAX_HEADER} bytes")
            if n > HEADER_LIMIT:
                raise ConfigError(f"{label}: its header is {n} bytes, over hpcpipe's limit of {HEADER_LIMIT} (16 MiB; "
                                  f"a header takes ~100 bytes a tensor and real shards' are under 1 MiB): shard the "
                                  f"file (save_pretrained(max_shard_size=...))")
            text = f.read(n)
    except OSError as exc:
        raise ConfigError(f"{label} cannot be read: {exc.strerror or exc}") from None
    try:
        header = loads(text)
    except JSONTextError as exc:
        raise ConfigError(f"{label}: its header {exc}") from None
    if not isinstance(header, dict):
        raise ConfigError(f"{label}: its header must be a JSON object, got {type(header).__name__}")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ConfigError(f"{label}: its header's __metadata__ must map names to strings")
    start, data_len = 8 + n, size - 8 - n
    tensors = {name: _tensor_info(name, entry, label, start, path) for name, entry in header.items()}
    ordered = sorted(tensors.values(), key=lambda t: (t.begin, t.end))
    for a, b in zip(ordered, ordered[1:], strict=False):
        if b.begin < a.end:
            raise ConfigError(f"{label}: the data of tensors {a.name!r} and {b.name!r} overlap (offsets "
                              f"{a.begin - start}..{a.end - start} and {b.begin - start}..{b.end - start})")
    if ordered and ordered[-1].end - start > data_len:
        last = ordered[-1]
        raise ConfigError(f"{label} is shorter than its header says (truncated?): tensor {last.name!r} ends at data "
                          f"byte {last.end - start} but the file holds {data_len} bytes of data")
    return tensors, metadata


def _tensor_info(name: str, entry: Any, label: str, start: int, path: Path) -> TensorInfo:
    """Check one header entry and return its TensorInfo (offsets made absolute)."""
    if not isinstance(entry, dict):
        raise ConfigError(f"{label}: header entry {name!r} must be an object with dtype, shape and data_offsets")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str):
        raise ConfigError(f"{label}: tensor {name!r} has no dtype name (got {dtype!r})")
    if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                              for s in shape):
        raise ConfigError(f"{label}: tensor {name!r} has shape {shape!r}, not a list of sizes")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise ConfigError(f"{label}: tensor {name!r} has data_offsets {offsets!r}, not [begin, end] with "
                          f"0 <= begin <= end")
    if dtype in ITEMSIZE and math.prod(shape) * ITEMSIZE[dtype] != offsets[1] - offsets[0]:
        raise ConfigError(f"{label}: tensor {name!r} ({dtype} {tuple(shape)}) needs "
                          f"{math.prod(shape) * ITEMSIZE[dtype]} bytes but its data_offsets span "
                          f"{offsets[1] - offsets[0]}")
    return TensorInfo(name, dtype, tuple(shape), start + offsets[0], start + offsets[1], path)


class TensorFiles:
    """The tensors of a model directory (one file or shards): names from the index, headers and data on demand.

    ``opened`` lists the files whose header was read, in order, and ``bytes_read`` counts tensor bytes read:
    a rank that asks for its own stage's tensors opens only the shards holding them.
    """

    def __init__(self, directory: Path, weight_map: dict[str, str], source: Path,
                 opened: SafetensorsFile | None = None):
        self.directory, self.weight_map, self.source = directory, weight_map, source
        self._files: dict[str, SafetensorsFile] = {} if opened is None else {opened.path.name: opened}
        self.opened: list[str] = list(self._files)

    @property
    def bytes_read(self) -> int:
        """Tensor bytes read so far, all files together."""
        return sum(f.bytes_read for f in self._files.values())

    def names(self) -> list[str]:
        """Return every tensor name of the model, sorted."""
        return sorted(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def file_of(self, name: str) -> Path:
        """Return the path of the file that holds tensor ``name``; ConfigError if no file does."""
        if name not in self.weight_map:
            raise ConfigError(f"{str(self.source)!r} holds no tensor {name!r}")
        return self.directory / self.weight_map[name]

    def _file(self, name: str) -> SafetensorsFile:
        """Return the open file holding tensor ``name``, reading its header the first time."""
        file_name = self.file_of(name).name
        if file_name not in self._files:
            self._files[file_name] = SafetensorsFile(self.directory / file_name)
            self.opened.append(file_name)
        found = self._files[file_name]
        if name not in found.tensors:
            raise ConfigError(f"{str(self.source)!r} says tensor {name!r} is in {file_name!r}, but that file's header "
                              f"does not hold it")
        return found

    def info(self, name: str) -> TensorInfo:
        """Return tensor ``name``'s dtype, shape and place (reads its file's header, not its data)."""
        return self._file(name).tensors[name]

    def read(self, name: str, dtype: Any = None, transpose: bool = False) -> np.ndarray:
        """Return tensor ``name`` as an array of ``dtype`` (see :meth:`SafetensorsFile.read`)."""
        return self._file(name).read(name, dtype, transpose)

    def holder(self, name: str) -> SafetensorsFile:
        """Return the open file that holds tensor ``name`` (its header read; for partial reads)."""
        return self._file(name)


def open_tensors(directory: str | Path) -> TensorFiles:
    """Return the :class:`TensorFiles` of a model directory: ``model.safetensors`` or the sharded index's files."""
    d = Path(directory)
    single, index = d / SINGLE, d / INDEX
    if model_file(d, SINGLE, "safetensors file") is not None:     # a link out of the directory is refused
        opened = SafetensorsFile(single)
        return TensorFiles(d, dict.fromkeys(opened.tensors, SINGLE), single, opened)
    if not os.path.lexists(index):
        raise ConfigError(f"Hugging Face model directory {str(d)!r} holds neither {SINGLE} nor {INDEX} "
                          f"(hpcpipe reads safetensors weights only, not pytorch_model.bin)")
    doc = read_json_file(index, "safetensors index")
    label = f"safetensors index {str(index)!r}"
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ConfigError(f"{label} has no weight_map object naming each tensor's file")
    for name, file_name in weight_map.items():
        if (not isinstance(file_name, str) or not file_name or "/" in file_name or "\\" in file_name
                or file_name in (".", "..")):
            raise ConfigError(f"{label}: tensor {name!r} is mapped to {file_name!r}, not a file name in the directory")
    for file_name in sorted(set(weight_map.values())):
        if model_file(d, file_name, "safetensors shard") is None:
            raise ConfigError(f"{label} names shard {file_name!r}, which is missing from {str(d)!r}")
    return TensorFiles(d, dict(weight_map), index)


def bfloat16_bits(array: np.ndarray) -> np.ndarray:
    """Return the bfloat16 bit patterns (uint16) of an array, rounded to nearest even as torch does; NaN stays a NaN."""
    array = np.asarray(array, dtype=np.float32, order="C")
    bits = array.view(np.uint32)
    rounded = ((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
    nan = np.isnan(array)
    if nan.any():
        rounded[nan] = ((bits[nan] >> 16) | 0x0040).astype(np.uint16)
    return rounded


def _encoded(array: np.ndarray, dtype: str | None) -> tuple[str, np.ndarray]:
    """Return (safetensors dtype name, little-endian contiguous array to write) of a float array."""
    a = np.asarray(array)
    if a.dtype.kind != "f":
        raise ValueError(f"safetensors: only floating-point tensors are written, got {a.dtype}")
    name = dtype or {2: "float16", 4: "float32", 8: "float64"}.get(a.dtype.itemsize)
    if name not in WRITABLE:
        raise ValueError(f"safetensors: cannot write dtype {name!r} (supported: {', '.join(WRITABLE)})")
    if name == "bfloat16":
        return "BF16", bfloat16_bits(a).astype("<u2", copy=False)
    return WRITABLE[name], np.asarray(a, dtype=READABLE[WRITABLE[name]], order="C")


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None,
                      dtype: str | None = None) -> int:
    """Write tensors as one safetensors file (via a temporary name, fsynced, renamed); return the data bytes.

    ``dtype`` (float32, float16, bfloat16, float64) converts every tensor; None writes each as it is.
    ``metadata`` defaults to ``{"format": "pt"}``, which transformers requires to load the file.
    """
    p = Path(path)
    encoded = {name: _encoded(array, dtype) for name, array in sorted(tensors.items())}
    header: dict[str, Any] = {"__metadata__": dict(metadata if metadata is not None else {"format": "pt"})}
    offset = 0
    for name, (code, data) in encoded.items():
        header[name] = {"dtype": code, "shape": list(data.shape), "data_offsets": [offset, offset + data.nbytes]}
        offset += data.nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(len(text).to_bytes(8, "little"))
            f.write(text)
            for _, data in encoded.values():
                f.write(memoryview(data.reshape(-1)).cast("B"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return offset


def write_sharded(directory: str | Path, tensors: dict[str, np.ndarray], max_shard_bytes: int,
                  metadata: dict[str, str] | None = None, dtype: str | None = None) -> list[str]:
    """Write tensors as transformers does: one ``model.safetensors`` when they fit in max_shard_bytes, else
    ``model-0000i-of-0000n.safetensors`` shards plus ``model.safetensors.index.json``; return the file names.

    Weight files of an earlier export that the new set does not use are removed, so the directory is consistent.
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    total = params = 0
    for name in sorted(tensors):
        a = np.asarray(tensors[name])
        nbytes = a.size * (ITEMSIZE[WRITABLE[dtype]] if dtype in WRITABLE else a.dtype.itemsize)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = a
        size += nbytes
        total += nbytes
        params += a.size
    n = len(shards)
    names = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for file_name, shard in zip(names, shards, strict=True):
        write_safetensors(d / file_name, shard, metadata, dtype)
    if n > 1:
        index = {"metadata": {"total_parameters": params, "total_size": total},
                 "weight_map": {name: file_name for file_name, shard in zip(names, shards, strict=True)
                                for name in shard}}
        tmp = d / f".{INDEX}.tmp-{os.getpid()}"
        tmp.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, d / INDEX)
    written = names + ([INDEX] if n > 1 else [])
    for old in d.iterdir():
        if old.name not in written and (old.name in (SINGLE, INDEX) or _SHARD.fullmatch(old.name)):
            old.unlink()
    return written
