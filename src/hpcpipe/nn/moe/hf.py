"""The moe kind as Hugging Face ``mixtral`` and ``qwen3_moe`` directories: config.json and tensor names, both ways.

Attention, norms and (Qwen3-MoE's) dense blocks are the llama kind's (Mixtral's attention is Mistral's,
Qwen3-MoE's is Qwen3's). A sparse block's router is ``block_sparse_moe.gate`` / ``mlp.gate`` (E, d), its
experts one set of tensors each (Mixtral ``experts.E.w1`` gate, ``w3`` up, ``w2`` down; Qwen3-MoE
``experts.E.{gate,up,down}_proj``), stacked by expert index into hpcpipe's (E, ...) arrays.
"""

from __future__ import annotations

from typing import Any

from hpcpipe.errors import ConfigError
from hpcpipe.hf.json_fields import flag, number, positive_int
from hpcpipe.hf.pieces import Piece
from hpcpipe.nn.kind import HFMap
from hpcpipe.nn.llama import hf as llama

ATTENTION_OF = {"mixtral": "mistral", "qwen3_moe": "qwen3"}     # whose attention and windows each type has


def keys_of(cfg: dict, label: str, model_type: str) -> dict[str, Any]:
    """Return the moe kind's [model] keys of a mixtral or qwen3_moe config.json."""
    keys = llama.keys_of(cfg, label, ATTENTION_OF[model_type])
    n_layers = keys["n_blocks"]
    experts = positive_int(cfg, "num_local_experts" if "num_local_experts" in cfg else "num_experts", label)
    top_k = positive_int(cfg, "num_experts_per_tok", label)
    if top_k > experts:
        raise ConfigError(f"{label}: num_experts_per_tok {top_k} exceeds the {experts} experts")
    if cfg.get("router_jitter_noise", 0.0):
        raise ConfigError(f"{label}: router_jitter_noise {cfg['router_jitter_noise']!r} is not supported (hpcpipe "
                          f"routes without noise)")
    coef = number(cfg, "router_aux_loss_coef", label, 0.001) if flag(cfg, "output_router_logits", label, False) \
        else 0.0
    if model_type == "mixtral":
        return {**keys, "n_experts": experts, "experts_per_token": top_k, "moe_d_ff": keys["d_ff"],
                "norm_topk_prob": True, "moe_layers": [], "router_aux_loss_coef": coef}
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        raise ConfigError(f"{label}: mlp_only_layers must be a list of layer indices, got {dense!r}")
    step = positive_int(cfg, "decoder_sparse_step", label, 1)
    sparse = [i for i in range(n_layers) if i not in dense and (i + 1) % step == 0]
    if not sparse:
        raise ConfigError(f"{label}: no layer has experts (mlp_only_layers {dense}, decoder_sparse_step {step}); "
                          f"load it as a qwen3 model")
    return {**keys, "n_experts": experts, "experts_per_token": top_k,
            "moe_d_ff": positive_int(cfg, "moe_intermediate_size", label),
            "norm_topk_prob": flag(cfg, "norm_topk_prob", label, False),
            "moe_layers": [] if len(sparse) == n_layers else sparse, "router_aux_loss_coef": coef}


def _sparse(m: dict[str, Any], index: int) -> bool:
    return 1 <= index <= m["n_blocks"] and (not m["moe_layers"] or index - 1 in m["moe_layers"])


def pieces(m: dict[str, Any], index: int) -> list[Piece]:
    """Return the tensors of layer group ``index``: the llama kind's, a sparse block's MLP its router and experts."""
    out = llama.pieces(m, index)
    if not _sparse(m, index):
        return out
    d, ff, e = m["d_model"], m["moe_d_ff"] or m["d_ff"], m["n_experts"]
    h = f"layers.{index - 1}."
    out = [p for p in out if not p.name.startswith("mlp/")]
    if m.get("qk_norm"):          # Qwen3-MoE
        names, base = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}, h + "mlp."
    else:                         # Mixtral
        names, base = {"gate": "w1", "up": "w3", "down": "w2"}, h + "block_sparse_moe."
    out.append(Piece(base + "gate.weight", "mlp/router/weight", (d, e), True))
    for x in range(e):
        for ours, theirs in names.items():
            shape = (ff, d) if ours == "down" else (d, ff)
            out.append(Piece(f"{base}experts.{x}.{theirs}.weight", f"mlp/experts/{ours}", shape, True, stack=x))
    return out


def config_json(m: dict[str, Any], special: dict[str, Any]) -> dict[str, Any]:
    """Return the config.json of a moe-kind model: Qwen3MoeForCausalLM when it has q/k norms, else
    MixtralForCausalLM (every block sparse, experts renormalised)."""
    base = llama.config_json({**m, "qkv_bias": False}, special)
    n = m["n_blocks"]
    sparse = [i for i in range(n) if _sparse(m, i + 1)]
    moe = {"num_local_experts": m["n_experts"], "num_experts_per_tok": m["experts_per_token"],
           "output_router_logits": m["router_aux_loss_coef"] > 0,
           "router_aux_loss_coef": m["router_aux_loss_coef"] or 0.001}
    if m.get("qk_norm"):
        return {**base, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **moe,
                "num_experts": m["n_experts"], "moe_intermediate_size": m["moe_d_ff"] or m["d_ff"],
                "norm_topk_prob": m["norm_topk_prob"], "decoder_sparse_step": 1,
                "mlp_only_layers": [i for i in range(n) if i not in sparse]}
    if len(sparse) != n or not m["norm_topk_prob"] or (m["moe_d_ff"] and m["moe_d_ff"] != m["d_ff"]):
        raise ConfigError("a moe-kind model without q/k norms is written as Mixtral, whose blocks are all sparse, "
                          "renormalise their experts' weights and have experts of width d_ff")
    base.pop("attention_bias", None)
    base.pop("mlp_bias", None)
    return {**base, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **moe,
            "router_jitter_noise": 0.0, "sliding_window": m.get("sliding_window") or None}


HF = HFMap(model_types=("mixtral", "qwen3_moe"), prefix="model.", keys=keys_of, pieces=pieces,
           config_json=config_json, zero_only=llama.zero_only,
           tokenizer_classes={"mixtral": "TokenizersBackend", "qwen3_moe": "Qwen2Tokenizer"})
