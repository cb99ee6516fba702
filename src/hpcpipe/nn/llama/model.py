"""The llama kind's model: a Llama-family decoder (pre-RMSNorm, RoPE, grouped-query attention, SwiGLU).

Block::

    a  = h + attn(rmsnorm(h; attn_norm)) @ Wo            (q, k, v = u @ Wq, u @ Wk, u @ Wv (+ biases), q and k
                                                           rotated: hpcpipe.nn.core.attention)
    h' = a + (silu(u @ Wgate) * (u @ Wup)) @ Wdown,   u = rmsnorm(a; mlp_norm)

head: ``rmsnorm(h; norm) @ (tok_emb.T | head)``; positions enter through RoPE only (no table). Tensor
parallelism: q by query heads; k and v by key/value heads when tp divides n_kv_heads, else each rank holds
the kv heads its query heads use (``shared``: their gradients summed over those ranks); gate and up
column-, down and o row-parallel; norms replicated; tok_emb by vocabulary rows, an untied head by columns.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hpcpipe.errors import ConfigError
from hpcpipe.kernels.formats import row_weight, stacked
from hpcpipe.kernels.stage import FusedBlock, FusedKind
from hpcpipe.nn.core.attention import CausalAttention, SplitQKV
from hpcpipe.nn.core.decoder_model import INIT_STD, DecoderModel
from hpcpipe.nn.core.dense import linear
from hpcpipe.nn.core.mlps import SwiGLU
from hpcpipe.nn.core.norms import RMSNorm
from hpcpipe.nn.core.rope import Rope, shared_rope
from hpcpipe.nn.core.sharding import REPLICATED, Shard, column_part, head_columns, kv_heads_of, row_part
from hpcpipe.nn.core.tensor_parallel import is_split
from hpcpipe.nn.llama.shape import LlamaShape, group_params


def llama_shape(model: Any) -> LlamaShape:
    """Return the LlamaShape a config's [model] keys describe."""
    return LlamaShape(model.vocab_size, model.seq_len, model.d_model, model.n_heads, model.n_blocks, model.d_ff,
                      model.tie_embeddings, model.n_kv_heads, model.head_dim, model.rope_theta,
                      dict(model.rope_scaling) or None, model.norm_eps, model.qkv_bias, model.qk_norm,
                      model.sliding_window, tuple(model.sliding_layers))


class LlamaModel(DecoderModel):
    """A Llama-family decoder: embedding, n_blocks blocks (RMSNorm, RoPE, GQA, SwiGLU), final norm and head."""

    kind = "llama"
    NORMS = ("attn_norm", "mlp_norm", "norm")
    shape: LlamaShape

    @classmethod
    def from_config(cls, config: Any) -> LlamaModel:
        """The model a Config's [model] keys describe."""
        try:
            return cls(llama_shape(config.model))
        except ValueError as exc:     # a combination the key checks do not see (e.g. rope_theta in rope_scaling)
            raise ConfigError(f"model: {exc}") from None

    def group_params(self, index):
        return group_params(self.shape, index)

    def group_cost(self, index):
        """As the GPT's: attention over the causal prefix, the head d x vocab, the embedding a gather."""
        shape = self.shape
        d, t, qw, kvw = shape.d_model, shape.seq_len, shape.q_width, shape.kv_width
        if index == 0:
            return d
        if index <= shape.n_blocks:
            return 2 * d * qw + 2 * d * kvw + 3 * d * shape.ff + qw * (t + 1)
        return d * shape.vocab

    def group_activations(self, index):
        """Per token, a block keeps: the two RMSNorms' inputs and outputs (4 d), q, k and v (q_width + 2 kv_width),
        one log-sum-exp a head (nothing T x T: tiled attention), the heads (q_width), the gate, up, silu and
        product (4 ff), and the norms' 1 / rms (2)."""
        shape = self.shape
        d, t = shape.d_model, shape.seq_len
        if index == 0:
            return t
        if index <= shape.n_blocks:
            # q/k norms keep their normalized heads and one 1 / rms a head
            qk = shape.q_width + shape.kv_width + shape.n_heads + shape.n_kv_heads if shape.qk_norm else 0
            return t * (4 * d + 2 * shape.q_width + 2 * shape.kv_width + shape.n_heads + 4 * shape.ff + 2 + qk)
        return t * (2 * d + 1)

    def init_value(self, name, dims, rng):
        """Normal std 0.02 for matrices and the embedding, the residual projections (attn/o, mlp/down) scaled by
        1 / sqrt(2 n_blocks) as the GPT's; biases 0; norm weights 1."""
        if name.endswith("bias"):
            return np.zeros(dims)
        if "norm/" in name:
            return np.ones(dims)
        std = self.residual_std() if name in ("attn/o/weight", "mlp/down/weight") else INIT_STD
        return rng.standard_normal(dims) * std

    def norm(self, params, grads, prefix, xp):
        return RMSNorm(params[f"{prefix}/weight"], grads[f"{prefix}/weight"], self.shape.norm_eps, xp)

    def rope(self, xp: Any, dtype: Any) -> Rope:
        """The model's RoPE tables (shared by its blocks) in ``dtype``."""
        shape = self.shape
        return shared_rope(shape.head_dim, shape.rope_theta, shape.rope_scaling, xp, dtype, shape.seq_len)

    def local_heads(self, tp):
        size, rank = (tp.size, tp.rank) if is_split(tp) else (1, 0)
        shape = self.shape
        return shape.n_heads // size, len(kv_heads_of(shape.n_heads, shape.n_kv_heads, size, rank))

    def window(self, index):
        return self.shape.window(index)

    def attention(self, params, grads, xp, tp, index):
        heads, kv = self.local_heads(tp)
        qkv = SplitQKV(params, grads, xp, "attn", tp, bias="attn/q/bias" in params)
        o = linear(params, grads, "attn/o", xp, bias=False, reduce_out=tp if is_split(tp) else None)
        norms = (self.norm(params, grads, "attn/q_norm", xp), self.norm(params, grads, "attn/k_norm", xp)) \
            if self.shape.qk_norm else (None, None)
        return CausalAttention(qkv, o, heads, kv, self.shape.head_dim, self.rope(xp, qkv.weight.dtype), xp, *norms,
                               window=self.shape.window(index))

    def mlp(self, params, grads, xp, tp, index, ep=None):
        return SwiGLU(params, grads, xp, tp=tp)

    def fused_kind(self):
        return FusedKind(norm="rms", act="swiglu", rope=True, eps=self.shape.norm_eps, qk_eps=self.shape.norm_eps)

    def fused_block(self, params, fmt, index):
        p = params
        bias = np.concatenate([p[f"attn/{x}/bias"] for x in "qkv"]) if "attn/q/bias" in p else None
        return FusedBlock(p["attn_norm/weight"], None, stacked([row_weight(p[f"attn/{x}/weight"], fmt) for x in "qkv"]),
                          bias, row_weight(p["attn/o/weight"], fmt), None, p["mlp_norm/weight"], None,
                          stacked([row_weight(p[f"mlp/{x}/weight"], fmt) for x in ("gate", "up")]), None,
                          row_weight(p["mlp/down/weight"], fmt), None, p.get("attn/q_norm/weight"),
                          p.get("attn/k_norm/weight"), self.shape.window(index))

    def shards(self, index, tp, rank):
        shape = self.shape
        names = [name for name, _ in self.group_params(index)]
        out = dict.fromkeys(names, Shard(REPLICATED))
        if index == 0:
            out["tok_emb"] = row_part(shape.vocab, tp, rank)
        elif index <= shape.n_blocks:
            hd = shape.head_dim
            q = head_columns(shape.n_heads, hd, tp, rank)
            kv = kv_heads_of(shape.n_heads, shape.n_kv_heads, tp, rank)
            kv_cols = slice(kv.start * hd, kv.stop * hd)
            shared = tuple(r for r in range(tp) if kv_heads_of(shape.n_heads, shape.n_kv_heads, tp, r) == kv) \
                if tp > shape.n_kv_heads else ()
            out.update({"attn/q/weight": Shard(1, q), "attn/o/weight": Shard(0, q),
                        "attn/k/weight": Shard(1, kv_cols, shared), "attn/v/weight": Shard(1, kv_cols, shared),
                        "mlp/gate/weight": column_part(shape.ff, tp, rank),
                        "mlp/up/weight": column_part(shape.ff, tp, rank),
                        "mlp/down/weight": row_part(shape.ff, tp, rank)})
            if "attn/q/bias" in names:
                out.update({"attn/q/bias": Shard(0, q), "attn/k/bias": Shard(0, kv_cols, shared),
                            "attn/v/bias": Shard(0, kv_cols, shared)})
            if "attn/q_norm/weight" in names:      # every rank's heads add to these norms' gradients: summed
                every = tuple(range(tp))
                out.update({"attn/q_norm/weight": Shard(REPLICATED, shared=every),
                            "attn/k_norm/weight": Shard(REPLICATED, shared=every)})
        elif "head/weight" in names:
            out["head/weight"] = column_part(shape.vocab, tp, rank)
        return out
