"""The mlp kind's [model] keys (layer widths, bias, activations) and their checks."""

from __future__ import annotations

from typing import Any

from hpcpipe.nn.core.activations import ACTIVATIONS
from hpcpipe.nn.core.decoder_keys import require
from hpcpipe.nn.kind import Key

KEYS = (
    Key("dims", list[int], [16, 16, 16, 16, 16], "layer widths: len(dims) - 1 Linear layers"),
    Key("bias", bool, True, "Linear layers with biases"),
    Key("activation", str, "relu", " | ".join(ACTIVATIONS)),
    Key("final_activation", bool, True, "the activation after the last layer too (as the seeds)"),
)


def validate(mod: Any) -> None:
    """Check the widths and the activation."""
    require(len(mod.dims) >= 2 and all(d >= 1 for d in mod.dims),
            f"model.dims needs at least two positive widths, got {mod.dims}")
    require(mod.activation in ACTIVATIONS,
            f"model.activation {mod.activation!r} is not one of {', '.join(ACTIVATIONS)}")


def validate_tp(mod: Any, tp: int) -> None:
    """Check that the layers split over tp ranks: the column-parallel (even) layers' output widths."""
    cut = [mod.dims[i + 1] for i in range(0, len(mod.dims) - 1, 2)]
    bad = [w for w in cut if w % tp]
    require(not bad, f"parallel.tp = {tp}: the MLP's column-parallel layers (0, 2, ...) have output widths {cut}, "
                     f"which tp must divide ({bad[0] if bad else ''} is not divisible)")
