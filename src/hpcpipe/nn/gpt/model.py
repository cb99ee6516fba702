"""The GPT kind's model: a GPT-2 style pre-LayerNorm decoder (no dropout) over the shared decoder core.

Block: ``a = h + attn(ln1(h)); h' = a + mlp(ln2(a))`` with ``qkv = u @ Wqkv + bqkv`` split into q | k | v
(every head its own keys and values, no RoPE: positions come from ``pos_emb``) and
``mlp(u) = gelu_tanh(u @ Wfc + bfc) @ Wproj + bproj``; head: ``ln_f(h) @ (tok_emb.T | head)``.
Tensor parallelism (Megatron-style): attention by heads (``attn/qkv`` keeps the q, k and v columns of
the rank's heads, ``attn/proj`` their rows), the MLP by hidden columns (``mlp/fc`` column-, ``mlp/proj``
row-parallel), LayerNorms, ``pos_emb`` and the row-parallel biases replicated, ``tok_emb`` by vocabulary
rows and the untied head by vocabulary columns.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hpcpipe.kernels.formats import row_weight
from hpcpipe.kernels.stage import FusedBlock, FusedKind
from hpcpipe.nn.core.attention import CausalAttention, FusedQKV
from hpcpipe.nn.core.decoder_model import INIT_STD, DecoderModel
from hpcpipe.nn.core.dense import linear
from hpcpipe.nn.core.mlps import GeluMLP
from hpcpipe.nn.core.norms import EPS, LayerNorm
from hpcpipe.nn.core.sharding import REPLICATED, Shard, column_part, head_columns, row_part
from hpcpipe.nn.core.tensor_parallel import is_split
from hpcpipe.nn.gpt.shape import GPTShape, group_params


def gpt_shape(model: Any) -> GPTShape:
    """Return the GPTShape a config's [model] keys describe."""
    return GPTShape(model.vocab_size, model.seq_len, model.d_model, model.n_heads, model.n_blocks, model.d_ff,
                    model.tie_embeddings)


class GPTModel(DecoderModel):
    """A GPT-2 style decoder: embedding (tokens + positions), n_blocks blocks, final LayerNorm and head."""

    kind = "gpt"
    NORMS = ("ln1", "ln2", "ln_f")
    shape: GPTShape

    @classmethod
    def from_config(cls, config: Any) -> GPTModel:
        """The model a Config's [model] keys describe."""
        return cls(gpt_shape(config.model))

    def group_params(self, index):
        return group_params(self.shape, index)

    def group_cost(self, index):
        """Blocks count attention over the causal prefix, the head d x vocab (a large vocabulary must not pile
        onto the last stage unnoticed), the embedding a gather of d per token."""
        shape = self.shape
        d, t = shape.d_model, shape.seq_len
        if index == 0:
            return d
        if index <= shape.n_blocks:
            # qkv (3 d^2) + proj (d^2) + MLP (2 d ff) + scores and weighted values over (t + 1) / 2 keys on average
            return 4 * d * d + 2 * d * shape.ff + d * (t + 1)
        return d * shape.vocab

    def group_activations(self, index):
        """Per token, a block keeps: ln1's x_hat and output (2 d), qkv (3 d: q, k and v are views of it), one
        log-sum-exp a head (the tiled attention keeps no T x T weights), the concatenated heads (d), ln2's x_hat
        and output (2 d), the GELU's pre-activation, tanh and output (3 ff), and the two LayerNorms' 1 / std (2).
        The head keeps ln_f's x_hat and output and 1 / std (2 d + 1); the embedding its token ids."""
        shape = self.shape
        d, t = shape.d_model, shape.seq_len
        if index == 0:
            return t
        if index <= shape.n_blocks:
            return t * (8 * d + shape.n_heads + 3 * shape.ff + 2)
        return t * (2 * d + 1)

    def init_value(self, name, dims, rng):
        """Normal std 0.02 for matrices and embeddings, the residual projections (attn/proj, mlp/proj) scaled by
        1 / sqrt(2 n_blocks); biases 0; LayerNorm weights 1."""
        if name.endswith("bias"):
            return np.zeros(dims)
        if name.startswith("ln"):
            return np.ones(dims)
        std = self.residual_std() if name.endswith("proj/weight") else INIT_STD
        return rng.standard_normal(dims) * std

    def norm(self, params, grads, prefix, xp):
        return LayerNorm(params[f"{prefix}/weight"], params[f"{prefix}/bias"],
                         grads[f"{prefix}/weight"], grads[f"{prefix}/bias"], xp)

    def local_heads(self, tp):
        heads = self.shape.n_heads // (tp.size if is_split(tp) else 1)
        return heads, heads

    def attention(self, params, grads, xp, tp, index):
        heads, _ = self.local_heads(tp)
        proj = linear(params, grads, "attn/proj", xp, reduce_out=tp if is_split(tp) else None)
        return CausalAttention(FusedQKV(params, grads, xp, "attn", tp), proj, heads, heads, self.shape.head_dim,
                               None, xp)

    def mlp(self, params, grads, xp, tp, index, ep=None):
        return GeluMLP(params, grads, xp, tp=tp)

    def fused_kind(self):
        return FusedKind(norm="layer", act="gelu", rope=False, eps=EPS)

    def fused_block(self, params, fmt, index):
        p = params
        return FusedBlock(p["ln1/weight"], p["ln1/bias"], row_weight(p["attn/qkv/weight"], fmt), p["attn/qkv/bias"],
                          row_weight(p["attn/proj/weight"], fmt), p["attn/proj/bias"], p["ln2/weight"], p["ln2/bias"],
                          row_weight(p["mlp/fc/weight"], fmt), p["mlp/fc/bias"], row_weight(p["mlp/proj/weight"], fmt),
                          p["mlp/proj/bias"])

    def shards(self, index, tp, rank):
        shape = self.shape
        names = [name for name, _ in self.group_params(index)]
        out = dict.fromkeys(names, Shard(REPLICATED))
        if index == 0:
            out["tok_emb"] = row_part(shape.vocab, tp, rank)
        elif index <= shape.n_blocks:
            d = shape.d_model
            heads = head_columns(shape.n_heads, shape.head_dim, tp, rank)
            qkv = np.concatenate([np.arange(d)[heads] + part * d for part in range(3)])
            out.update({"attn/qkv/weight": Shard(1, qkv), "attn/qkv/bias": Shard(0, qkv),
                        "attn/proj/weight": Shard(0, heads), "mlp/fc/weight": column_part(shape.ff, tp, rank),
                        "mlp/fc/bias": row_part(shape.ff, tp, rank), "mlp/proj/weight": row_part(shape.ff, tp, rank)})
        elif "head/weight" in names:
            out["head/weight"] = column_part(shape.vocab, tp, rank)
        return out
