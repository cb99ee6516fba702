"""Which model kind stored state holds (mlp | gpt | llama), and the check that refuses a file of another kind.

The model attribute (JSON) of a weights file, and the config of a checkpoint's
manifest, carry ``kind``; a missing kind means "mlp" (files written before GPT
models existed). A model's specs carry ``.kind`` ("gpt", "llama" for their layer groups);
the MLP's LayerSpec has none and means "mlp". Every reader of stored weights
(``model.init``, ``--resume``, ``infer --weights``) compares the two through
:func:`check_kind` before any other check, so the answer is one message about
the kind, not a puzzle about layer shapes.
"""

from __future__ import annotations

from typing import Any

from hpcpipe.config import DECODERS, KIND_KEYS, KIND_NAMES, Config, from_dict
from hpcpipe.errors import ConfigError
from hpcpipe.nn.registry import KINDS as KIND_REGISTRY
from hpcpipe.nn.registry import model_specs

KINDS = tuple(KIND_KEYS)


def stored_kind(model: dict[str, Any], label: str) -> str:
    """Return the kind of the model stored with weights ("mlp" when none is recorded); ConfigError if unknown."""
    kind = model.get("kind", "mlp")
    if kind not in KINDS:
        raise ConfigError(f"{label} records model.kind = {kind!r}; this hpcpipe knows "
                          f"{', '.join(repr(k) for k in KINDS)}")
    return kind


def specs_kind(specs: list[Any]) -> str:
    """Return the kind of the model a list of specs describes ("mlp" for LayerSpec, which has no kind)."""
    return getattr(specs[0], "kind", "mlp") if specs else "mlp"


def count_text(kind: str, n_layers: int) -> str:
    """Return "6 layer groups" (GPT, llama) or "4 layers" (MLP)."""
    return f"{n_layers} layer groups" if kind in DECODERS else f"{n_layers} layers"


def check_kind(model: dict[str, Any], n_layers: int, specs: list[Any], label: str) -> None:
    """Raise ConfigError when the stored model is of another kind than the model the specs describe.

    e.g. ``model.init 'w.h5' holds a GPT model (model.kind = "gpt", 6 layer groups); this run has
    model.kind = "mlp"``.
    """
    stored, wanted = stored_kind(model, label), specs_kind(specs)
    if stored != wanted:
        article = KIND_NAMES[stored].removesuffix(" model")
        raise ConfigError(f'{label} holds {article} model (model.kind = "{stored}", {count_text(stored, n_layers)}); '
                          f'this run has model.kind = "{wanted}"')


def restate_stored_model(raw: dict[str, Any], stored: dict[str, Any], label: str,
                         keys: tuple[str, ...]) -> dict[str, Any]:
    """Return raw config sections with ``keys`` of [model] taken from the stored model; ConfigError on a contradiction.

    Front ends that run saved weights (infer, generate, serve) take the model from the weights:
    the configuration may restate a stored key but not contradict it.
    """
    raw = {name: dict(values) if isinstance(values, dict) else values for name, values in raw.items()}
    model = raw.setdefault("model", {})
    if not isinstance(model, dict):
        raise ConfigError(f"[model] must be a table of keys, got {model!r}")
    for key in keys:
        if key not in stored:
            continue
        if key in model and model[key] != stored[key]:
            raise ConfigError(f"model.{key} = {model[key]!r} in the configuration does not match {label}, which "
                              f"was saved with model.{key} = {stored[key]!r}")
        model[key] = stored[key]
    return raw


def restate_stored_shape(raw: dict[str, Any], source: Any, training: bool = False) -> dict[str, Any]:
    """Return raw config sections with the stored model's kind, shape keys and dtype (restate_stored_model).

    A Hugging Face model's ``seq_len`` (its config.json's max_position_embeddings) may be set shorter when its
    kind's seq_len sizes no parameter (RoPE has no position table): a generation's KV cache and a training
    window are seq_len long. ``training`` (model.init of a run from an hpcpipe file or checkpoint): such a
    model's seq_len and the dtype are only defaults (the window it was trained at is no limit of the model: a
    run may lengthen it; it may train float32 weights in float64, or the reverse).
    """
    kind = stored_kind(source.model, source.describe())
    keys = ("kind", *KIND_KEYS[kind], "dtype")
    free = KIND_REGISTRY[kind].seq_len_free
    defaults = () if not training else ("seq_len", "dtype") if free else ("dtype",)
    shorter = getattr(source, "kind", "") == "hf" and free and not training
    keys = tuple(k for k in keys if k not in defaults and not (shorter and k == "seq_len"))
    raw = restate_stored_model(raw, source.model, source.describe(), keys)
    for key in defaults:
        if key in source.model:
            raw["model"].setdefault(key, source.model[key])
    if shorter:
        longest = source.model["seq_len"]
        wanted = raw["model"].setdefault("seq_len", longest)
        if isinstance(wanted, int) and not isinstance(wanted, bool) and wanted > longest:
            raise ConfigError(f"model.seq_len = {wanted} is longer than {source.describe()}'s context of {longest} "
                              f"tokens (max_position_embeddings in its config.json)")
    return raw


def stored_config(model: dict[str, Any], label: str) -> Config:
    """Return the config of the model stored with weights (a model attribute or a manifest's [model]).

    A GPT or llama must record every key of its shape: a missing ``n_heads`` (or
    ``rope_theta``) would otherwise take the default and compute another model on the same shapes.
    """
    kind = stored_kind(model, label)
    if kind in DECODERS:
        missing = [key for key in KIND_REGISTRY[kind].recorded_keys if key not in model]
        if missing:
            raise ConfigError(f"{label} holds {KIND_NAMES[kind].removesuffix(' model')} model without "
                              f"{', '.join(missing)} in its model attribute")
    try:
        return from_dict({"model": model, "parallel": {"pp": 1}})
    except ConfigError as exc:
        raise ConfigError(f"{label} records an invalid model: {exc}") from None


def shape_text(model: dict[str, Any]) -> str:
    """Return a one-line description of a stored model: its kind and shape."""
    kind = model.get("kind", "mlp")
    if kind in DECODERS:
        return f"{kind} " + " ".join(f"{key}={_toml(model.get(key))}" for key in KIND_KEYS[kind])
    return f"mlp dims {model.get('dims')}"


def _toml(value: Any) -> str:
    return "true" if value is True else "false" if value is False else str(value)


def config_specs(config: dict[str, Any]) -> list[Any]:
    """Return the specs (one per /layers group) of the model a config dict describes; ConfigError when invalid."""
    return model_specs(from_dict(config))


def stored_specs(model: dict[str, Any], label: str) -> list[Any]:
    """Return the specs of the model stored with weights (a model attribute or a manifest's [model])."""
    return model_specs(stored_config(model, label))
