"""Causal grouped-query attention with RoPE and q/k/v/o projections, hand-written forward and split backward.

With H query heads, K key/value heads, G = H / K and head width hd::

    q = u @ Wq (+ bq),  k = u @ Wk (+ bk),  v = u @ Wv (+ bv)     (rows; head i = columns i*hd:(i+1)*hd)
    q, k = rope(q), rope(k)                                         (at positions 0..T-1, hpcpipe.nn.rope)
    query head i attends with key/value head i // G:
        p = softmax(causal(q_i k_{i//G}^T / sqrt(hd))),  out_i = p v_{i//G}
    y = concat(out_0 .. out_{H-1}) @ Wo

Query head i = kv * G + g, so the queries of one kv head are the contiguous block
(G, T, hd) of a (b, K, G, T, hd) array; seen as (b, K, G*T, hd), the products run
as one GEMM per (sample, kv head) against that head's keys and values, with no
repeated copy of K or V. Backward: the gradients of the G query heads sharing a
kv head are summed by the same products; the softmax row sums use
sum_j p_ij dp_ij = dout_i . out_i (no (b, H, T, T) product); RoPE's backward is
the transpose rotation.
"""

from __future__ import annotations

import math
from typing import Any

from hpcpipe.nn.linear import linear, rows
from hpcpipe.nn.rope import Rope, rotate


class GQAttention:
    """Attention ``attn/{q,k,v,o}/weight`` (+ ``attn/{q,k,v}/bias``) over (micro-batch, T, d) activations."""

    def __init__(self, params: dict[str, Any], grads: dict[str, Any], n_heads: int, n_kv_heads: int, rope: Rope,
                 xp: Any, prefix: str = "attn", tp: Any = None):
        if n_kv_heads < 1 or n_heads % n_kv_heads:
            raise ValueError(f"attention n_heads {n_heads} is not a multiple of n_kv_heads {n_kv_heads}")
        bias = f"{prefix}/q/bias" in params
        self.q = linear(params, grads, f"{prefix}/q", xp, bias=bias)
        self.k = linear(params, grads, f"{prefix}/k", xp, bias=bias)
        self.v = linear(params, grads, f"{prefix}/v", xp, bias=bias)
        # tensor parallel: this rank's heads; q, k, v column-parallel (one sum of their input gradients), o row-
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.o = linear(params, grads, f"{prefix}/o", xp, bias=False, reduce_out=self.tp)
        hd = rope.head_dim
        q_width, kv_width = self.q.weight.shape[1], self.k.weight.shape[1]
        if q_width != n_heads * hd or kv_width != n_kv_heads * hd:
            raise ValueError(f"attention q width {q_width} / kv width {kv_width} do not match n_heads {n_heads} / "
                             f"n_kv_heads {n_kv_heads} of head_dim {hd}")
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, hd
        self.group = n_heads // n_kv_heads
        self.scale = 1.0 / math.sqrt(hd)
        self.rope = rope
        self.xp = xp
        self._masks: dict[int, Any] = {}

    def _future(self, t: int) -> Any:
        # True above the diagonal: the keys a query may not see
        mask = self._masks.get(t)
        if mask is None:
            mask = self._masks[t] = self.xp.triu(self.xp.ones((t, t), dtype=bool), k=1)
        return mask

    def _tables(self, t: int) -> tuple[Any, Any]:
        # (t, 1, hd/2): broadcast over the heads of a (b, t, heads, hd) block
        cos, sin = self.rope.tables(t)
        return cos[:, None], sin[:, None]

    def _heads(self, u: Any) -> tuple[Any, tuple]:
        """Return (the concatenated heads as (b*t, H*hd) rows, the cache without the output projection's)."""
        xp = self.xp
        b, t, _ = u.shape
        n_h, n_kv, g, hd = self.n_heads, self.n_kv_heads, self.group, self.head_dim
        x = rows(u)
        q, c_q = self.q.forward(x)
        k, c_k = self.k.forward(x)
        v, c_v = self.v.forward(x)
        cos, sin = self._tables(t)
        # the rotation writes straight into the head-major layouts the products read: no separate transpose
        qr = xp.empty((b, n_h, t, hd), dtype=q.dtype)
        rotate(xp, q.reshape(b, t, n_h, hd), cos, sin, out=qr.transpose(0, 2, 1, 3))
        kr = xp.empty((b, n_kv, t, hd), dtype=k.dtype)
        rotate(xp, k.reshape(b, t, n_kv, hd), cos, sin, out=kr.transpose(0, 2, 1, 3))
        vh = v.reshape(b, t, n_kv, hd).transpose(0, 2, 1, 3)
        qr = qr.reshape(b, n_kv, g * t, hd)
        scores = qr @ kr.swapaxes(-1, -2)                                 # (b, K, G*t, t)
        scores *= self.scale
        # in place: no second (b, H, t, t) array
        xp.copyto(scores.reshape(b, n_kv, g, t, t), -xp.inf, where=self._future(t))
        scores -= scores.max(axis=-1, keepdims=True)
        p = xp.exp(scores, out=scores)
        p /= p.sum(axis=-1, keepdims=True)
        heads = (p @ vh).reshape(b, n_h, t, hd).transpose(0, 2, 1, 3).reshape(b * t, n_h * hd)
        return heads, (c_q, c_k, c_v, qr, kr, vh, p)

    def forward(self, u: Any) -> tuple[Any, tuple]:
        """Return (attention output, cache) for a (micro-batch, T, d) block."""
        heads, cache = self._heads(u)
        y, c_o = self.o.forward(heads)
        return y.reshape(*u.shape[:2], -1), (*cache, c_o)

    def forward_cache(self, u: Any) -> tuple:
        """Return only the cache of forward(u) (recomputation): the output projection is not computed."""
        heads, cache = self._heads(u)
        return (*cache, self.o.forward_cache(heads))

    def backward_input(self, cache: tuple, g: Any, need_input_grad: bool = True) -> tuple[Any, tuple]:
        """Return (dL/du or None, (dL/dq, dL/dk, dL/dv, dL/dy) as rows) for backward_weight."""
        xp = self.xp
        c_q, c_k, c_v, qr, kr, vh, p, c_o = cache
        b, t = g.shape[:2]
        n_h, n_kv, grp, hd = self.n_heads, self.n_kv_heads, self.group, self.head_dim
        g_heads, dz_o = self.o.backward_input(c_o, rows(g))             # (b*t, H*hd)
        # softmax backward row sums: sum_j p_ij (dout_i . v_j) = dout_i . out_i, from (b, t, H, hd) arrays
        row_dot = (g_heads * c_o[0]).reshape(b, t, n_kv, grp, hd).sum(axis=-1)
        row_dot = row_dot.transpose(0, 2, 3, 1).reshape(b, n_kv, grp * t, 1)
        g_out = xp.ascontiguousarray(g_heads.reshape(b, t, n_kv, grp, hd).transpose(0, 2, 3, 1, 4))
        g_out = g_out.reshape(b, n_kv, grp * t, hd)
        dq = xp.empty((b, t, n_h, hd), dtype=g.dtype)
        dk = xp.empty((b, t, n_kv, hd), dtype=g.dtype)
        dv = xp.empty((b, t, n_kv, hd), dtype=g.dtype)
        # p^T @ dout sums the G query heads of each kv head; written in the (b, t, K, hd) row layout
        xp.matmul(p.swapaxes(-1, -2), g_out, out=dv.transpose(0, 2, 1, 3))
        gs = g_out @ vh.swapaxes(-1, -2)                                  # (b, K, G*t, t)
        gs -= row_dot
        gs *= p                                                           # masked entries: p == 0
        gs *= self.scale
        g_qr = gs @ kr                                                    # (b, K, G*t, hd)
        g_kr = gs.swapaxes(-1, -2) @ qr                                   # (b, K, t, hd), summed over the group
        cos, sin = self._tables(t)
        rotate(xp, g_qr.reshape(b, n_h, t, hd).transpose(0, 2, 1, 3), cos, sin, out=dq, inverse=True)
        rotate(xp, g_kr.transpose(0, 2, 1, 3), cos, sin, out=dk, inverse=True)
        gu_q, dz_q = self.q.backward_input(c_q, dq.reshape(b * t, -1), need_input_grad)
        gu_k, dz_k = self.k.backward_input(c_k, dk.reshape(b * t, -1), need_input_grad)
        gu_v, dz_v = self.v.backward_input(c_v, dv.reshape(b * t, -1), need_input_grad)
        gu = None
        if need_input_grad:
            gu_q += gu_k
            gu_q += gu_v
            if self.tp is not None:
                self.tp.sum_(gu_q)
            gu = gu_q.reshape(b, t, -1)
        return gu, (dz_q, dz_k, dz_v, dz_o)

    def backward_weight(self, cache: tuple, state: tuple) -> None:
        """Accumulate the gradients of attn/{q,k,v,o} (and the q/k/v biases)."""
        for layer, c, dz in zip((self.q, self.k, self.v, self.o), (cache[0], cache[1], cache[2], cache[7]), state,
                                strict=True):
            layer.backward_weight(c, dz)

    def backward(self, cache: tuple, g: Any, need_input_grad: bool = True) -> Any:
        """Accumulate the weight gradients and return dL/du."""
        gu, state = self.backward_input(cache, g, need_input_grad)
        self.backward_weight(cache, state)
        return gu
