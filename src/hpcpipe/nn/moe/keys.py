"""The moe kind's [model] keys: the llama kind's, plus its experts (Mixtral, Qwen3-MoE), and their checks."""

from __future__ import annotations

from typing import Any

from hpcpipe.nn.core.decoder_keys import require
from hpcpipe.nn.kind import Key
from hpcpipe.nn.llama.keys import KEYS as LLAMA_KEYS
from hpcpipe.nn.llama.keys import validate as validate_llama

KEYS = LLAMA_KEYS + (
    Key("n_experts", int, 8, "experts of each mixture-of-experts block"),
    Key("experts_per_token", int, 2, "experts each token is routed to (top-k)"),
    Key("moe_d_ff", int, 0, "hidden width of one expert; 0 = model.d_ff"),
    Key("norm_topk_prob", bool, True, "the chosen experts' weights renormalised to sum to 1 (Mixtral: true)"),
    Key("moe_layers", list[int], [], "the blocks (0-based) with experts; [] = every block; the others a dense MLP"),
    Key("router_aux_loss_coef", float, 0.0, "weight of the load-balancing loss in training (0 = none)"),
)


def validate(mod: Any) -> None:
    """Check the llama keys and the experts'."""
    validate_llama(mod)
    require(mod.n_experts >= 1, f"model.n_experts must be >= 1, got {mod.n_experts}")
    require(1 <= mod.experts_per_token <= mod.n_experts,
            f"model.experts_per_token ({mod.experts_per_token}) must be in 1..model.n_experts ({mod.n_experts})")
    require(mod.moe_d_ff >= 0, f"model.moe_d_ff must be >= 0 (0 = model.d_ff), got {mod.moe_d_ff}")
    bad = [i for i in mod.moe_layers if not 0 <= i < mod.n_blocks]
    require(not bad, f"model.moe_layers {mod.moe_layers}: block {bad[0] if bad else ''} is not in "
                     f"0..{mod.n_blocks - 1} (model.n_blocks = {mod.n_blocks})")
    require(len(set(mod.moe_layers)) == len(mod.moe_layers), f"model.moe_layers {mod.moe_layers} names a block twice")
    require(mod.router_aux_loss_coef >= 0, f"model.router_aux_loss_coef must be >= 0, got {mod.router_aux_loss_coef}")


def validate_tp(mod: Any, tp: int) -> None:
    """Experts are not split over tensor-parallel ranks (their axis is ep): refuse tp > 1."""
    require(tp == 1, f"parallel.tp = {tp}: the moe kind (model.n_experts = {mod.n_experts}) runs at parallel.tp = 1; "
                     f"spread a large mixture-of-experts model over stages (parallel.pp)")


def validate_ep(mod: Any, ep: int) -> None:
    """Every rank of an expert-parallel group holds n_experts / ep whole experts of each block: ep must divide them."""
    require(mod.n_experts % ep == 0, f"parallel.ep ({ep}) does not divide model.n_experts ({mod.n_experts}): each of "
                                     f"the ep ranks holds the same number of whole experts")
