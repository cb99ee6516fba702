"""The GPT kind's [model] keys (the decoder's own, nothing more) and their checks."""

from __future__ import annotations

from typing import Any

from hpcpipe.nn.core.decoder_keys import DECODER_KEYS, check_decoder, check_decoder_tp, require

KEYS = DECODER_KEYS


def validate(mod: Any) -> None:
    """Check the GPT shape keys."""
    check_decoder(mod)
    require(mod.d_ff >= 0, f"model.d_ff must be >= 0 (0 = 4 x model.d_model), got {mod.d_ff}")
    require(mod.d_model % mod.n_heads == 0,
            f"model.n_heads ({mod.n_heads}) does not divide model.d_model ({mod.d_model}): attention heads "
            f"are d_model / n_heads wide")


def validate_tp(mod: Any, tp: int) -> None:
    """Check that the GPT splits over tp ranks: heads and MLP columns."""
    check_decoder_tp(mod, tp, mod.d_ff or 4 * mod.d_model)
