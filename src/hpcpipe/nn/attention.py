"""Causal multi-head self-attention with its output projection, hand-written forward and split backward.

``qkv = u @ Wqkv + bqkv`` is split into q | k | v (each d wide, in that order);
head h is the contiguous slice h * d_head : (h + 1) * d_head of each; scores
``q k^T / sqrt(d_head)`` are masked causally (a token sees itself and earlier
tokens), softmaxed over keys, applied to v; heads are concatenated back in
order and projected: ``y = heads @ Wproj + bproj``. With tensor parallelism a rank holds the q, k and
v columns of n_heads / tp heads (``attn/qkv`` column-parallel: its input gradient is summed over the
ranks) and their rows of ``attn/proj`` (row-parallel: its partial output is summed before the bias).
"""

from __future__ import annotations

import math
from typing import Any

from hpcpipe.nn.linear import linear, rows


class CausalSelfAttention:
    """Attention block ``attn/{qkv,proj}/{weight,bias}`` over (micro-batch, T, d) activations."""

    def __init__(self, params: dict[str, Any], grads: dict[str, Any], n_heads: int, xp: Any, prefix: str = "attn",
                 tp: Any = None):
        split = tp if tp is not None and tp.size > 1 else None
        self.qkv = linear(params, grads, f"{prefix}/qkv", xp, reduce_input_grad=split)
        self.proj = linear(params, grads, f"{prefix}/proj", xp, reduce_out=split)
        d = params[f"{prefix}/proj/weight"].shape[0]       # this rank's heads' width
        if d % n_heads:
            raise ValueError(f"attention width {d} is not a multiple of n_heads {n_heads} (this rank's heads)")
        self.n_heads, self.d_head = n_heads, d // n_heads
        self.xp = xp
        self._masks: dict[int, Any] = {}

    def _future(self, t: int) -> Any:
        # True above the diagonal: the keys a query may not see
        mask = self._masks.get(t)
        if mask is None:
            mask = self._masks[t] = self.xp.triu(self.xp.ones((t, t), dtype=bool), k=1)
        return mask

    def forward(self, u: Any) -> tuple[Any, tuple]:
        """Return (attention output, cache) for a (micro-batch, T, d) block."""
        xp = self.xp
        b, t, d = u.shape
        qkv, qkv_cache = self.qkv.forward(rows(u))
        # (b*t, 3d) -> (3, b, heads, t, d_head): q | k | v, each split into contiguous head slices
        q, k, v = qkv.reshape(b, t, 3, self.n_heads, self.d_head).transpose(2, 0, 3, 1, 4)
        scores = q @ k.swapaxes(-1, -2)
        scores *= 1.0 / math.sqrt(self.d_head)
        xp.copyto(scores, -xp.inf, where=self._future(t))   # in place: no second (b, heads, t, t) array
        scores -= scores.max(axis=-1, keepdims=True)
        p = xp.exp(scores, out=scores)
        p /= p.sum(axis=-1, keepdims=True)
        heads = (p @ v).transpose(0, 2, 1, 3).reshape(b * t, self.n_heads * self.d_head)
        y, proj_cache = self.proj.forward(heads)
        return y.reshape(b, t, d), (qkv_cache, q, k, v, p, proj_cache)

    def backward_input(self, cache: tuple, g: Any) -> tuple[Any, tuple[Any, Any]]:
        """Return (dL/du, (dL/dqkv, dL/dy)); the pair feeds backward_weight."""
        xp = self.xp
        qkv_cache, q, k, v, p, proj_cache = cache
        b, h, t, dh = q.shape
        g_rows = rows(g)
        g_heads, dz_proj = self.proj.backward_input(proj_cache, g_rows)
        g_out = g_heads.reshape(b, t, h, dh).transpose(0, 2, 1, 3)
        # q, k and v gradients are written straight into the (b, t, 3, heads, d_head) layout of qkv's
        # gradient through a (3, b, heads, t, d_head) view: no stack and no copy
        g_qkv = xp.empty((b, t, 3, h, dh), dtype=g.dtype)
        layout = g_qkv.transpose(2, 0, 3, 1, 4)
        xp.matmul(p.swapaxes(-1, -2), g_out, out=layout[2])
        gp = g_out @ v.swapaxes(-1, -2)
        # softmax backward; masked entries have p == 0, so their score gradient is 0
        gp -= (gp * p).sum(axis=-1, keepdims=True)
        gs = gp
        gs *= p
        gs *= 1.0 / math.sqrt(dh)
        xp.matmul(gs, k, out=layout[0])
        xp.matmul(gs.swapaxes(-1, -2), q, out=layout[1])
        g_qkv = g_qkv.reshape(b * t, 3 * h * dh)
        gu, dz_qkv = self.qkv.backward_input(qkv_cache, g_qkv)
        return gu.reshape(b, t, -1), (dz_qkv, dz_proj)

    def backward_weight(self, cache: tuple, state: tuple[Any, Any]) -> None:
        """Accumulate the gradients of attn/qkv and attn/proj."""
        dz_qkv, dz_proj = state
        self.qkv.backward_weight(cache[0], dz_qkv)
        self.proj.backward_weight(cache[5], dz_proj)

    def backward(self, cache: tuple, g: Any) -> Any:
        """Accumulate the weight gradients and return dL/du."""
        gu, state = self.backward_input(cache, g)
        self.backward_weight(cache, state)
        return gu
