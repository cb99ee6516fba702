"""Which model kind stored state holds (mlp | gpt), and the check that refuses a file of the other kind.

The model attribute (JSON) of a weights file, and the config of a checkpoint's
manifest, carry ``kind``; a missing kind means "mlp" (files written before GPT
models existed). A model's specs carry ``.kind`` ("gpt" for GPT layer groups);
the MLP's LayerSpec has none and means "mlp". Every reader of stored weights
(``model.init``, ``--resume``, ``infer --weights``) compares the two through
:func:`check_kind` before any other check, so the answer is one message about
the kind, not a puzzle about layer shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hpcpipe.errors import ConfigError
from hpcpipe.nn.gpt_params import GPTShape, group_params

KINDS = ("mlp", "gpt")
GPT_KEYS = ("vocab_size", "seq_len", "d_model", "n_heads", "n_blocks", "d_ff", "tie_embeddings")


def stored_kind(model: dict[str, Any], label: str) -> str:
    """Return the kind of the model stored with weights ("mlp" when none is recorded); ConfigError if unknown."""
    kind = model.get("kind", "mlp")
    if kind not in KINDS:
        raise ConfigError(f"{label} records model.kind = {kind!r}; this hpcpipe knows "
                          f"{' and '.join(repr(k) for k in KINDS)}")
    return kind


def specs_kind(specs: list[Any]) -> str:
    """Return the kind of the model a list of specs describes ("mlp" for LayerSpec, which has no kind)."""
    return getattr(specs[0], "kind", "mlp") if specs else "mlp"


def count_text(kind: str, n_layers: int) -> str:
    """Return "6 layer groups" (GPT) or "4 layers" (MLP)."""
    return f"{n_layers} layer groups" if kind == "gpt" else f"{n_layers} layers"


def check_kind(model: dict[str, Any], n_layers: int, specs: list[Any], label: str) -> None:
    """Raise ConfigError when the stored model is of another kind than the model the specs describe.

    e.g. ``model.init 'w.h5' holds a GPT model (model.kind = "gpt", 6 layer groups); this run has
    model.kind = "mlp"``.
    """
    stored, wanted = stored_kind(model, label), specs_kind(specs)
    if stored != wanted:
        article = "a GPT" if stored == "gpt" else "an MLP"
        raise ConfigError(f'{label} holds {article} model (model.kind = "{stored}", {count_text(stored, n_layers)}); '
                          f'this run has model.kind = "{wanted}"')


def gpt_shape(model: dict[str, Any], label: str) -> GPTShape:
    """Return the GPTShape of a stored GPT model config; ConfigError naming the key that is missing or invalid."""
    missing = [key for key in GPT_KEYS if key not in model]
    if missing:
        raise ConfigError(f"{label} holds a GPT model without {', '.join(missing)} in its model attribute")
    tied = model["tie_embeddings"]
    if not isinstance(tied, bool):
        raise ConfigError(f"{label} records model.tie_embeddings = {tied!r}, expected true or false")
    try:
        return GPTShape(vocab=model["vocab_size"], seq_len=model["seq_len"], d_model=model["d_model"],
                        n_heads=model["n_heads"], n_blocks=model["n_blocks"], d_ff=model["d_ff"], tied=tied)
    except ValueError as exc:
        raise ConfigError(f"{label} records an invalid GPT model: {exc}") from None


def shape_text(model: dict[str, Any]) -> str:
    """Return a one-line description of a stored model: its kind and shape."""
    if model.get("kind", "mlp") == "gpt":
        return "gpt " + " ".join(f"{key}={_toml(model.get(key))}" for key in GPT_KEYS)
    return f"mlp dims {model.get('dims')}"


def _toml(value: Any) -> str:
    return "true" if value is True else "false" if value is False else str(value)


@dataclass(frozen=True)
class GroupSpec:
    """One GPT layer group's parameter names and shapes (what checking stored weights needs)."""

    index: int
    shapes: dict[str, tuple[int, ...]]
    kind: str = "gpt"

    @property
    def n_params(self) -> int:
        """Number of scalars in the group."""
        total = 0
        for dims in self.shapes.values():
            size = 1
            for d in dims:
                size *= d
            total += size
        return total


def gpt_specs(shape: GPTShape) -> list[GroupSpec]:
    """Return the spec of every layer group of a GPT, group 0 (embedding) to n_blocks + 1 (final)."""
    return [GroupSpec(i, dict(group_params(shape, i))) for i in range(shape.n_groups)]


def config_specs(config: dict[str, Any]) -> list[Any]:
    """Return the specs (one per /layers group) of the model a config dict describes; ConfigError when invalid."""
    from hpcpipe.config import from_dict
    cfg = from_dict(config)
    try:
        from hpcpipe.nn.model_spec import model_specs
    except ImportError:   # before the engine knew model kinds: every config is an MLP
        from hpcpipe.nn.model import layer_specs as model_specs
    return model_specs(cfg)


def stored_specs(model: dict[str, Any], label: str) -> list[Any]:
    """Return the specs of the model stored with weights (a model attribute or a manifest's [model]).

    A GPT's groups follow from its shape alone (the HDF5 contract of gpt_params);
    an MLP's from its config (dims, bias).
    """
    if stored_kind(model, label) == "gpt":
        return gpt_specs(gpt_shape(model, label))
    try:
        return config_specs({"model": model, "parallel": {"pp": 1}})
    except ConfigError as exc:
        raise ConfigError(f"{label} records an invalid model: {exc}") from None
