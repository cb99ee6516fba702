"""The model kinds hpcpipe knows, one line each, and the lookups the rest of hpcpipe makes through them.

Adding a kind is its folder (``nn/<kind>/``: keys, shape, model, Hugging Face map, exporting a
:class:`hpcpipe.nn.kind.Kind` as ``KIND``) plus one line in :data:`KINDS`.
"""

from __future__ import annotations

from typing import Any

from hpcpipe.nn import gpt, llama, mlp, moe
from hpcpipe.nn.kind import Key, Kind
from hpcpipe.nn.model_def import ModelDef

KINDS: dict[str, Kind] = {k.name: k for k in (
    mlp.KIND,
    gpt.KIND,
    llama.KIND,
    moe.KIND,
)}


def kind(name: str) -> Kind:
    """Return the kind named ``name`` (model.kind); KeyError for an unknown one (the config refuses it first)."""
    return KINDS[name]


def decoders() -> tuple[str, ...]:
    """The names of the language-model kinds (tokens, a tokenizer, generate and serve)."""
    return tuple(name for name, k in KINDS.items() if k.decoder)


def model_keys() -> list[Key]:
    """Every kind's [model] keys, each once, in registry order; a key several kinds read has one type and default."""
    seen: dict[str, Key] = {}
    for k in KINDS.values():
        for key in k.keys:
            first = seen.setdefault(key.name, key)
            if (first.type, first.default) != (key.type, key.default):
                raise TypeError(f"model key {key.name!r} of kind {k.name!r} differs from another kind's "
                                f"({key.type}, {key.default!r} vs {first.type}, {first.default!r})")
    return list(seen.values())


def model_def(config: Any) -> ModelDef:
    """Return the model definition of config.model.kind (with train.lora_rank, its LoRA adapters: hpcpipe.nn.lora)."""
    kind = KINDS[config.model.kind]
    model = kind.model(config)
    train = getattr(config, "train", None)
    if train is not None and train.lora_rank:
        from hpcpipe.nn.lora import with_adapters
        model = with_adapters(model, kind.hf, config)
    return model


def model_specs(config: Any) -> list:
    """Return one spec per layer group of the configured model (MLP: LayerSpec; decoders: GroupSpec)."""
    return model_def(config).specs


def hf_kind(model_type: Any) -> Kind | None:
    """Return the kind that reads Hugging Face directories of ``model_type`` (config.json), None when none does."""
    return next((k for k in KINDS.values() if k.hf is not None and model_type in k.hf.model_types), None)


def hf_model_types() -> tuple[str, ...]:
    """Every config.json model_type some kind reads, in registry order."""
    return tuple(t for k in KINDS.values() if k.hf is not None for t in k.hf.model_types)
