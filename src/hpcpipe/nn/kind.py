"""What a model kind declares about itself: its [model] keys, their checks, its ModelDef and its Hugging Face map.

Each kind lives in its own folder (``nn/mlp``, ``nn/gpt``, ``nn/llama``) and exports one :class:`Kind`;
:mod:`hpcpipe.nn.registry` lists them, one line each. Nothing else in hpcpipe names a kind's keys, layers
or tensor names: the config builds ``[model]`` from the kinds' :class:`Key` lists, the state code checks
stored models through them, and the Hugging Face code reads and writes directories through :class:`HFMap`.
A kind's modules never import :mod:`hpcpipe.config` (the config is built from them): they read a config
by its attributes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Key:
    """One ``[model]`` key a kind reads: its type, default and meaning (the README's config table)."""

    name: str
    type: Any                  # int | float | bool | str | list[int] | dict
    default: Any
    doc: str = ""
    stored: bool = True        # stored weights must record it; False: a key added later, its default when absent


def _none(keys: dict[str, Any], index: int) -> list[str]:
    return []


@dataclass(frozen=True)
class HFMap:
    """How models of a kind are Hugging Face directories, in (config.json, tensor names) and out.

    ``pieces(keys, index)`` lists the tensors of layer group ``index`` (:class:`hpcpipe.hf.pieces.Piece`:
    HF name without the base-model prefix, hpcpipe name and shape, transposed or not); ``zero_only(keys,
    index)`` names HF tensors hpcpipe has no place for, accepted only when all zero.
    """

    model_types: tuple[str, ...]                       # config.json model_type values read as this kind
    prefix: str                                        # the base model's tensor-name prefix
    keys: Callable[[dict, str, str], dict]             # (config.json, its label, model_type) -> [model] keys
    pieces: Callable[[dict, int], list]                # ([model] keys, group index) -> pieces
    config_json: Callable[..., dict]                   # ([model] keys, dtype, eos_ids, bos_id) -> config.json
    zero_only: Callable[[dict, int], list[str]] = _none
    tokenizer_classes: dict[str, str] = field(default_factory=dict)   # model_type -> transformers' registered class
    forced_tokenizer: tuple[str, ...] = ()             # model_types whose registered class wins over the declared one
    lora_targets: tuple[str, ...] = ()                 # PEFT's default target_modules for the model_types (LoRA)


@dataclass(frozen=True)
class Kind:
    """One model kind: ``model.kind = name``."""

    name: str
    title: str                                         # "a GPT", "a Llama-family model": used in messages
    keys: tuple[Key, ...]                              # the [model] keys it reads (beyond kind, init, seed, dtype)
    model: Callable[[Any], Any]                        # Config -> ModelDef
    validate: Callable[[Any], None]                    # ModelConfig -> None, ConfigError naming the key
    validate_tp: Callable[[Any, int], None]            # (ModelConfig, tp) -> None, ConfigError when it cannot split
    decoder: bool = False                              # a language model: tokens, a tokenizer, generate and serve
    seq_len_free: bool = False                         # seq_len sizes no parameter (RoPE): may run shorter than stored
    hf: HFMap | None = None

    @property
    def key_names(self) -> tuple[str, ...]:
        """The names of the [model] keys it reads."""
        return tuple(k.name for k in self.keys)

    @property
    def recorded_keys(self) -> tuple[str, ...]:
        """The keys stored weights of this kind must record (the others came later: absent means default)."""
        return tuple(k.name for k in self.keys if k.stored)
