"""The layer groups every decoder kind is made of: embedding, pre-norm block, final norm + head.

``Embedding`` (group 0): h = tok_emb[x] (+ pos_emb[0:T] for a kind with a position table). ``Block``
(groups 1..n_blocks), from a kind's norms, attention and MLP::

    a  = h + attn(norm1(h))
    h' = a + mlp(norm2(a))

``OutputHead`` (group n_blocks + 1): logits = norm(h) @ tok_emb.T (tied) or norm(h) @ head (untied).
Every layer has ``forward(x) -> (y, cache)``, ``forward_cache``, ``backward_input(cache, g) ->
(gx, state)``, ``backward_weight(cache, state)`` and ``backward`` (both), with gradients accumulated into
the arrays given at construction (buffer views; None for forward-only use). With tensor parallelism
(``tp``: the stage's group; :mod:`hpcpipe.nn.core.sharding`) the blocks are split Megatron-style by their
parts, and the embedding and head by vocabulary (rank r holds token ids [lo, lo + rows)).
"""

from __future__ import annotations

from typing import Any

from hpcpipe.nn.core.activations import Activation
from hpcpipe.nn.core.dense import Dense, linear, rows
from hpcpipe.nn.core.tensor_parallel import is_split, vocab_lookup, vocab_scatter_add


class Block:
    """One pre-norm decoder block: ``a = h + attn(norm1(h)); y = a + mlp(norm2(a))``."""

    def __init__(self, norm1: Any, attn: Any, norm2: Any, mlp: Any):
        self.norm1, self.attn, self.norm2, self.mlp = norm1, attn, norm2, mlp

    def forward(self, h: Any) -> tuple[Any, tuple]:
        """Return (block output, cache) for a (micro-batch, T, d) block."""
        u1, c_n1 = self.norm1.forward(h)
        a, c_attn = self.attn.forward(u1)
        a += h                                          # the attention output is a fresh array
        u2, c_n2 = self.norm2.forward(a)
        y, c_mlp = self.mlp.forward(u2)
        y += a
        return y, (c_n1, c_attn, c_n2, c_mlp)

    def forward_cache(self, h: Any) -> tuple:
        """Return only the cache of forward(h) (recomputation): the MLP's last projection is skipped."""
        u1, c_n1 = self.norm1.forward(h)
        a, c_attn = self.attn.forward(u1)
        a += h
        u2, c_n2 = self.norm2.forward(a)
        return c_n1, c_attn, c_n2, self.mlp.forward_cache(u2)

    def backward_input(self, cache: tuple, g: Any, need_input_grad: bool = True) -> tuple[Any, tuple]:
        """Return (dL/dh, the sub-layers' states for backward_weight)."""
        c_n1, c_attn, c_n2, c_mlp = cache
        g_u2, s_mlp = self.mlp.backward_input(c_mlp, g)
        g_a, s_n2 = self.norm2.backward_input(c_n2, g_u2)
        g_a += g                                        # the residual around the MLP
        g_u1, s_attn = self.attn.backward_input(c_attn, g_a)
        g_h, s_n1 = self.norm1.backward_input(c_n1, g_u1)
        g_h += g_a                                      # the residual around attention
        return g_h, (s_n1, s_attn, s_n2, s_mlp)

    def backward_weight(self, cache: tuple, state: tuple) -> None:
        """Accumulate the gradients of every parameter of the block."""
        for layer, c, s in zip((self.norm1, self.attn, self.norm2, self.mlp), cache, state, strict=True):
            layer.backward_weight(c, s)

    def backward(self, cache: tuple, g: Any, need_input_grad: bool = True) -> Any:
        """Accumulate the weight gradients and return dL/dh."""
        gh, state = self.backward_input(cache, g)
        self.backward_weight(cache, state)
        return gh


class Embedding:
    """``tok_emb[tokens]`` (+ ``pos_emb[0:T]`` when the group has one) for integer tokens (micro-batch, T)."""

    def __init__(self, params: dict[str, Any], grads: dict[str, Any], seq_len: int, xp: Any, tp: Any = None,
                 lo: int = 0):
        self.tok_emb, self.grad_tok_emb = params["tok_emb"], grads["tok_emb"]
        self.pos_emb, self.grad_pos_emb = params.get("pos_emb"), grads.get("pos_emb")
        self.seq_len = seq_len
        self.xp = xp
        self.tp, self.lo = tp, lo      # this rank's rows of tok_emb are token ids [lo, lo + rows)

    def forward(self, tokens: Any) -> tuple[Any, Any]:
        """Return ((micro-batch, T, d) embeddings, cache = tokens)."""
        t = tokens.shape[1]
        if t > self.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than the {self.seq_len} positions")
        h = vocab_lookup(self.xp, self.tok_emb, tokens, self.lo, self.tp)
        if self.pos_emb is not None:
            h += self.pos_emb[:t]
        return h, tokens

    def forward_cache(self, tokens: Any) -> Any:
        """Return only the cache of forward(tokens): the tokens."""
        return tokens

    def backward_input(self, cache: Any, g: Any, need_input_grad: bool = True) -> tuple[None, Any]:
        """Return (None: tokens have no gradient, dL/dy for backward_weight)."""
        return None, g

    def backward_weight(self, cache: Any, g: Any) -> None:
        """Accumulate dL/dtok_emb (a repeated token sums its rows) and dL/dpos_emb."""
        # add.at, unlike ``grad[tokens] += rows``, adds every occurrence of a repeated token (CuPy >= 12 has
        # ufunc.at for add; cupyx.scatter_add is the same operation on older CuPy)
        vocab_scatter_add(self.xp, self.grad_tok_emb, cache, rows(g), self.lo, self.tp)
        if self.grad_pos_emb is not None:
            self.grad_pos_emb[:g.shape[1]] += g.sum(axis=0)

    def backward(self, cache: Any, g: Any, need_input_grad: bool = True) -> None:
        """Accumulate the embedding gradients; return None (no input gradient)."""
        self.backward_weight(cache, g)


class OutputHead:
    """``norm(h) @ tok_emb.T`` (tied: accumulates into tok_emb's gradient) or ``norm(h) @ head`` (untied)."""

    def __init__(self, norm: Any, params: dict[str, Any], grads: dict[str, Any], xp: Any,
                 tok_emb: Any = None, grad_tok_emb: Any = None, tp: Any = None):
        self.norm = norm
        tied = "head/weight" not in params
        if tied and tok_emb is None:
            raise ValueError("a tied output head needs tok_emb (and its gradient, for training)")
        split = tp if is_split(tp) else None    # vocabulary-parallel: its input gradient is summed over tp
        if tied:
            # transposed views: the head reads tok_emb and accumulates into its gradient in place
            self.head = Dense(-1, tok_emb.T, None, None if grad_tok_emb is None else grad_tok_emb.T, None,
                              Activation(), xp, reduce_input_grad=split)
        else:
            self.head = linear(params, grads, "head", xp, bias=False, reduce_input_grad=split)
        self.tied = tied

    def forward(self, h: Any) -> tuple[Any, tuple]:
        """Return ((micro-batch, T, vocab) logits, cache)."""
        u, c_norm = self.norm.forward(h)
        logits, c_head = self.head.forward(rows(u))
        return logits.reshape(*h.shape[:-1], -1), (c_norm, c_head)

    def forward_cache(self, h: Any) -> tuple:
        """Return only the cache of forward(h) (recomputation): the logits are not computed."""
        u, c_norm = self.norm.forward(h)
        return c_norm, self.head.forward_cache(rows(u))

    def backward_input(self, cache: tuple, g: Any, need_input_grad: bool = True) -> tuple[Any, tuple[Any, Any]]:
        """Return (dL/dh, (norm state, dL/dlogits)) for backward_weight."""
        g_u, dz_head = self.head.backward_input(cache[1], rows(g))
        gh, s_norm = self.norm.backward_input(cache[0], g_u.reshape(*g.shape[:-1], -1))
        return gh, (s_norm, dz_head)

    def backward_weight(self, cache: tuple, state: tuple[Any, Any]) -> None:
        """Accumulate the gradients of the norm and of the head (tok_emb's when tied)."""
        self.norm.backward_weight(cache[0], state[0])
        self.head.backward_weight(cache[1], state[1])

    def backward(self, cache: tuple, g: Any, need_input_grad: bool = True) -> Any:
        """Accumulate the weight gradients and return dL/dh."""
        gh, state = self.backward_input(cache, g)
        self.backward_weight(cache, state)
        return gh
