"""The layers of a GPT-2 style decoder (pre-LayerNorm, no dropout), one per HDF5 layer group.

``Embedding`` (group 0): h = tok_emb[x] + pos_emb[0:T]. ``Block`` (groups
1..n_blocks): a = h + attn(ln1(h)); h' = a + mlp(ln2(a)) with
mlp(u) = gelu_tanh(u @ Wfc + bfc) @ Wmp + bmp. ``OutputHead`` (group
n_blocks + 1): logits = ln_f(h) @ tok_emb.T (tied) or ln_f(h) @ head (untied).
Every layer has ``forward(x) -> (y, cache)``, ``backward_input(cache, g) ->
(gx, state)``, ``backward_weight(cache, state)`` and ``backward`` (both), with
gradients accumulated into the arrays given at construction (buffer views). With tensor parallelism
(``tp``: the stage's group, :mod:`hpcpipe.nn.sharding` says which part of each parameter a rank holds)
the blocks are split Megatron-style and the embedding and head by vocabulary.
"""

from __future__ import annotations

from typing import Any

from hpcpipe.nn.attention import CausalSelfAttention
from hpcpipe.nn.gpt_params import GPTShape
from hpcpipe.nn.layers import GELU, Activation, Dense
from hpcpipe.nn.linear import linear, rows
from hpcpipe.nn.norm import LayerNorm
from hpcpipe.nn.tensor_parallel import is_split, vocab_lookup, vocab_scatter_add


def layer_norm(params: dict[str, Any], grads: dict[str, Any], prefix: str, xp: Any) -> LayerNorm:
    """Return the LayerNorm ``prefix/{weight,bias}`` of a parameter group."""
    return LayerNorm(params[f"{prefix}/weight"], params[f"{prefix}/bias"],
                     grads[f"{prefix}/weight"], grads[f"{prefix}/bias"], xp)


class GeluMLP:
    """``gelu_tanh(u @ Wfc + bfc) @ Wmp + bmp`` (``mlp/fc``, ``mlp/proj``) over (micro-batch, T, d) blocks."""

    def __init__(self, params: dict[str, Any], grads: dict[str, Any], xp: Any, prefix: str = "mlp", tp: Any = None):
        fc = f"{prefix}/fc"
        split = tp if is_split(tp) else None     # fc column-parallel, proj row-parallel
        self.fc = Dense(-1, params[f"{fc}/weight"], params[f"{fc}/bias"], grads[f"{fc}/weight"],
                        grads[f"{fc}/bias"], GELU(), xp, reduce_input_grad=split)
        self.proj = linear(params, grads, f"{prefix}/proj", xp, reduce_out=split)

    def forward(self, u: Any) -> tuple[Any, tuple]:
        """Return (MLP output, cache)."""
        hidden, fc_cache = self.fc.forward(rows(u))
        y, proj_cache = self.proj.forward(hidden)
        return y.reshape(u.shape), (fc_cache, proj_cache)

    def forward_cache(self, u: Any) -> tuple:
        """Return only the cache of forward(u): the projection's output is not computed."""
        hidden, fc_cache = self.fc.forward(rows(u))
        return fc_cache, self.proj.forward_cache(hidden)

    def backward_input(self, cache: tuple, g: Any) -> tuple[Any, tuple[Any, Any]]:
        """Return (dL/du, (dL/d fc pre-activation, dL/dy)) for backward_weight."""
        g_hidden, dz_proj = self.proj.backward_input(cache[1], rows(g))
        gu, dz_fc = self.fc.backward_input(cache[0], g_hidden)
        return gu.reshape(g.shape), (dz_fc, dz_proj)

    def backward_weight(self, cache: tuple, state: tuple[Any, Any]) -> None:
        """Accumulate the gradients of mlp/fc and mlp/proj."""
        self.fc.backward_weight(cache[0], state[0])
        self.proj.backward_weight(cache[1], state[1])

    def backward(self, cache: tuple, g: Any) -> Any:
        """Accumulate the weight gradients and return dL/du."""
        gu, state = self.backward_input(cache, g)
        self.backward_weight(cache, state)
        return gu


class Block:
    """One pre-LN decoder block: ``a = h + attn(ln1(h)); y = a + mlp(ln2(a))``."""

    def __init__(self, params: dict[str, Any], grads: dict[str, Any], n_heads: int, xp: Any, tp: Any = None):
        size = tp.size if tp is not None else 1
        self.ln1 = layer_norm(params, grads, "ln1", xp)
        self.attn = CausalSelfAttention(params, grads, n_heads // size, xp, tp=tp)
        self.ln2 = layer_norm(params, grads, "ln2", xp)
        self.mlp = GeluMLP(params, grads, xp, tp=tp)

    def forward(self, h: Any) -> tuple[Any, tuple]:
        """Return (block output, cache) for a (micro-batch, T, d) block."""
        u1, c_ln1 = self.ln1.forward(h)
        attn_out, c_attn = self.attn.forward(u1)
        a = h + attn_out
        u2, c_ln2 = self.ln2.forward(a)
        mlp_out, c_mlp = self.mlp.forward(u2)
        return a + mlp_out, (c_ln1, c_attn, c_ln2, c_mlp)

    def forward_cache(self, h: Any) -> tuple:
        """Return only the cache of forward(h) (recomputation): the MLP's output projection is skipped."""
        u1, c_ln1 = self.ln1.forward(h)
        attn_out, c_attn = self.attn.forward(u1)
        attn_out += h
        u2, c_ln2 = self.ln2.forward(attn_out)
        return c_ln1, c_attn, c_ln2, self.mlp.forward_cache(u2)

    def backward_input(self, cache: tuple, g: Any, need_input_grad: bool = True) -> tuple[Any, tuple]:
        """Return (dL/dh, the sub-layers' states for backward_weight)."""
        c_ln1, c_attn, c_ln2, c_mlp = cache
        g_u2, s_mlp = self.mlp.backward_input(c_mlp, g)
        g_a, s_ln2 = self.ln2.backward_input(c_ln2, g_u2)
        g_a += g                                    # the residual around the MLP
        g_u1, s_attn = self.attn.backward_input(c_attn, g_a)
        g_h, s_ln1 = self.ln1.backward_input(c_ln1, g_u1)
        g_h += g_a                                  # the residual around attention
        return g_h, (s_ln1, s_attn, s_ln2, s_mlp)

    def backward_weight(self, cache: tuple, state: tuple) -> None:
        """Accumulate the gradients of every parameter of the block."""
        for layer, c, s in zip((self.ln1, self.attn, self.ln2, self.mlp), cache, state, strict=True):
            layer.backward_weight(c, s)

    def backward(self, cache: tuple, g: Any, need_input_grad: bool = True) -> Any:
        """Accumulate the weight gradients and return dL/dh."""
        gh, state = self.backward_input(cache, g)
        self.backward_weight(cache, state)
        return gh


class Embedding:
    """``tok_emb[tokens] + pos_emb[0:T]`` for integer tokens of shape (micro-batch, T)."""

    def __init__(self, params: dict[str, Any], grads: dict[str, Any], xp: Any, tp: Any = None, lo: int = 0):
        self.tok_emb, self.pos_emb = params["tok_emb"], params["pos_emb"]
        self.grad_tok_emb, self.grad_pos_emb = grads["tok_emb"], grads["pos_emb"]
        self.xp = xp
        self.tp, self.lo = tp, lo      # this rank's rows of tok_emb are token ids [lo, lo + rows)

    def forward(self, tokens: Any) -> tuple[Any, Any]:
        """Return ((micro-batch, T, d) embeddings, cache = tokens)."""
        t = tokens.shape[1]
        if t > self.pos_emb.shape[0]:
            raise ValueError(f"sequence of {t} tokens is longer than the {self.pos_emb.shape[0]} positions")
        h = vocab_lookup(self.xp, self.tok_emb, tokens, self.lo, self.tp)
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
        self.grad_pos_emb[:g.shape[1]] += g.sum(axis=0)

    def backward(self, cache: Any, g: Any, need_input_grad: bool = True) -> None:
        """Accumulate the embedding gradients; return None (no input gradient)."""
        _, state = self.backward_input(cache, g)
        self.backward_weight(cache, state)


class OutputHead:
    """``ln_f(h) @ tok_emb.T`` (tied: accumulates into tok_emb's gradient) or ``ln_f(h) @ head`` (untied)."""

    def __init__(self, params: dict[str, Any], grads: dict[str, Any], xp: Any,
                 tok_emb: Any = None, grad_tok_emb: Any = None, tp: Any = None):
        self.ln_f = layer_norm(params, grads, "ln_f", xp)
        tied = "head/weight" not in params
        if tied and tok_emb is None:
            raise ValueError("a tied output head needs tok_emb")
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
        u, c_ln = self.ln_f.forward(h)
        logits, c_head = self.head.forward(rows(u))
        return logits.reshape(*h.shape[:-1], -1), (c_ln, c_head)

    def forward_cache(self, h: Any) -> tuple:
        """Return only the cache of forward(h) (recomputation): the logits are not computed."""
        u, c_ln = self.ln_f.forward(h)
        return c_ln, self.head.forward_cache(rows(u))

    def backward_input(self, cache: tuple, g: Any, need_input_grad: bool = True) -> tuple[Any, tuple[Any, Any]]:
        """Return (dL/dh, (ln_f state, dL/dlogits)) for backward_weight."""
        g_u, dz_head = self.head.backward_input(cache[1], rows(g))
        gh, s_ln = self.ln_f.backward_input(cache[0], g_u.reshape(*g.shape[:-1], -1))
        return gh, (s_ln, dz_head)

    def backward_weight(self, cache: tuple, state: tuple[Any, Any]) -> None:
        """Accumulate the gradients of ln_f and of the head (tok_emb's when tied)."""
        self.ln_f.backward_weight(cache[0], state[0])
        self.head.backward_weight(cache[1], state[1])

    def backward(self, cache: tuple, g: Any, need_input_grad: bool = True) -> Any:
        """Accumulate the weight gradients and return dL/dh."""
        gh, state = self.backward_input(cache, g)
        self.backward_weight(cache, state)
        return gh


def build_layer(shape: GPTShape, index: int, params: dict[str, Any], grads: dict[str, Any], xp: Any,
                tok_emb: Any = None, grad_tok_emb: Any = None, tp: Any = None,
                lo: int = 0) -> Embedding | Block | OutputHead:
    """Return the layer of group ``index`` over its parameter and gradient views (tok_emb: for a tied head;
    tp: the stage's tensor-parallel group, lo: the first token id of this rank's vocabulary part)."""
    if index == 0:
        return Embedding(params, grads, xp, tp, lo)
    if index <= shape.n_blocks:
        return Block(params, grads, shape.n_heads, xp, tp)
    return OutputHead(params, grads, xp, tok_emb, grad_tok_emb, tp)
