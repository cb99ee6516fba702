"""The GPT kind as a Hugging Face ``gpt2`` directory: config.json keys and tensor names, both ways.

GPT-2's ``Conv1D`` weights are already (in, out) as hpcpipe stores them, and its ``c_attn`` is q|k|v in
one matrix exactly as hpcpipe's ``attn/qkv``; only an untied ``lm_head.weight`` (an ``nn.Linear``) is
transposed. Anything the GPT kind would compute differently (another activation or LayerNorm epsilon,
attention scaled otherwise) is refused in one line naming the file and the value.
"""

from __future__ import annotations

from typing import Any

from hpcpipe.errors import ConfigError
from hpcpipe.hf.json_fields import flag, positive_int
from hpcpipe.hf.pieces import HEAD, Piece
from hpcpipe.nn.kind import HFMap

ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")   # both are tanh-GELU, as hpcpipe's GPT
LAYER_NORM_EPS = 1e-5


def keys_of(cfg: dict, label: str, model_type: str) -> dict[str, Any]:
    """Return the gpt kind's [model] keys of a gpt2 config.json."""
    act = cfg.get("activation_function", "gelu_new")
    if act not in ACTIVATIONS:
        raise ConfigError(f"{label}: activation_function {act!r} is not supported; hpcpipe's GPT uses tanh-GELU "
                          f"({' or '.join(ACTIVATIONS)})")
    eps = cfg.get("layer_norm_epsilon", LAYER_NORM_EPS)
    if eps != LAYER_NORM_EPS:
        raise ConfigError(f"{label}: layer_norm_epsilon {eps!r} is not supported; hpcpipe's GPT uses LayerNorm "
                          f"epsilon {LAYER_NORM_EPS}")
    for key, fine in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("add_cross_attention", False)):
        if cfg.get(key, fine) != fine:
            raise ConfigError(f"{label}: {key} {cfg[key]!r} is not supported (hpcpipe's GPT needs {fine})")
    d = positive_int(cfg, "n_embd", label)
    heads = positive_int(cfg, "n_head", label)
    if d % heads:
        raise ConfigError(f"{label}: n_embd {d} is not a multiple of n_head {heads}")
    return {"vocab_size": positive_int(cfg, "vocab_size", label), "seq_len": positive_int(cfg, "n_positions", label),
            "d_model": d, "n_heads": heads, "n_blocks": positive_int(cfg, "n_layer", label),
            "d_ff": positive_int(cfg, "n_inner", label, 4 * d),
            "tie_embeddings": flag(cfg, "tie_word_embeddings", label, True)}


def pieces(m: dict[str, Any], index: int) -> list[Piece]:
    """Return the tensors of gpt layer group ``index``."""
    d, ff, vocab, n = m["d_model"], m["d_ff"] or 4 * m["d_model"], m["vocab_size"], m["n_blocks"]
    if index == 0:
        return [Piece("wte.weight", "tok_emb", (vocab, d)), Piece("wpe.weight", "pos_emb", (m["seq_len"], d))]
    if index <= n:
        h = f"h.{index - 1}."
        return [Piece(h + "ln_1.weight", "ln1/weight", (d,)), Piece(h + "ln_1.bias", "ln1/bias", (d,)),
                Piece(h + "attn.c_attn.weight", "attn/qkv/weight", (d, 3 * d)),
                Piece(h + "attn.c_attn.bias", "attn/qkv/bias", (3 * d,)),
                Piece(h + "attn.c_proj.weight", "attn/proj/weight", (d, d)),
                Piece(h + "attn.c_proj.bias", "attn/proj/bias", (d,)),
                Piece(h + "ln_2.weight", "ln2/weight", (d,)), Piece(h + "ln_2.bias", "ln2/bias", (d,)),
                Piece(h + "mlp.c_fc.weight", "mlp/fc/weight", (d, ff)),
                Piece(h + "mlp.c_fc.bias", "mlp/fc/bias", (ff,)),
                Piece(h + "mlp.c_proj.weight", "mlp/proj/weight", (ff, d)),
                Piece(h + "mlp.c_proj.bias", "mlp/proj/bias", (d,))]
    final = [Piece("ln_f.weight", "ln_f/weight", (d,)), Piece("ln_f.bias", "ln_f/bias", (d,))]
    return final if m["tie_embeddings"] else final + [Piece(HEAD, "head/weight", (d, vocab), True)]


def config_json(m: dict[str, Any], special: dict[str, Any]) -> dict[str, Any]:
    """Return the config.json of a GPT as transformers 5.x writes it (GPT2LMHeadModel: tanh-GELU, no dropout);
    ``special``: the token ids, dtype and tying keys every kind writes."""
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": m["vocab_size"],
            "n_positions": m["seq_len"], "n_embd": m["d_model"], "n_layer": m["n_blocks"],
            "n_head": m["n_heads"], "n_inner": m["d_ff"] or 4 * m["d_model"],
            "activation_function": "gelu_new", "layer_norm_epsilon": LAYER_NORM_EPS,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "summary_first_dropout": 0.0,
            "scale_attn_weights": True, "initializer_range": 0.02, **special}


HF = HFMap(model_types=("gpt2",), prefix="transformer.", keys=keys_of, pieces=pieces, config_json=config_json,
           tokenizer_classes={"gpt2": "GPT2Tokenizer"}, lora_targets=("c_attn",))
