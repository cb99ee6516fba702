"""A Hugging Face model directory's config.json -> the hpcpipe model kind and its [model] keys.

Four model types: ``gpt2`` (hpcpipe kind ``gpt``) and ``llama``, ``mistral``, ``qwen2`` (kind ``llama``).
config.json may be written by transformers 4.x (``rope_theta``, ``rope_scaling``, ``torch_dtype``) or 5.x
(``rope_parameters``, ``dtype``). Anything hpcpipe's numerics would compute differently (another activation,
LayerNorm epsilon, rope type, a sliding window shorter than the context, quantized weights) is a one-line
ConfigError naming the file and the value, never a silently different model.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcpipe.errors import ConfigError

SUPPORTED = ("gpt2", "llama", "mistral", "qwen2")
KINDS = {"gpt2": "gpt", "llama": "llama", "mistral": "llama", "qwen2": "llama"}
ROPE_TYPES = ("default", "linear", "llama3")      # what the llama kind computes; others are refused
GPT_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")   # both are tanh-GELU, as hpcpipe's GPT
GPT_LAYER_NORM_EPS = 1e-5
DTYPES = ("float32", "float16", "bfloat16", "float64")
DEFAULT_ROPE_THETA = 10000.0
DEFAULT_RMS_NORM_EPS = 1e-6
_ROPE_NEEDS = {"linear": ("factor",),
               "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


@dataclass(frozen=True)
class HFModel:
    """What hpcpipe needs to know of a Hugging Face model directory (see :func:`read_hf_config`)."""

    directory: Path
    model_type: str                      # gpt2 | llama | mistral | qwen2
    kind: str                            # hpcpipe kind: gpt | llama
    model: dict[str, Any]                # hpcpipe [model] keys
    dtype: str | None                    # float32 | float16 | bfloat16 as config.json states it, None if it does not
    eos_ids: tuple[int, ...]             # generation stops at any of these (generation_config.json, else config.json)
    bos_id: int | None = None
    config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)   # config.json as read

    @property
    def n_groups(self) -> int:
        """Number of hpcpipe layer groups: embedding, the blocks, final norm (+ head)."""
        return self.model["n_blocks"] + 2


def read_json_file(path: Path, what: str = "file") -> Any:
    """Return the parsed JSON of a file; ConfigError of one line naming it when it is unreadable or not JSON."""
    label = f"{what} {str(path)!r}"
    if not path.exists():
        raise ConfigError(f"{label} does not exist")
    if not path.is_file():
        raise ConfigError(f"{label} is not a regular file")
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise ConfigError(f"{label} cannot be read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{label} is not UTF-8 text") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{label} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None


def read_hf_config(directory: str | Path) -> HFModel:
    """Read ``directory/config.json`` (and generation_config.json) into an :class:`HFModel`; ConfigError if unusable."""
    d = Path(directory)
    if not d.exists():
        raise ConfigError(f"Hugging Face model directory {str(d)!r} does not exist")
    if not d.is_dir():
        raise ConfigError(f"Hugging Face model directory {str(d)!r} is not a directory")
    path = d / "config.json"
    cfg = read_json_file(path, "Hugging Face config")
    label = f"{str(path)!r}"
    if not isinstance(cfg, dict):
        raise ConfigError(f"{label} must hold a JSON object, got {type(cfg).__name__}")
    model_type = cfg.get("model_type")
    if model_type not in KINDS:
        raise ConfigError(f"{label}: model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED)})")
    if cfg.get("quantization_config") is not None:
        method = cfg["quantization_config"].get("quant_method") if isinstance(cfg["quantization_config"], dict) \
            else None
        raise ConfigError(f"{label}: quantized weights (quantization_config, quant_method {method!r}) are not "
                          f"supported; use the model's float16, bfloat16 or float32 release")
    keys = _gpt_keys(cfg, label) if model_type == "gpt2" else _llama_keys(cfg, label, model_type)
    eos, bos = _special_ids(d, cfg, label)
    return HFModel(directory=d, model_type=model_type, kind=KINDS[model_type], model=keys,
                   dtype=_dtype(cfg, label), eos_ids=eos, bos_id=bos, config=cfg)


def _get(cfg: dict, key: str, label: str, default: Any = ...) -> Any:
    """Return cfg[key]; ConfigError 'missing key' when absent (or null) and no default is given."""
    value = cfg.get(key)
    if value is None:
        if default is ...:
            raise ConfigError(f"{label} lacks the key {key!r}")
        return default
    return value


def _positive_int(cfg: dict, key: str, label: str, default: Any = ...) -> int:
    """Return a positive integer key of the config; ConfigError naming key and value otherwise."""
    value = _get(cfg, key, label, default)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{label}: {key} must be a positive integer, got {value!r}")
    return value


def _number(cfg: dict, key: str, label: str, default: Any = ...) -> float:
    """Return a finite positive number key of the config as float; ConfigError naming key and value otherwise."""
    value = _get(cfg, key, label, default)
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{label}: {key} must be a positive number, got {value!r}")
    return float(value)


def _flag(cfg: dict, key: str, label: str, default: bool) -> bool:
    """Return a boolean key of the config; ConfigError naming key and value otherwise."""
    value = _get(cfg, key, label, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{label}: {key} must be true or false, got {value!r}")
    return value


def _gpt_keys(cfg: dict, label: str) -> dict[str, Any]:
    """Return the gpt kind's [model] keys of a gpt2 config."""
    act = cfg.get("activation_function", "gelu_new")
    if act not in GPT_ACTIVATIONS:
        raise ConfigError(f"{label}: activation_function {act!r} is not supported; hpcpipe's GPT uses tanh-GELU "
                          f"({' or '.join(GPT_ACTIVATIONS)})")
    eps = cfg.get("layer_norm_epsilon", GPT_LAYER_NORM_EPS)
    if eps != GPT_LAYER_NORM_EPS:
        raise ConfigError(f"{label}: layer_norm_epsilon {eps!r} is not supported; hpcpipe's GPT uses LayerNorm "
                          f"epsilon {GPT_LAYER_NORM_EPS}")
    for key, fine in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("add_cross_attention", False)):
        if cfg.get(key, fine) != fine:
            raise ConfigError(f"{label}: {key} {cfg[key]!r} is not supported (hpcpipe's GPT needs {fine})")
    d = _positive_int(cfg, "n_embd", label)
    heads = _positive_int(cfg, "n_head", label)
    if d % heads:
        raise ConfigError(f"{label}: n_embd {d} is not a multiple of n_head {heads}")
    return {"vocab_size": _positive_int(cfg, "vocab_size", label), "seq_len": _positive_int(cfg, "n_positions", label),
            "d_model": d, "n_heads": heads, "n_blocks": _positive_int(cfg, "n_layer", label),
            "d_ff": _positive_int(cfg, "n_inner", label, 4 * d),
            "tie_embeddings": _flag(cfg, "tie_word_embeddings", label, True)}


def _llama_keys(cfg: dict, label: str, model_type: str) -> dict[str, Any]:
    """Return the llama kind's [model] keys of a llama, mistral or qwen2 config."""
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{label}: hidden_act {act!r} is not supported; hpcpipe's llama kind uses silu (SwiGLU)")
    if cfg.get("mlp_bias", False) is not False:
        raise ConfigError(f"{label}: mlp_bias {cfg['mlp_bias']!r} is not supported; hpcpipe's llama kind has no "
                          f"MLP biases")
    d = _positive_int(cfg, "hidden_size", label)
    heads = _positive_int(cfg, "num_attention_heads", label)
    kv = _positive_int(cfg, "num_key_value_heads", label, heads)
    if heads % kv:
        raise ConfigError(f"{label}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        if d % heads:
            raise ConfigError(f"{label}: hidden_size {d} is not a multiple of num_attention_heads {heads} "
                              f"(and no head_dim is given)")
        head_dim = d // heads
    else:
        head_dim = _positive_int(cfg, "head_dim", label)
    if head_dim % 2:
        raise ConfigError(f"{label}: head_dim {head_dim} is odd; RoPE rotates the two halves of each head")
    seq_len = _positive_int(cfg, "max_position_embeddings", label)
    _check_window(cfg, label, model_type, seq_len)
    if model_type == "qwen2":
        qkv_bias = True
    else:
        qkv_bias = _flag(cfg, "attention_bias", label, False) if model_type == "llama" else False
    theta, scaling = _rope(cfg, label, seq_len)
    return {"vocab_size": _positive_int(cfg, "vocab_size", label), "seq_len": seq_len, "d_model": d,
            "n_heads": heads, "n_kv_heads": kv, "n_blocks": _positive_int(cfg, "num_hidden_layers", label),
            "d_ff": _positive_int(cfg, "intermediate_size", label),
            "tie_embeddings": _flag(cfg, "tie_word_embeddings", label, False),
            "rope_theta": theta, "rope_scaling": scaling,
            "norm_eps": _number(cfg, "rms_norm_eps", label, DEFAULT_RMS_NORM_EPS),
            "qkv_bias": qkv_bias, "head_dim": head_dim}


def _check_window(cfg: dict, label: str, model_type: str, seq_len: int) -> None:
    """Refuse a sliding attention window shorter than the context: hpcpipe attends to the whole context."""
    window = cfg.get("sliding_window")
    if model_type == "mistral":
        active = window is not None
    elif model_type == "qwen2":
        layers = cfg.get("layer_types")
        if isinstance(layers, list):
            active = cfg.get("use_sliding_window", False) and "sliding_attention" in layers
        else:
            active = (cfg.get("use_sliding_window", False) and window is not None
                      and cfg.get("max_window_layers", 28) < cfg.get("num_hidden_layers", 0))
    else:
        active = False
    if not active or window is None:
        return
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ConfigError(f"{label}: sliding_window must be null or a positive integer, got {window!r}")
    if window < seq_len:
        raise ConfigError(f"{label}: sliding_window {window} is shorter than the context (max_position_embeddings "
                          f"{seq_len}); hpcpipe attends to the whole context, so tokens beyond {window} back would "
                          f"be treated differently (accepted: null or >= {seq_len})")


def _rope(cfg: dict, label: str, seq_len: int) -> tuple[float, dict[str, Any] | None]:
    """Return (rope_theta, rope_scaling) of 4.x (rope_theta, rope_scaling) or 5.x (rope_parameters) keys."""
    params = cfg.get("rope_parameters")
    key = "rope_parameters"
    if params is None:
        params, key = cfg.get("rope_scaling"), "rope_scaling"
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


def _dtype(cfg: dict, label: str) -> str | None:
    """Return the weights' dtype as config.json states it (5.x ``dtype``, 4.x ``torch_dtype``), or None."""
    value = cfg.get("dtype", cfg.get("torch_dtype"))
    if value is None or value == "auto":
        return None
    name = str(value).removeprefix("torch.")
    if name not in DTYPES:
        raise ConfigError(f"{label}: dtype {value!r} is not supported (supported: {', '.join(DTYPES[:3])})")
    return name


def _special_ids(directory: Path, cfg: dict, label: str) -> tuple[tuple[int, ...], int | None]:
    """Return (eos ids, bos id) from generation_config.json when it names them, else from config.json."""
    gen_path = directory / "generation_config.json"
    gen = read_json_file(gen_path, "Hugging Face generation config") if gen_path.exists() else {}
    if not isinstance(gen, dict):
        raise ConfigError(f"{str(gen_path)!r} must hold a JSON object, got {type(gen).__name__}")
    eos_source, eos_label = (gen, repr(str(gen_path))) if gen.get("eos_token_id") is not None else (cfg, label)
    eos = token_ids(eos_source.get("eos_token_id"), f"{eos_label}: eos_token_id")
    bos_source, bos_label = (gen, repr(str(gen_path))) if gen.get("bos_token_id") is not None else (cfg, label)
    bos = token_ids(bos_source.get("bos_token_id"), f"{bos_label}: bos_token_id")
    return eos, (bos[0] if bos else None)


def token_ids(value: Any, what: str) -> tuple[int, ...]:
    """Return a config's token id field (null, one id or a list of ids) as a tuple; ConfigError naming it otherwise."""
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
        raise ConfigError(f"{what} must be a token id or a list of token ids, got {value!r}")
    return tuple(dict.fromkeys(items))
