"""The llama kind as Hugging Face ``llama``, ``mistral``, ``qwen2`` and ``qwen3`` directories: config.json and names.

transformers' ``nn.Linear`` weights are (out, in) and are transposed; q and k are kept in transformers'
layout (the rotate-half RoPE convention), not permuted. config.json may be written by transformers 4.x
(``rope_theta``, ``rope_scaling``) or 5.x (``rope_parameters``). Anything the llama kind would compute
differently (another activation, rope type, MLP biases, a sliding window shorter than the context) is a
one-line ConfigError naming the file and the value, never a silently different model.
"""

from __future__ import annotations

import math
from typing import Any

from hpcpipe.errors import ConfigError
from hpcpipe.hf.json_fields import flag, number, positive_int
from hpcpipe.hf.pieces import HEAD, Piece
from hpcpipe.nn.kind import HFMap
from hpcpipe.nn.llama.shape import default_ff

ROPE_TYPES = ("default", "linear", "llama3")      # what the llama kind computes; others are refused
DEFAULT_ROPE_THETA = 10000.0
DEFAULT_RMS_NORM_EPS = 1e-6
_ROPE_NEEDS = {"linear": ("factor",),
               "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def keys_of(cfg: dict, label: str, model_type: str) -> dict[str, Any]:
    """Return the llama kind's [model] keys of a llama, mistral, qwen2 or qwen3 config."""
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{label}: hidden_act {act!r} is not supported; hpcpipe's llama kind uses silu (SwiGLU)")
    if cfg.get("mlp_bias", False) is not False:
        raise ConfigError(f"{label}: mlp_bias {cfg['mlp_bias']!r} is not supported; hpcpipe's llama kind has no "
                          f"MLP biases")
    d = positive_int(cfg, "hidden_size", label)
    heads = positive_int(cfg, "num_attention_heads", label)
    kv = positive_int(cfg, "num_key_value_heads", label, heads)
    if heads % kv:
        raise ConfigError(f"{label}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        if d % heads:
            raise ConfigError(f"{label}: hidden_size {d} is not a multiple of num_attention_heads {heads} "
                              f"(and no head_dim is given)")
        head_dim = d // heads
    else:
        head_dim = positive_int(cfg, "head_dim", label)
    if head_dim % 2:
        raise ConfigError(f"{label}: head_dim {head_dim} is odd; RoPE rotates the two halves of each head")
    seq_len = positive_int(cfg, "max_position_embeddings", label)
    n_layers = positive_int(cfg, "num_hidden_layers", label)
    window, sliding = window_of(cfg, label, model_type, seq_len, n_layers)
    if model_type == "qwen2":
        qkv_bias = True
    else:      # Qwen3's attention_bias, as Llama's, also biases o_proj: accepted when that bias is zero
        qkv_bias = flag(cfg, "attention_bias", label, False) if model_type in ("llama", "qwen3") else False
    theta, scaling = rope_of(cfg, label, seq_len)
    return {"vocab_size": positive_int(cfg, "vocab_size", label), "seq_len": seq_len, "d_model": d,
            "n_heads": heads, "n_kv_heads": kv, "n_blocks": n_layers,
            "d_ff": positive_int(cfg, "intermediate_size", label),
            "tie_embeddings": flag(cfg, "tie_word_embeddings", label, False),
            "rope_theta": theta, "rope_scaling": scaling,
            "norm_eps": number(cfg, "rms_norm_eps", label, DEFAULT_RMS_NORM_EPS),
            "qkv_bias": qkv_bias, "head_dim": head_dim, "qk_norm": model_type == "qwen3",
            "sliding_window": window, "sliding_layers": sliding}


def window_of(cfg: dict, label: str, model_type: str, seq_len: int, n_layers: int) -> tuple[int, list[int]]:
    """Return (sliding_window, sliding_layers) of a config: Mistral's window on every layer, Qwen2/3's on the
    layers its layer_types (or max_window_layers) name when use_sliding_window; (0, []) when none is active or
    the window reaches the whole context."""
    window = cfg.get("sliding_window")
    if model_type == "mistral":
        layers = list(range(n_layers)) if window is not None else []
    elif model_type in ("qwen2", "qwen3") and cfg.get("use_sliding_window", False) and window is not None:
        types = cfg.get("layer_types")
        if isinstance(types, list):
            unknown = sorted({t for t in types if t not in ("sliding_attention", "full_attention")}, key=str)
            if unknown or len(types) != n_layers:
                raise ConfigError(f"{label}: layer_types must list 'sliding_attention' or 'full_attention' for each "
                                  f"of the {n_layers} layers, got {types!r}")
            layers = [i for i, t in enumerate(types) if t == "sliding_attention"]
        else:
            first = positive_int(cfg, "max_window_layers", label, 28) if cfg.get("max_window_layers") != 0 else 0
            layers = list(range(first, n_layers))
    else:
        layers = []
    if not layers:
        return 0, []
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ConfigError(f"{label}: sliding_window must be null or a positive integer, got {window!r}")
    if window >= seq_len:           # the whole context fits the window: no position is ever hidden
        return 0, []
    return window, [] if len(layers) == n_layers else layers


def rope_of(cfg: dict, label: str, seq_len: int) -> tuple[float, dict[str, Any] | None]:
    """Return (rope_theta, rope_scaling) of 4.x (rope_theta, rope_scaling) or 5.x (rope_parameters) keys."""
    # a non-empty rope_scaling wins over rope_parameters, as transformers 5.x reads them (Qwen3's model card asks
    # users to add rope_scaling for YaRN to a config.json that a 5.x save gave rope_parameters): taking
    # rope_parameters' default rope then would compute another model, silently
    params, key = cfg.get("rope_scaling"), "rope_scaling"
    if not params:
        params, key = cfg.get("rope_parameters"), "rope_parameters"
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise ConfigError(f"{label}: {key} must be a JSON object or null, got {params!r}")
    nested = [v for v in params.values() if isinstance(v, dict)]
    if nested:   # one dict per layer type: accepted when all are the same
        if any(v != nested[0] for v in nested) or len(nested) != len(params):
            raise ConfigError(f"{label}: {key} differs between layer types ({sorted(params)}); hpcpipe's llama kind "
                              f"uses one rope for every layer")
        params = nested[0]
    params = dict(params)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"{label}: rope type {rope_type!r} ({key}) is not supported (supported: "
                          f"{', '.join(ROPE_TYPES)})")
    theta = params.pop("rope_theta", None)
    if theta is None:
        theta = cfg.get("rope_theta", DEFAULT_ROPE_THETA)
    if not isinstance(theta, int | float) or isinstance(theta, bool) or not math.isfinite(theta) or theta <= 0:
        raise ConfigError(f"{label}: rope_theta must be a positive number, got {theta!r}")
    partial = params.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ConfigError(f"{label}: partial_rotary_factor {partial!r} is not supported (hpcpipe rotates whole heads)")
    if rope_type == "default":
        return float(theta), None
    if rope_type == "llama3":
        params.setdefault("original_max_position_embeddings", seq_len)
    for name in _ROPE_NEEDS[rope_type]:
        value = params.get(name)
        if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
            raise ConfigError(f"{label}: rope type {rope_type!r} needs a positive number {name}, got {value!r}")
    if rope_type == "llama3" and not params["high_freq_factor"] > params["low_freq_factor"]:
        raise ConfigError(f"{label}: rope type 'llama3' needs high_freq_factor ({params['high_freq_factor']!r}) "
                          f"above low_freq_factor ({params['low_freq_factor']!r})")
    return float(theta), {"rope_type": rope_type, **params}


def dims_of(m: dict[str, Any]) -> tuple[int, int, int]:
    """Return (d_ff, head_dim, n_kv_heads) of llama [model] keys, their 0 / absent defaults resolved."""
    return (m["d_ff"] or default_ff(m["d_model"]), m.get("head_dim") or m["d_model"] // m["n_heads"],
            m.get("n_kv_heads") or m["n_heads"])


def pieces(m: dict[str, Any], index: int) -> list[Piece]:
    """Return the tensors of llama layer group ``index``."""
    d, vocab, n = m["d_model"], m["vocab_size"], m["n_blocks"]
    ff, hd, n_kv = dims_of(m)
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
        if m.get("qk_norm"):
            out += [Piece(h + "self_attn.q_norm.weight", "attn/q_norm/weight", (hd,)),
                    Piece(h + "self_attn.k_norm.weight", "attn/k_norm/weight", (hd,))]
        return out + [Piece(h + "post_attention_layernorm.weight", "mlp_norm/weight", (d,)),
                      Piece(h + "mlp.gate_proj.weight", "mlp/gate/weight", (d, ff), True),
                      Piece(h + "mlp.up_proj.weight", "mlp/up/weight", (d, ff), True),
                      Piece(h + "mlp.down_proj.weight", "mlp/down/weight", (ff, d), True)]
    final = [Piece("norm.weight", "norm/weight", (d,))]
    return final if m["tie_embeddings"] else final + [Piece(HEAD, "head/weight", (d, vocab), True)]


def zero_only(m: dict[str, Any], index: int) -> list[str]:
    """HF tensors hpcpipe has no place for, accepted only when all zero (Llama's attention_bias o_proj)."""
    if m.get("qkv_bias") and 1 <= index <= m["n_blocks"]:
        return [f"layers.{index - 1}.self_attn.o_proj.bias"]
    return []


def config_json(m: dict[str, Any], special: dict[str, Any]) -> dict[str, Any]:
    """Return the config.json of a llama-kind model as transformers 5.x writes it: LlamaForCausalLM,
    Qwen2ForCausalLM when qkv_bias (Qwen2 biases exactly q, k and v; Llama's attention_bias would add an o_proj
    bias, which hpcpipe's llama kind does not have), Qwen3ForCausalLM when qk_norm; ``special``: the keys every
    kind writes."""
    ff, head_dim, n_kv = dims_of(m)
    rope = {"rope_type": "default", "rope_theta": float(m["rope_theta"])}
    if m.get("rope_scaling"):
        rope = {**m["rope_scaling"], "rope_theta": float(m["rope_theta"])}
    out = {"vocab_size": m["vocab_size"], "hidden_size": m["d_model"], "intermediate_size": ff,
           "num_hidden_layers": m["n_blocks"], "num_attention_heads": m["n_heads"],
           "num_key_value_heads": n_kv, "head_dim": head_dim,
           "hidden_act": "silu", "max_position_embeddings": m["seq_len"],
           "rms_norm_eps": float(m.get("norm_eps", DEFAULT_RMS_NORM_EPS)), "rope_parameters": rope,
           "attention_dropout": 0.0, "initializer_range": 0.02, **special}
    n, window = m["n_blocks"], m.get("sliding_window", 0)
    sliding = set(m.get("sliding_layers") or range(n)) if window else set()
    qwen_window = {"use_sliding_window": bool(window), "sliding_window": window or None, "max_window_layers": n,
                   "layer_types": ["sliding_attention" if i in sliding else "full_attention" for i in range(n)]}
    if m.get("qk_norm"):
        if m.get("qkv_bias"):
            raise ConfigError("a model with q/k norms and q/k/v biases has no Hugging Face form hpcpipe writes "
                              "(Qwen3's attention_bias also biases o_proj, which hpcpipe's llama kind does not have)")
        return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **out, "attention_bias": False,
                **qwen_window}
    if m.get("qkv_bias"):
        return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **out, **qwen_window}
    if window:
        if len(sliding) != n:
            raise ConfigError(f"a model with a sliding window on some blocks only ({sorted(sliding)} of {n}) and "
                              f"neither q/k/v biases nor q/k norms has no Hugging Face form (Mistral's window is on "
                              f"every layer; Qwen2 and Qwen3 name their layers)")
        return {"architectures": ["MistralForCausalLM"], "model_type": "mistral", **out, "sliding_window": window}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **out, "attention_bias": False,
            "mlp_bias": False}


HF = HFMap(model_types=("llama", "mistral", "qwen2", "qwen3"), prefix="model.", keys=keys_of, pieces=pieces,
           config_json=config_json, zero_only=zero_only,
           tokenizer_classes={"mistral": "TokenizersBackend", "qwen2": "Qwen2Tokenizer", "qwen3": "Qwen2Tokenizer"},
           forced_tokenizer=("qwen2",), lora_targets=("q_proj", "v_proj"))
