"""transformers' own mixture-of-experts models as the reference of the moe kind: tiny random Qwen3-MoE and Mixtral
directories, and PyTorch autograd through them (float64, the experts' eager loop) mapped onto hpcpipe's names."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from support.hf import bytelevel_tokenizer, save_model, save_tokenizer, tiny_model

# 4 experts (2 a rank at ep = 2), top-2; Qwen3-MoE with a dense block between (mlp_only_layers) and unnormalised
# weights, Mixtral renormalised; untied heads
ARCHS = {"qwen3_moe": {"tie_word_embeddings": False}, "mixtral": {"tie_word_embeddings": False}}


def moe_directory(arch: str, directory: Path, seed: int = 0, **overrides):
    """Save a tiny random ``arch`` model (transformers') and a byte-level tokenizer into directory; return (the
    float32 model, directory)."""
    tok = bytelevel_tokenizer(["<|endoftext|>"], vocab_size=300)
    model = tiny_model(arch, seed=seed, vocab_size=tok.get_vocab_size(), eos_token_id=0, bos_token_id=0,
                       **{**ARCHS[arch], **overrides})
    save_model(model, directory)
    save_tokenizer(tok, directory, eos_token="<|endoftext|>")
    return model, Path(directory)


def _t(grad) -> np.ndarray:
    return grad.detach().numpy().T.copy()


def hf_grads(model) -> list[dict[str, np.ndarray]]:
    """The gradients of a transformers Qwen3-MoE / Mixtral model by hpcpipe layer group and parameter name."""
    base = model.model
    groups = [{"tok_emb": base.embed_tokens.weight.grad.numpy().copy()}]
    for layer in base.layers:
        attn, mlp = layer.self_attn, layer.mlp
        g = {"attn_norm/weight": layer.input_layernorm.weight.grad.numpy().copy(),
             "mlp_norm/weight": layer.post_attention_layernorm.weight.grad.numpy().copy()}
        for x in "qkvo":
            g[f"attn/{x}/weight"] = _t(getattr(attn, f"{x}_proj").weight.grad)
        if getattr(attn, "q_norm", None) is not None:
            g["attn/q_norm/weight"] = attn.q_norm.weight.grad.numpy().copy()
            g["attn/k_norm/weight"] = attn.k_norm.weight.grad.numpy().copy()
        if hasattr(mlp, "experts"):
            gate_up = mlp.experts.gate_up_proj.grad.numpy()            # (E, 2 ff, d): gate rows, then up rows
            ff = gate_up.shape[1] // 2
            g["mlp/router/weight"] = _t(mlp.gate.weight.grad)
            g["mlp/experts/gate"] = gate_up[:, :ff].transpose(0, 2, 1).copy()
            g["mlp/experts/up"] = gate_up[:, ff:].transpose(0, 2, 1).copy()
            g["mlp/experts/down"] = mlp.experts.down_proj.grad.numpy().transpose(0, 2, 1).copy()
        else:
            for x in ("gate", "up", "down"):
                g[f"mlp/{x}/weight"] = _t(getattr(mlp, f"{x}_proj").weight.grad)
        groups.append(g)
    last = {"norm/weight": base.norm.weight.grad.numpy().copy()}
    if not model.config.tie_word_embeddings:
        last["head/weight"] = _t(model.lm_head.weight.grad)
    return groups + [last]


@contextmanager
def wide_float(model):
    """Run transformers' modeling code of ``model`` with its float32 casts made float64.

    Even a float64 model computes its router softmax, RMSNorm and RoPE angles in float32 (``dtype=torch.float``,
    ``.to(torch.float32)``, ``.float()``: the right choice for bf16 weights), which caps agreement near 1e-7
    relative; here those names mean float64, and the RoPE frequencies are recomputed in float64, so that the
    reference is the same code in float64 throughout.
    """
    import torch

    module = sys.modules[type(model).__module__]

    class Wide:
        float = float32 = torch.float64

        def __getattr__(self, name):
            return getattr(torch, name)

    saved, saved_float = module.torch, torch.Tensor.float
    module.torch, torch.Tensor.float = Wide(), lambda self, *a, **k: self.double()
    for rotary in [m for m in model.modules() if hasattr(m, "inv_freq")]:
        dim = 2 * rotary.inv_freq.numel()
        theta = model.config.rope_parameters["rope_theta"]
        rotary.inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    try:
        yield
    finally:
        module.torch, torch.Tensor.float = saved, saved_float


def torch_moe(model, tokens: np.ndarray, targets: np.ndarray,
              chunks: int = 1) -> tuple[float, list[dict[str, np.ndarray]]]:
    """(mean cross-entropy over every target token, gradients by group) of a transformers MoE model in float64;
    with ``output_router_logits`` the model's router_aux_loss_coef times transformers' load-balancing loss, averaged
    over ``chunks`` equal runs of samples (hpcpipe's (replica, micro-batch) chunks)."""
    import copy

    import torch
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    m = copy.deepcopy(model).double()
    m.config._experts_implementation = "eager"      # the grouped product kernel has no float64
    m.zero_grad()
    aux = bool(getattr(m.config, "output_router_logits", False))
    with wide_float(m):
        out = m(torch.as_tensor(tokens, dtype=torch.long), output_router_logits=aux)
    logits = out.logits
    assert logits.dtype == torch.float64
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             torch.as_tensor(targets, dtype=torch.long).reshape(-1))
    if aux:
        b, t = tokens.shape
        n_experts = out.router_logits[0].shape[-1]
        per = b // chunks
        balance = sum(load_balancing_loss_func(
            tuple(r.reshape(b, t, n_experts)[c * per:(c + 1) * per].reshape(-1, n_experts) for r in out.router_logits),
            n_experts, m.config.num_experts_per_tok) for c in range(chunks)) / chunks
        loss = loss + m.config.router_aux_loss_coef * balance
    loss.backward()
    return loss.item(), hf_grads(m)
