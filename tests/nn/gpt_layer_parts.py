"""What the test_gpt_* layer files share: the GPT's layers of one group built from given parameters, and
parameters far from the init."""

import numpy as np

from hpcpipe.nn.core.attention import CausalAttention, FusedQKV
from hpcpipe.nn.core.dense import linear
from hpcpipe.nn.gpt.model import GPTModel
from hpcpipe.nn.gpt.shape import group_params


def gpt_attention(params, grads, n_heads, xp):
    """The GPT's attention over ``n_heads`` heads of the group's qkv (attn/qkv, attn/proj)."""
    width = params["attn/proj/weight"].shape[0]
    return CausalAttention(FusedQKV(params, grads, xp, "attn", None), linear(params, grads, "attn/proj", xp),
                           n_heads, n_heads, width // n_heads, None, xp)


def gpt_block(params, grads, shape, xp):
    """The GPT block of the group's parameters."""
    return GPTModel(shape).block(params, grads, xp)


def gpt_head(shape, params, grads, xp, tok_emb=None, grad_tok_emb=None):
    """The final norm and output head (tied to ``tok_emb`` when given)."""
    return GPTModel(shape).build_layer(shape.n_blocks + 1, params, grads, xp, tok_emb, grad_tok_emb)


def random_group(shape, index, rng):
    """Parameters of group ``index`` far from the init (LayerNorm weights != 1, biases != 0) so every term counts."""
    params = {}
    for name, dims in group_params(shape, index):
        value = rng.standard_normal(dims) * 0.3
        params[name] = value + 1.0 if name.startswith("ln") and name.endswith("weight") else value
    return params, {name: np.zeros_like(v) for name, v in params.items()}
