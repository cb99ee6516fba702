"""A Hugging Face model directory's config.json -> the hpcpipe model kind and its [model] keys.

The kind is the one whose Hugging Face map lists config.json's ``model_type`` (:mod:`hpcpipe.nn.registry`:
``gpt2`` -> gpt; ``llama``, ``mistral``, ``qwen2`` -> llama), and the kind reads its own keys. config.json may
be written by transformers 4.x (``torch_dtype``) or 5.x (``dtype``). Anything hpcpipe's numerics would compute
differently (another activation, LayerNorm epsilon, rope type, a sliding window shorter than the context,
quantized weights) is a one-line ConfigError naming the file and the value, never a silently different model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcpipe.errors import ConfigError, UsageError
from hpcpipe.hf.json_text import JSONTextError, loads
from hpcpipe.hf.model_files import model_file
from hpcpipe.nn.registry import hf_kind, hf_model_types

DTYPES = ("float32", "float16", "bfloat16", "float64")
# config.json's sizes, bounded before anything is built from them: far above every released model, far below
# what would take gigabytes or minutes to refuse (num_hidden_layers = 10**8 took 3.7 GB before failing)
MAX_LAYERS = 4096
MAX_WIDTH = 1 << 17
SIZE_LIMITS = {"num_hidden_layers": MAX_LAYERS, "n_layer": MAX_LAYERS,
               "hidden_size": MAX_WIDTH, "n_embd": MAX_WIDTH, "intermediate_size": 1 << 20, "n_inner": 1 << 20,
               "num_attention_heads": 4096, "n_head": 4096, "num_key_value_heads": 4096, "head_dim": 4096,
               "vocab_size": 1 << 24, "max_position_embeddings": 1 << 24, "n_positions": 1 << 24,
               "num_local_experts": 4096, "num_experts": 4096, "moe_intermediate_size": 1 << 20}


@dataclass(frozen=True)
class HFModel:
    """What hpcpipe needs to know of a Hugging Face model directory (see :func:`read_hf_config`)."""

    directory: Path
    model_type: str                      # config.json's model_type: gpt2 | llama | mistral | qwen2 | ...
    kind: str                            # the hpcpipe kind that reads it: gpt | llama | ...
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
    """Return the parsed JSON of a model directory's file; ConfigError of one line naming it when it is missing, a
    link out of the directory, not a regular file, unreadable or not JSON (nested too deep included)."""
    label = f"{what} {str(path)!r}"
    if model_file(path.parent, path.name, what) is None:     # a link out of the model directory is refused
        raise ConfigError(f"{label} does not exist")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{label} cannot be read: {exc.strerror or exc}") from None
    try:
        return loads(data)
    except JSONTextError as exc:
        raise ConfigError(f"{label} {exc}") from None


ADAPTER_CONFIG = "adapter_config.json"   # what marks a PEFT adapter directory (hpcpipe.state.peft)


def refuse_adapter_directory(path: str | Path, label: str = "") -> None:
    """Raise UsageError when ``path`` is a PEFT adapter directory (adapter_config.json, no config.json): it is no
    model by itself, and the message says how to use it."""
    p = Path(path)
    if p.is_dir() and (p / ADAPTER_CONFIG).is_file() and not (p / "config.json").exists():
        named = f"{label} {str(p)!r}" if label else repr(str(p))
        raise UsageError(f"{named} is a PEFT adapter directory ({ADAPTER_CONFIG}), not a model: use it on its base "
                         f"model (generate/serve --weights BASE --adapter DIR, or model.adapter = DIR with "
                         f"model.init = BASE; train model.adapter = DIR to train it further)")


def check_sizes(cfg: dict, label: str) -> None:
    """Refuse a config.json size key above :data:`SIZE_LIMITS` (one line naming key, value and limit), before any
    list, array or stage cut is built from it."""
    for key, limit in SIZE_LIMITS.items():
        value = cfg.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and value > limit:
            text = repr(value)
            shown = text if len(text) <= 40 else f"a number of {len(text)} digits"
            raise ConfigError(f"{label}: {key} = {shown} is above hpcpipe's limit of {limit} (no released model "
                              f"comes near it: a damaged or hostile config.json?)")


def read_hf_config(directory: str | Path) -> HFModel:
    """Read ``directory/config.json`` (and generation_config.json) into an :class:`HFModel`; ConfigError if unusable."""
    d = Path(directory)
    if not d.exists():
        raise ConfigError(f"Hugging Face model directory {str(d)!r} does not exist")
    if not d.is_dir():
        raise ConfigError(f"Hugging Face model directory {str(d)!r} is not a directory")
    refuse_adapter_directory(d)
    path = d / "config.json"
    cfg = read_json_file(path, "Hugging Face config")
    label = f"{str(path)!r}"
    if not isinstance(cfg, dict):
        raise ConfigError(f"{label} must hold a JSON object, got {type(cfg).__name__}")
    model_type = cfg.get("model_type")
    kind = hf_kind(model_type)
    if kind is None:
        raise ConfigError(f"{label}: model_type {model_type!r} is not supported (supported: "
                          f"{', '.join(hf_model_types())})")
    if cfg.get("quantization_config") is not None:
        method = cfg["quantization_config"].get("quant_method") if isinstance(cfg["quantization_config"], dict) \
            else None
        raise ConfigError(f"{label}: quantized weights (quantization_config, quant_method {method!r}) are not "
                          f"supported; use the model's float16, bfloat16 or float32 release")
    check_sizes(cfg, label)
    _check_head(cfg, label)
    keys = kind.hf.keys(cfg, label, model_type)
    eos, bos = _special_ids(d, cfg, label)
    return HFModel(directory=d, model_type=model_type, kind=kind.name, model=keys,
                   dtype=_dtype(cfg, label), eos_ids=eos, bos_id=bos, config=cfg)


# heads that are no language-model head: a reward model or a classifier fine-tuned from a causal LM keeps its body
# (and model_type) but its score / qa_outputs matrix maps to labels, not to the vocabulary
OTHER_HEADS = ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering")


def _check_head(cfg: dict, label: str) -> None:
    """Refuse a config.json whose ``architectures`` all name a classification or question-answering head: it said
    "holds no lm_head.weight" (a damaged file, it seemed), or with tied embeddings generated from the embedding."""
    names = cfg.get("architectures")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        return
    if all(n.endswith(OTHER_HEADS) for n in names):
        raise ConfigError(f"{label}: architectures {names} is a classification / question-answering model (its head "
                          f"maps to labels, not to the vocabulary); hpcpipe runs causal language models "
                          f"(...ForCausalLM): use the model it was fine-tuned from")


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
    gen = read_json_file(gen_path, "Hugging Face generation config") if os.path.lexists(gen_path) else {}
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
