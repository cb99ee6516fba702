"""The [model] keys every decoder kind reads, and their checks (each kind adds its own beside them)."""

from __future__ import annotations

from typing import Any

from hpcpipe.errors import ConfigError
from hpcpipe.nn.kind import Key

DECODER_KEYS = (
    Key("vocab_size", int, 256, "tokens in the vocabulary"),
    Key("seq_len", int, 64, "context length T"),
    Key("d_model", int, 64, "width of the residual stream"),
    Key("n_heads", int, 4, "attention (query) heads"),
    Key("n_blocks", int, 4, "decoder blocks"),
    Key("d_ff", int, 0, "MLP width; 0 = the kind's default (gpt: 4 x d_model, llama: Meta's 8/3 x d_model to 256)"),
    Key("tie_embeddings", bool, True, "the head multiplies by tok_emb (no head/weight)"),
)


def require(ok: bool, message: str) -> None:
    """Raise ConfigError(message) unless ok."""
    if not ok:
        raise ConfigError(message)


def check_decoder(mod: Any) -> None:
    """Check the keys every decoder has (ranges only)."""
    for key in ("vocab_size", "seq_len", "d_model", "n_heads", "n_blocks"):
        require(getattr(mod, key) >= 1, f"model.{key} must be >= 1, got {getattr(mod, key)}")
    require(mod.vocab_size >= 2, f"model.vocab_size must be >= 2, got {mod.vocab_size}")


def check_decoder_tp(mod: Any, tp: int, ff: int, head_dim: int = 0) -> None:
    """Check that attention heads and the MLP's ``ff`` hidden columns split over tp ranks (with q8_0 weights: in
    whole q8_0 blocks of the row-parallel products' inputs, so a rank's blocks are the whole matrix's)."""
    where = f"parallel.tp = {tp}"
    require(mod.n_heads % tp == 0, f"{where} does not divide model.n_heads ({mod.n_heads}): attention is split by "
                                   f"heads")
    require(ff % tp == 0, f"{where} does not divide the MLP width ({ff}, model.d_ff): the MLP is split by columns")
    if tp > 1 and getattr(mod, "weight_format", "") == "q8_0":
        o = mod.n_heads // tp * (head_dim or mod.d_model // mod.n_heads)
        require(o % 32 == 0 and ff // tp % 32 == 0,
                f"{where} with model.weight_format = \"q8_0\": each rank's input slice of the attention output "
                f"({o}: its heads x head_dim) and of the MLP's down projection ({ff // tp}) must be whole q8_0 blocks "
                f"of 32; use \"stored\" or \"float32\", or another tp")
