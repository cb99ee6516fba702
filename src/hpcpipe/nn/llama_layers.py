"""The layers of a Llama-family decoder (pre-RMSNorm, SwiGLU, RoPE, grouped-query attention), one per layer group.

``Embedding`` (group 0): h = tok_emb[x]. ``Block`` (groups 1..n_blocks)::

    a  = h + attn(rmsnorm(h; attn_norm)) @ Wo                        (hpcpipe.nn.gqa_attention)
    h' = a + (silu(u @ Wgate) * (u @ Wup)) @ Wdown,   u = rmsnorm(a; mlp_norm),   silu(z) = z sigmoid(z)

``OutputHead`` (group n_blocks + 1): logits = rmsnorm(h; norm) @ tok_emb.T (tied) or @ head (untied).
Every layer has ``forward(x) -> (y, cache)``, ``forward_cache``, ``backward_input(cache, g) ->
(gx, state)``, ``backward_weight(cache, state)`` and ``backward`` (both), with gradients
accumulated into the arrays given at construction (buffer views; None for forward-only use). With
tensor parallelism (``tp``, :mod:`hpcpipe.nn.sharding`) attention is split by heads, the MLP by its
hidden columns, the embedding and the head by vocabulary.
"""

from __future__ import annotations

from typing import Any

from hpcpipe.nn.gqa_attention import GQAttention
from hpcpipe.nn.layers import Activation, Dense
from hpcpipe.nn.linear import linear, rows
from hpcpipe.nn.llama_params import LlamaShape
from hpcpipe.nn.rmsnorm import RMSNorm
from hpcpipe.nn.rope import Rope, shared_rope
from hpcpipe.nn.sharding import kv_heads_of
from hpcpipe.nn.tensor_parallel import is_split, vocab_lookup, vocab_scatter_add


def rms_norm(params: dict[str, Any], grads: dict[str, Any], prefix: str, eps: float, xp: Any) -> RMSNorm:
    """Return the RMSNorm ``prefix/weight`` of a parameter group."""
    return RMSNorm(params[f"{prefix}/weight"], grads[f"{prefix}/weight"], eps, xp)


def model_rope(shape: LlamaShape, xp: Any, dtype: Any) -> Rope:
    """Return the RoPE tables of the model (shared by its blocks) in ``dtype``."""
    return shared_rope(shape.head_dim, shape.rope_theta, shape.rope_scaling, xp, dtype, shape.seq_len)


class SwiGLU:
    """``(silu(u @ Wgate) * (u @ Wup)) @ Wdown`` (``mlp/{gate,up,down}``) over (micro-batch, T, d) blocks.

    Backward, with s = sigmoid(gate), act = gate s and dh = dL/dhidden:
    d_up = dh act, d_gate = dh up (s + act (1 - s)).
    """

    def __init__(self, params: dict[str, Any], grads: dict[str, Any], xp: Any, prefix: str = "mlp", tp: Any = None):
        self.tp = tp if is_split(tp) else None      # gate and up column-parallel, down row-parallel
        self.gate = linear(params, grads, f"{prefix}/gate", xp, bias=False)
        self.up = linear(params, grads, f"{prefix}/up", xp, bias=False)
        self.down = linear(params, grads, f"{prefix}/down", xp, bias=False, reduce_out=self.tp)
        self.xp = xp

    def _hidden(self, u: Any) -> tuple[Any, tuple]:
        xp = self.xp
        x = rows(u)
        gate, c_gate = self.gate.forward(x)
        up, c_up = self.up.forward(x)
        # sigmoid(z) = (1 + tanh(z / 2)) / 2: no overflow warning for large |z|, unlike 1 / (1 + exp(-z))
        s = gate * 0.5
        xp.tanh(s, out=s)
        s += 1
        s *= 0.5
        gate *= s                                       # silu(gate), in the projection's own buffer
        return gate * up, (c_gate, c_up, s, gate, up)

    def forward(self, u: Any) -> tuple[Any, tuple]:
        """Return (MLP output, cache)."""
        hidden, cache = self._hidden(u)
        y, c_down = self.down.forward(hidden)
        return y.reshape(u.shape), (*cache, c_down)

    def forward_cache(self, u: Any) -> tuple:
        """Return only the cache of forward(u): the down projection is not computed."""
        hidden, cache = self._hidden(u)
        return (*cache, self.down.forward_cache(hidden))

    def backward_input(self, cache: tuple, g: Any, need_input_grad: bool = True) -> tuple[Any, tuple]:
        """Return (dL/du, (dL/dgate, dL/dup, dL/dy)) for backward_weight."""
        xp = self.xp
        c_gate, c_up, s, act, up, c_down = cache
        gh, dz_down = self.down.backward_input(c_down, rows(g))
        d_up = gh * act
        gh *= up
        slope = xp.subtract(1, s)                       # silu'(gate) = s + act (1 - s)
        slope *= act
        slope += s
        gh *= slope
        gu, dz_gate = self.gate.backward_input(c_gate, gh, need_input_grad)
        gu_up, dz_up = self.up.backward_input(c_up, d_up, need_input_grad)
        if need_input_grad:
            gu += gu_up
            if self.tp is not None:     # one sum of gate's and up's partial input gradients
                self.tp.sum_(gu)
            gu = gu.reshape(g.shape)
        return gu, (dz_gate, dz_up, dz_down)

    def backward_weight(self, cache: tuple, state: tuple) -> None:
        """Accumulate the gradients of mlp/gate, mlp/up and mlp/down."""
        self.gate.backward_weight(cache[0], state[0])
        self.up.backward_weight(cache[1], state[1])
        self.down.backward_weight(cache[5], state[2])

    def backward(self, cache: tuple, g: Any, need_input_grad: bool = True) -> Any:
        """Accumulate the weight gradients and return dL/du."""
        gu, state = self.backward_input(cache, g, need_input_grad)
        self.backward_weight(cache, state)
        return gu


class Block:
    """One pre-RMSNorm decoder block: ``a = h + attn(norm(h)); y = a + mlp(norm(a))``."""

    def __init__(self, params: dict[str, Any], grads: dict[str, Any], shape: LlamaShape, xp: Any, tp: Any = None):
        rope = model_rope(shape, xp, params["attn/q/weight"].dtype)
        size, rank = (tp.size, tp.rank) if tp is not None else (1, 0)
        kv = len(kv_heads_of(shape.n_heads, shape.n_kv_heads, size, rank))    # the kv heads this rank holds
        self.attn_norm = rms_norm(params, grads, "attn_norm", shape.norm_eps, xp)
        self.attn = GQAttention(params, grads, shape.n_heads // size, kv, rope, xp, tp=tp)
        self.mlp_norm = rms_norm(params, grads, "mlp_norm", shape.norm_eps, xp)
        self.mlp = SwiGLU(params, grads, xp, tp=tp)

    def forward(self, h: Any) -> tuple[Any, tuple]:
        """Return (block output, cache) for a (micro-batch, T, d) block."""
        u1, c_n1 = self.attn_norm.forward(h)
        a, c_attn = self.attn.forward(u1)
        a += h                                          # the attention output is a fresh array
        u2, c_n2 = self.mlp_norm.forward(a)
        y, c_mlp = self.mlp.forward(u2)
        y += a
        return y, (c_n1, c_attn, c_n2, c_mlp)

    def forward_cache(self, h: Any) -> tuple:
        """Return only the cache of forward(h) (recomputation): the MLP's down projection is skipped."""
        u1, c_n1 = self.attn_norm.forward(h)
        a, c_attn = self.attn.forward(u1)
        a += h
        u2, c_n2 = self.mlp_norm.forward(a)
        return c_n1, c_attn, c_n2, self.mlp.forward_cache(u2)

    def backward_input(self, cache: tuple, g: Any, need_input_grad: bool = True) -> tuple[Any, tuple]:
        """Return (dL/dh, the sub-layers' states for backward_weight)."""
        c_n1, c_attn, c_n2, c_mlp = cache
        g_u2, s_mlp = self.mlp.backward_input(c_mlp, g)
        g_a, s_n2 = self.mlp_norm.backward_input(c_n2, g_u2)
        g_a += g                                        # the residual around the MLP
        g_u1, s_attn = self.attn.backward_input(c_attn, g_a)
        g_h, s_n1 = self.attn_norm.backward_input(c_n1, g_u1)
        g_h += g_a                                      # the residual around attention
        return g_h, (s_n1, s_attn, s_n2, s_mlp)

    def backward_weight(self, cache: tuple, state: tuple) -> None:
        """Accumulate the gradients of every parameter of the block."""
        for layer, c, s in zip((self.attn_norm, self.attn, self.mlp_norm, self.mlp), cache, state, strict=True):
            layer.backward_weight(c, s)

    def backward(self, cache: tuple, g: Any, need_input_grad: bool = True) -> Any:
        """Accumulate the weight gradients and return dL/dh."""
        gh, state = self.backward_input(cache, g)
        self.backward_weight(cache, state)
        return gh


class Embedding:
    """``tok_emb[tokens]`` for integer tokens of shape (micro-batch, T); positions enter through RoPE."""

    def __init__(self, params: dict[str, Any], grads: dict[str, Any], seq_len: int, xp: Any, tp: Any = None,
                 lo: int = 0):
        self.tok_emb, self.grad_tok_emb = params["tok_emb"], grads["tok_emb"]
        self.seq_len = seq_len
        self.xp = xp
        self.tp, self.lo = tp, lo      # this rank's rows of tok_emb are token ids [lo, lo + rows)

    def forward(self, tokens: Any) -> tuple[Any, Any]:
        """Return ((micro-batch, T, d) embeddings, cache = tokens)."""
        if tokens.shape[1] > self.seq_len:
            raise ValueError(f"sequence of {tokens.shape[1]} tokens is longer than the {self.seq_len} positions")
        return vocab_lookup(self.xp, self.tok_emb, tokens, self.lo, self.tp), tokens

    def forward_cache(self, tokens: Any) -> Any:
        """Return only the cache of forward(tokens): the tokens."""
        return tokens

    def backward_input(self, cache: Any, g: Any, need_input_grad: bool = True) -> tuple[None, Any]:
        """Return (None: tokens have no gradient, dL/dy for backward_weight)."""
        return None, g

    def backward_weight(self, cache: Any, g: Any) -> None:
        """Accumulate dL/dtok_emb (a repeated token sums its rows)."""
        # add.at, unlike ``grad[tokens] += rows``, adds every occurrence of a repeated token
        vocab_scatter_add(self.xp, self.grad_tok_emb, cache, rows(g), self.lo, self.tp)

    def backward(self, cache: Any, g: Any, need_input_grad: bool = True) -> None:
        """Accumulate the embedding gradient; return None (no input gradient)."""
        self.backward_weight(cache, g)


class OutputHead:
    """``rmsnorm(h) @ tok_emb.T`` (tied: accumulates into tok_emb's gradient) or ``rmsnorm(h) @ head`` (untied)."""

    def __init__(self, params: dict[str, Any], grads: dict[str, Any], eps: float, xp: Any,
                 tok_emb: Any = None, grad_tok_emb: Any = None, tp: Any = None):
        self.norm = rms_norm(params, grads, "norm", eps, xp)
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


def build_layer(shape: LlamaShape, index: int, params: dict[str, Any], grads: dict[str, Any], xp: Any,
                tok_emb: Any = None, grad_tok_emb: Any = None, tp: Any = None,
                lo: int = 0) -> Embedding | Block | OutputHead:
    """Return the layer of group ``index`` over its parameter and gradient views (tok_emb: for a tied head;
    tp: the stage's tensor-parallel group, lo: the first token id of this rank's vocabulary part)."""
    if index == 0:
        return Embedding(params, grads, shape.seq_len, xp, tp, lo)
    if index <= shape.n_blocks:
        return Block(params, grads, shape, xp, tp)
    return OutputHead(params, grads, shape.norm_eps, xp, tok_emb, grad_tok_emb, tp)
