"""Hugging Face tensor names <-> hpcpipe layer groups, both ways, for the gpt (GPT-2) and llama kinds.

hpcpipe stores every matrix (in, out) so that ``y = x @ weight``. transformers' ``nn.Linear`` weights are
(out, in) and are transposed; GPT-2's ``Conv1D`` weights are already (in, out), and its ``c_attn`` is q|k|v in
one matrix exactly as hpcpipe's ``attn/qkv``. Llama's q and k are kept in transformers' layout (the
rotate-half RoPE convention), not permuted. Group 0 is the embedding, groups 1..n_blocks the blocks (HF layer
i - 1), group n_blocks + 1 the final norm and, when untied, ``head/weight`` (HF ``lm_head.weight``).
The base-model prefix (``transformer.`` / ``model.``) is taken from the file's names, present or not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hpcpipe.errors import ConfigError
from hpcpipe.hf.config import DEFAULT_RMS_NORM_EPS, GPT_LAYER_NORM_EPS, HFModel
from hpcpipe.hf.safetensors import TensorFiles
from hpcpipe.hf.safetensors_part import read_part

HEAD = "lm_head.weight"
PREFIX = {"gpt": "transformer.", "llama": "model."}


@dataclass(frozen=True)
class Piece:
    """One tensor of a group: its HF name (without the base-model prefix), hpcpipe name and hpcpipe shape."""

    hf: str
    name: str
    shape: tuple[int, ...]
    transpose: bool = False

    @property
    def hf_shape(self) -> tuple[int, ...]:
        """The shape the tensor has in a Hugging Face file."""
        return self.shape[::-1] if self.transpose else self.shape


def _gpt_pieces(m: dict[str, Any], index: int) -> list[Piece]:
    """Return the tensors of gpt layer group ``index``."""
    d, ff, vocab, n = m["d_model"], m["d_ff"] or 4 * m["d_model"], m["vocab_size"], m["n_blocks"]
    if index == 0:
        return [Piece("wte.weight", "tok_emb", (vocab, d)), Piece("wpe.weight", "pos_emb", (m["seq_len"], d))]
    if index <= n:
        h = f"h.{index - 1}."
        return [Piece(h + "ln_1.weight", "ln1/weight", (d,)), Piece(h + "ln_1.bias", "ln1/bias", (d,)),
                Piece(h + "attn.c_attn.weight", "attn/qkv/weight", (d, 3 * d)),
                Piece(h + "attn.c_attn.bias", "attn/qkv/bias", (3 * d,)),
                Piece(h + "attn.c_proj.weight", "attn/proj/weight", (d, d)),
                Piece(h + "attn.c_proj.bias", "attn/proj/bias", (d,)),
                Piece(h + "ln_2.weight", "ln2/weight", (d,)), Piece(h + "ln_2.bias", "ln2/bias", (d,)),
                Piece(h + "mlp.c_fc.weight", "mlp/fc/weight", (d, ff)),
                Piece(h + "mlp.c_fc.bias", "mlp/fc/bias", (ff,)),
                Piece(h + "mlp.c_proj.weight", "mlp/proj/weight", (ff, d)),
                Piece(h + "mlp.c_proj.bias", "mlp/proj/bias", (d,))]
    final = [Piece("ln_f.weight", "ln_f/weight", (d,)), Piece("ln_f.bias", "ln_f/bias", (d,))]
    return final if m["tie_embeddings"] else final + [Piece(HEAD, "head/weight", (d, vocab), True)]


def llama_ff(d_model: int) -> int:
    """The llama kind's MLP width when d_ff is 0 (as hpcpipe.nn.llama_params.default_ff: 2/3 of 4 d, to 256)."""
    return (int(8 * d_model / 3) + 255) // 256 * 256


def _llama_dims(m: dict[str, Any]) -> tuple[int, int, int]:
    """Return (d_ff, head_dim, n_kv_heads) of llama [model] keys, their 0 / absent defaults resolved."""
    return (m["d_ff"] or llama_ff(m["d_model"]), m.get("head_dim") or m["d_model"] // m["n_heads"],
            m.get("n_kv_heads") or m["n_heads"])


def _llama_pieces(m: dict[str, Any], index: int) -> list[Piece]:
    """Return the tensors of llama layer group ``index``."""
    d, vocab, n = m["d_model"], m["vocab_size"], m["n_blocks"]
    ff, hd, n_kv = _llama_dims(m)
    q, kv = m["n_heads"] * hd, n_kv * hd
    if index == 0:
        return [Piece("embed_tokens.weight", "tok_emb", (vocab, d))]
    if index <= n:
        h = f"layers.{index - 1}."
        out = [Piece(h + "input_layernorm.weight", "attn_norm/weight", (d,)),
               Piece(h + "self_attn.q_proj.weight", "attn/q/weight", (d, q), True),
               Piece(h + "self_attn.k_proj.weight", "attn/k/weight", (d, kv), True),
               Piece(h + "self_attn.v_proj.weight", "attn/v/weight", (d, kv), True),
               Piece(h + "self_attn.o_proj.weight", "attn/o/weight", (q, d), True)]
        if m.get("qkv_bias"):
            out += [Piece(h + "self_attn.q_proj.bias", "attn/q/bias", (q,)),
                    Piece(h + "self_attn.k_proj.bias", "attn/k/bias", (kv,)),
                    Piece(h + "self_attn.v_proj.bias", "attn/v/bias", (kv,))]
        return out + [Piece(h + "post_attention_layernorm.weight", "mlp_norm/weight", (d,)),
                      Piece(h + "mlp.gate_proj.weight", "mlp/gate/weight", (d, ff), True),
                      Piece(h + "mlp.up_proj.weight", "mlp/up/weight", (d, ff), True),
                      Piece(h + "mlp.down_proj.weight", "mlp/down/weight", (ff, d), True)]
    final = [Piece("norm.weight", "norm/weight", (d,))]
    return final if m["tie_embeddings"] else final + [Piece(HEAD, "head/weight", (d, vocab), True)]


def group_pieces(kind: str, model_keys: dict[str, Any], index: int) -> list[Piece]:
    """Return the HF tensors that make hpcpipe layer group ``index`` of a gpt or llama model."""
    if kind not in PREFIX:
        raise ValueError(f"hf names: unknown kind {kind!r}; expected gpt or llama")
    n_groups = model_keys["n_blocks"] + 2
    if not 0 <= index < n_groups:
        raise ValueError(f"hf names: layer group {index} out of range 0..{n_groups - 1}")
    return (_gpt_pieces if kind == "gpt" else _llama_pieces)(model_keys, index)


def _zero_only(hf: HFModel, index: int) -> list[str]:
    """Return HF tensors hpcpipe has no place for, accepted only when all zero (Llama's attention_bias o_proj)."""
    if hf.model_type == "llama" and hf.model["qkv_bias"] and 1 <= index <= hf.model["n_blocks"]:
        return [f"layers.{index - 1}.self_attn.o_proj.bias"]
    return []


def detect_prefix(kind: str, names: list[str]) -> str:
    """Return the base-model prefix the file's names carry ('transformer.' / 'model.') or '' when they carry none."""
    prefix = PREFIX[kind]
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
                skip: tuple[str, ...] = (), shards: Any = None) -> dict[int, dict[str, Any]]:
    """Return {group: {hpcpipe name: array (in, out)}} of the given layer groups, read from only their tensors.

    Each tensor's shape is checked against the config (one-line ConfigError naming tensor, file, got and
    expected shapes) and its values must be finite; arrays come back in ``dtype``, C-contiguous. Parameters
    named in ``skip`` are left out (read another way by the caller). ``shards(index, names)`` (tensor
    parallelism: {name: hpcpipe.nn.sharding.Shard}) makes each tensor come back as the rank's part only,
    read without the rest.
    """
    prefix = check_names(hf, tensors)
    out: dict[int, dict[str, Any]] = {}
    for index in indices:
        arrays = {}
        pieces = group_pieces(hf.kind, hf.model, index)
        cut = shards(index, [p.name for p in pieces]) if shards is not None else {}
        for piece in pieces:
            if piece.name in skip:
                continue
            name = full_name(piece.hf, prefix)
            info = tensors.info(name)
            if info.shape != piece.hf_shape:
                raise ConfigError(f"tensor {name!r} in {str(info.path)!r} has shape {info.shape}, the config "
                                  f"needs {piece.hf_shape}")
            part = cut.get(piece.name)
            if part is not None and part.axis is not None:
                value = read_part(tensors.holder(name), name, dtype, piece.transpose, part.axis, part.index)
            else:
                value = tensors.read(name, dtype, transpose=piece.transpose)
            bad = _non_finite(value)
            if bad:
                raise ConfigError(f"tensor {name!r} in {str(info.path)!r} holds {bad} non-finite value(s) "
                                  f"(NaN or Inf{' after conversion to ' + np.dtype(dtype).name if dtype else ''})")
            arrays[piece.name] = value
        for hf_name in _zero_only(hf, index):
            name = prefix + hf_name
            if name in tensors and np.any(tensors.read(name, np.float32)):
                raise ConfigError(f"tensor {name!r} in {str(tensors.file_of(name))!r} is not zero; hpcpipe's "
                                  f"llama kind has biases on q, k and v only (attention_bias also biases o_proj)")
        out[index] = arrays
    return out


def hf_state(kind: str, model_keys: dict[str, Any], groups: dict[int, dict[str, Any]]) -> dict[str, np.ndarray]:
    """Return {HF tensor name: array in HF layout} of hpcpipe layer groups (all groups for a whole model).

    Names carry transformers' prefixes (``transformer.`` / ``model.``); a tied model has no lm_head.weight.
    """
    out: dict[str, np.ndarray] = {}
    for index, arrays in sorted(groups.items()):
        pieces = group_pieces(kind, model_keys, index)
        expected = {p.name for p in pieces}
        if set(arrays) != expected:
            raise ConfigError(f"layer group {index} holds {sorted(arrays)}, the {kind} model needs "
                              f"{sorted(expected)}")
        for piece in pieces:
            value = np.asarray(arrays[piece.name])
            if value.shape != piece.shape:
                raise ConfigError(f"layer group {index}: {piece.name} has shape {value.shape}, the model needs "
                                  f"{piece.shape}")
            out[full_name(piece.hf, PREFIX[kind])] = np.ascontiguousarray(value.T) if piece.transpose else value
    return out


def hf_config_dict(kind: str, model_keys: dict[str, Any], dtype: str = "float32",
                   eos_ids: tuple[int, ...] | list[int] = (), bos_id: int | None = None) -> dict[str, Any]:
    """Return the config.json of a model, as transformers 5.x writes and loads it (AutoModelForCausalLM).

    gpt -> GPT2LMHeadModel (tanh-GELU, LayerNorm eps 1e-5, no dropout). llama -> LlamaForCausalLM, or
    Qwen2ForCausalLM when qkv_bias (Qwen2 biases exactly q, k and v; Llama's attention_bias would add an o_proj
    bias, which hpcpipe's llama kind does not have).
    """
    m = model_keys
    eos = list(eos_ids)
    special = {"bos_token_id": bos_id, "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
               "pad_token_id": None, "dtype": dtype, "tie_word_embeddings": bool(m["tie_embeddings"]),
               "use_cache": True}
    if kind == "gpt":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": m["vocab_size"],
                "n_positions": m["seq_len"], "n_embd": m["d_model"], "n_layer": m["n_blocks"],
                "n_head": m["n_heads"], "n_inner": m["d_ff"] or 4 * m["d_model"],
                "activation_function": "gelu_new", "layer_norm_epsilon": GPT_LAYER_NORM_EPS,
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "summary_first_dropout": 0.0,
                "scale_attn_weights": True, "initializer_range": 0.02, **special}
    if kind != "llama":
        raise ValueError(f"hf names: unknown kind {kind!r}; expected gpt or llama")
    ff, head_dim, n_kv = _llama_dims(m)
    rope = {"rope_type": "default", "rope_theta": float(m["rope_theta"])}
    if m.get("rope_scaling"):
        rope = {**m["rope_scaling"], "rope_theta": float(m["rope_theta"])}
    out = {"vocab_size": m["vocab_size"], "hidden_size": m["d_model"], "intermediate_size": ff,
           "num_hidden_layers": m["n_blocks"], "num_attention_heads": m["n_heads"],
           "num_key_value_heads": n_kv, "head_dim": head_dim,
           "hidden_act": "silu", "max_position_embeddings": m["seq_len"],
           "rms_norm_eps": float(m.get("norm_eps", DEFAULT_RMS_NORM_EPS)), "rope_parameters": rope,
           "attention_dropout": 0.0, "initializer_range": 0.02, **special}
    if m.get("qkv_bias"):
        n = m["n_blocks"]
        return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **out, "use_sliding_window": False,
                "sliding_window": None, "max_window_layers": n, "layer_types": ["full_attention"] * n}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **out, "attention_bias": False,
            "mlp_bias": False}
