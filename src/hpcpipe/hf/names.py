"""Hugging Face tensor names <-> hpcpipe layer groups, both ways, through each kind's name map.

Each kind lists the tensors of each layer group (``nn/<kind>/hf.py``: :class:`hpcpipe.hf.pieces.Piece`);
here they are checked, read (only the groups a rank asks for, converted to hpcpipe's (in, out) layout) and
written. Group 0 is the embedding, groups 1..n_blocks the blocks (HF layer i - 1), group n_blocks + 1 the
final norm and, when untied, ``head/weight`` (HF ``lm_head.weight``). The base-model prefix (``transformer.``
/ ``model.``) is taken from the file's names, present or not.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hpcpipe.errors import ConfigError
from hpcpipe.hf.config import HFModel
from hpcpipe.hf.pieces import HEAD, Piece, param_shapes
from hpcpipe.hf.quantized_read import KINDS as HALF
from hpcpipe.hf.quantized_read import read_quantized
from hpcpipe.hf.safetensors import TensorFiles
from hpcpipe.hf.safetensors_part import read_part
from hpcpipe.kernels.formats import RowWeight, row_weight
from hpcpipe.nn.registry import KINDS


def group_pieces(kind: str, model_keys: dict[str, Any], index: int) -> list[Piece]:
    """Return the HF tensors that make hpcpipe layer group ``index`` of a model of ``kind``."""
    hf = _hf_map(kind)
    n_groups = model_keys["n_blocks"] + 2
    if not 0 <= index < n_groups:
        raise ValueError(f"hf names: layer group {index} out of range 0..{n_groups - 1}")
    return hf.pieces(model_keys, index)


def _hf_map(kind: str) -> Any:
    """The Hugging Face map of a kind; ValueError for a kind that has none."""
    found = KINDS.get(kind)
    if found is None or found.hf is None:
        raise ValueError(f"hf names: no Hugging Face form for kind {kind!r}; kinds that have one: "
                         f"{', '.join(name for name, k in KINDS.items() if k.hf is not None)}")
    return found.hf


def detect_prefix(kind: str, names: list[str]) -> str:
    """Return the base-model prefix the file's names carry ('transformer.' / 'model.') or '' when they carry none."""
    prefix = _hf_map(kind).prefix
    return prefix if any(name.startswith(prefix) for name in names) else ""


def full_name(piece_hf: str, prefix: str) -> str:
    """Return the name in the file: the prefix added, except to lm_head (outside the base model)."""
    return piece_hf if piece_hf == HEAD else prefix + piece_hf


def check_names(hf: HFModel, tensors: TensorFiles) -> str:
    """Check from the names alone that the files hold every tensor of the model; return the prefix.

    Needs no shard's data or header, so every rank can run it and fail the same way before reading.
    """
    names = tensors.names()
    prefix = detect_prefix(hf.kind, names)
    source = str(tensors.source)
    if not hf.model["tie_embeddings"] and HEAD not in tensors:
        raise ConfigError(f"{source!r} holds no {HEAD} but {str(hf.directory / 'config.json')!r} says "
                          f"tie_word_embeddings false (an untied output head)")
    for index in range(hf.n_groups):
        for piece in group_pieces(hf.kind, hf.model, index):
            name = full_name(piece.hf, prefix)
            if name not in tensors:
                raise ConfigError(f"{source!r} holds no tensor {name!r} (hpcpipe layer group {index}, {piece.name})")
    return prefix


def _non_finite(value: np.ndarray, block: int = 1 << 22) -> int:
    """Return how many values are NaN or Inf, checking a block at a time (no full-size temporary)."""
    flat = value.reshape(-1)
    return sum(int(flat[i:i + block].size - np.count_nonzero(np.isfinite(flat[i:i + block])))
               for i in range(0, flat.size, block))


def read_groups(hf: HFModel, tensors: TensorFiles, indices, dtype: Any = np.float32,
                skip: tuple[str, ...] = (), shards: Any = None, stored: bool = False,
                quantize: bool = False) -> dict[int, dict[str, Any]]:
    """Return {group: {hpcpipe name: array (in, out)}} of the given layer groups, read from only their tensors.

    Each tensor's shape is checked against the config (one-line ConfigError naming tensor, file, got and
    expected shapes) and its values must be finite; arrays come back in ``dtype``, C-contiguous. Parameters
    named in ``skip`` are left out (read another way by the caller). ``shards(index, names)`` (tensor
    parallelism: {name: hpcpipe.nn.core.sharding.Shard}) makes each tensor come back as the rank's part only,
    read without the rest. ``stored`` (whole tensors only): matrices come back as they are stored, as (out, in)
    :class:`hpcpipe.kernels.formats.RowWeight` (a 16-bit matrix in its own bits: no widened copy); with
    ``quantize`` each is made q8_0 right after it is read, so the stage never holds the stored model whole.
    """
    prefix = check_names(hf, tensors)
    out: dict[int, dict[str, Any]] = {}
    for index in indices:
        arrays = {}
        pieces = group_pieces(hf.kind, hf.model, index)
        shapes = param_shapes(pieces)
        cut = shards(index, list(shapes)) if shards is not None else {}
        for piece in pieces:
            if piece.name in skip:
                continue
            name = full_name(piece.hf, prefix)
            info = tensors.info(name)
            if info.shape != piece.hf_shape:
                raise ConfigError(f"tensor {name!r} in {str(info.path)!r} has shape {info.shape}, the config "
                                  f"needs {piece.hf_shape}")
            part = cut.get(piece.name)
            if piece.stack is not None:          # one expert's tensor: a slice of the block's (E, ...) array
                held = _held_experts(shapes[piece.name][0], part)
                if piece.stack not in held:      # expert parallelism: another rank's expert, never read here
                    continue
                value = tensors.read(name, dtype, transpose=piece.transpose)
                bad = _non_finite(value)
                stacked = arrays.setdefault(piece.name, np.empty((len(held), *piece.shape), dtype=value.dtype))
                stacked[held.index(piece.stack)] = value
                if bad:
                    raise ConfigError(f"tensor {name!r} in {str(info.path)!r} holds {bad} non-finite value(s)")
                continue
            if stored and quantize and shards is None and info.dtype in HALF and len(info.shape) == 2 \
                    and info.shape[1] % 32 == 0 and (piece.transpose or piece.name == "tok_emb"):
                value, bad = read_quantized(tensors.holder(name), name)    # (out, in) as stored: rows at a time
            elif stored and shards is None and len(piece.shape) == 2 and piece.name != "pos_emb":
                value = _stored_rows(tensors, name, info.dtype, piece)
                bad = value.non_finite()
                if quantize and not bad:
                    value = row_weight(value, "q8_0")
            elif part is not None and part.axis is not None:
                value = read_part(tensors.holder(name), name, dtype, piece.transpose, part.axis, part.index)
                bad = _non_finite(value)
            else:
                value = tensors.read(name, dtype, transpose=piece.transpose)
                bad = _non_finite(value)
            if bad:
                raise ConfigError(f"tensor {name!r} in {str(info.path)!r} holds {bad} non-finite value(s) "
                                  f"(NaN or Inf{' after conversion to ' + np.dtype(dtype).name if dtype else ''})")
            arrays[piece.name] = value
        for hf_name in _hf_map(hf.kind).zero_only(hf.model, index):
            name = prefix + hf_name
            if name in tensors and np.any(tensors.read(name, np.float32)):
                raise ConfigError(f"tensor {name!r} in {str(tensors.file_of(name))!r} is not zero; hpcpipe's "
                                  f"llama kind has biases on q, k and v only (attention_bias also biases o_proj)")
        out[index] = arrays
    return out


def _held_experts(n: int, part: Any) -> range:
    """The experts of a stacked (E, ...) parameter a rank reads: all, or the contiguous ones its shard names."""
    if part is None or part.axis is None:
        return range(n)
    if part.axis != 0 or not isinstance(part.index, slice):
        raise ValueError(f"stacked experts are cut by whole experts (axis 0, a slice), not {part!r}")
    return range(n)[part.index]


def _stored_rows(tensors: TensorFiles, name: str, stored: str, piece: Piece) -> RowWeight:
    """A matrix as the file stores it, in (out, in) rows: nn.Linear's layout as it is, an embedding table (vocab,
    d) as it is (a tied head's rows), GPT-2's Conv1D (in, out) transposed once."""
    kind = {"BF16": "bfloat16", "F16": "float16"}.get(stored, "float32")
    flip = not piece.transpose and piece.name != "tok_emb"
    if kind == "float32":
        return RowWeight(kind, tensors.read(name, np.float32, transpose=flip))
    bits = tensors.read(name, np.uint16)       # the 16-bit values' own bits, as stored
    return RowWeight(kind, np.ascontiguousarray(bits.T) if flip else bits)


def hf_state(kind: str, model_keys: dict[str, Any], groups: dict[int, dict[str, Any]]) -> dict[str, np.ndarray]:
    """Return {HF tensor name: array in HF layout} of hpcpipe layer groups (all groups for a whole model).

    Names carry transformers' prefixes (``transformer.`` / ``model.``); a tied model has no lm_head.weight.
    """
    out: dict[str, np.ndarray] = {}
    for index, arrays in sorted(groups.items()):
        pieces = group_pieces(kind, model_keys, index)
        shapes = param_shapes(pieces)
        expected = set(shapes)
        if set(arrays) != expected:
            raise ConfigError(f"layer group {index} holds {sorted(arrays)}, the {kind} model needs "
                              f"{sorted(expected)}")
        for piece in pieces:
            value = np.asarray(arrays[piece.name])
            if value.shape != shapes[piece.name]:
                raise ConfigError(f"layer group {index}: {piece.name} has shape {value.shape}, the model needs "
                                  f"{shapes[piece.name]}")
            if piece.stack is not None:
                value = value[piece.stack]
            out[full_name(piece.hf, _hf_map(kind).prefix)] = np.ascontiguousarray(value.T) if piece.transpose else value
    return out


def hf_config_dict(kind: str, model_keys: dict[str, Any], dtype: str = "float32",
                   eos_ids: tuple[int, ...] | list[int] = (), bos_id: int | None = None) -> dict[str, Any]:
    """Return the config.json of a model, as transformers 5.x writes and loads it (AutoModelForCausalLM)."""
    eos = list(eos_ids)
    special = {"bos_token_id": bos_id, "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
               "pad_token_id": None, "dtype": dtype, "tie_word_embeddings": bool(model_keys["tie_embeddings"]),
               "use_cache": True}
    return _hf_map(kind).config_json(model_keys, special)
