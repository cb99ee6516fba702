"""The llama kind's [model] keys (the decoder's, plus grouped-query attention, RoPE, RMSNorm, biases) and checks."""

from __future__ import annotations

from typing import Any

from hpcpipe.errors import ConfigError
from hpcpipe.nn.core.decoder_keys import DECODER_KEYS, check_decoder, check_decoder_tp, require
from hpcpipe.nn.core.rope import check_scaling
from hpcpipe.nn.kind import Key
from hpcpipe.nn.llama.shape import default_ff

KEYS = DECODER_KEYS + (
    Key("n_kv_heads", int, 0, "key/value heads (grouped-query attention); 0 = n_heads"),
    Key("head_dim", int, 0, "width of one head; 0 = d_model / n_heads"),
    Key("rope_theta", float, 10000.0, "RoPE base"),
    Key("rope_scaling", dict, {}, "{} or Hugging Face's, e.g. {rope_type = \"llama3\", ...}"),
    Key("norm_eps", float, 1e-5, "RMSNorm epsilon"),
    Key("qkv_bias", bool, False, "biases on q, k and v (Qwen2)"),
    Key("qk_norm", bool, False, "RMSNorm of each head's q and k before RoPE (Qwen3)", stored=False),
    Key("sliding_window", int, 0, "0: every block sees the whole context; else the blocks of sliding_layers see "
                                  "only the last sliding_window tokens (Mistral, Qwen2/3 with use_sliding_window)",
        stored=False),
    Key("sliding_layers", list[int], [], "the blocks (0-based) with the sliding window; [] = every block",
        stored=False),
)


def validate(mod: Any) -> None:
    """Check the llama shape keys (the numerics' own checks name the rest: rope_scaling, head_dim parity)."""
    check_decoder(mod)
    for key, zero in (("d_ff", "Meta's 8/3 x d_model, rounded up to 256"), ("n_kv_heads", "model.n_heads"),
                      ("head_dim", "model.d_model / model.n_heads")):
        require(getattr(mod, key) >= 0, f"model.{key} must be >= 0 (0 = {zero}), got {getattr(mod, key)}")
    kv = mod.n_kv_heads or mod.n_heads
    require(mod.n_heads % kv == 0,
            f"model.n_kv_heads ({kv}) does not divide model.n_heads ({mod.n_heads}): each key/value head serves "
            f"n_heads / n_kv_heads query heads")
    require(mod.head_dim > 0 or mod.d_model % mod.n_heads == 0,
            f"model.n_heads ({mod.n_heads}) does not divide model.d_model ({mod.d_model}); give model.head_dim")
    require((mod.head_dim or mod.d_model // mod.n_heads) % 2 == 0,
            f"model.head_dim ({mod.head_dim or mod.d_model // mod.n_heads}) must be even: RoPE rotates the two "
            f"halves of each head")
    require(mod.rope_theta > 0, f"model.rope_theta must be > 0, got {mod.rope_theta}")
    require(mod.norm_eps > 0, f"model.norm_eps must be > 0, got {mod.norm_eps}")
    require(mod.sliding_window >= 0, f"model.sliding_window must be >= 0 (0 = no window), got {mod.sliding_window}")
    bad = [i for i in mod.sliding_layers if not 0 <= i < mod.n_blocks]
    require(not bad, f"model.sliding_layers {mod.sliding_layers}: block {bad[0] if bad else ''} is not in "
                     f"0..{mod.n_blocks - 1} (model.n_blocks = {mod.n_blocks})")
    require(len(set(mod.sliding_layers)) == len(mod.sliding_layers),
            f"model.sliding_layers {mod.sliding_layers} names a block twice")
    require(mod.sliding_window > 0 or not mod.sliding_layers,
            f"model.sliding_layers {mod.sliding_layers} is set but model.sliding_window is 0 (no window)")
    if mod.rope_scaling:
        try:
            check_scaling(mod.rope_scaling)
        except ValueError as exc:
            raise ConfigError(f"model.rope_scaling: {exc}") from None


def validate_tp(mod: Any, tp: int) -> None:
    """Check that the model splits over tp ranks: query heads, MLP columns, and key/value heads split or shared."""
    check_decoder_tp(mod, tp, mod.d_ff or default_ff(mod.d_model), mod.head_dim)
    kv = mod.n_kv_heads or mod.n_heads
    require(kv % tp == 0 or tp % kv == 0,
            f"parallel.tp = {tp}: model.n_kv_heads ({kv}) must be divisible by tp or divide it (key/value heads are "
            f"split over the ranks, or each held by tp / n_kv_heads ranks)")
