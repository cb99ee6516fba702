"""Causal grouped-query self-attention over a kind's q/k/v projections, hand-written forward and split backward.

With H query heads, K key/value heads, G = H / K and head width hd (GPT: K = H, no RoPE)::

    q, k, v = the kind's projections of u       (rows; head i = columns i*hd:(i+1)*hd of each)
    q, k = rope(q), rope(k)                     (at positions 0..T-1, when the kind rotates: hpcpipe.nn.core.rope)
    query head i attends with key/value head i // G:
        p = softmax(causal(q_i k_{i//G}^T / sqrt(hd))),  out_i = p v_{i//G}
    y = concat(out_0 .. out_{H-1}) @ Wo

Two projections: :class:`FusedQKV` (GPT-2's ``attn/qkv``: q | k | v as column blocks of one matrix, q, k
and v views of its output) and :class:`SplitQKV` (Llama's ``attn/{q,k,v}``, optional biases). Query head
i = kv * G + g, so the queries of one kv head are the block (T, G, hd) of a (b, K, T, G, hd)
array; seen time-major as (b, K, T*G, hd) rows, the products run per (sample, kv head) against that head's
keys and values, with no repeated copy of K or V, over tiles with an online softmax
(:mod:`hpcpipe.nn.core.flash`): only the output and one log-sum-exp a query are kept for the backward,
never a (T, T) array. Backward: the gradients of the G query heads sharing a kv head are summed by the same
products; the softmax row sums use sum_j p_ij dp_ij = dout_i . out_i; RoPE's backward is the transpose
rotation. With tensor parallelism a rank holds
its heads' q, k and v columns (column-parallel: one sum of their input gradients) and their rows of the
output projection (row-parallel: its partial output summed before any bias).
"""

from __future__ import annotations

import math
from typing import Any

from hpcpipe.nn.core.dense import linear, rows
from hpcpipe.nn.core.flash import flash_backward, flash_forward
from hpcpipe.nn.core.rope import Rope, rotate
from hpcpipe.nn.core.tensor_parallel import is_split


class FusedQKV:
    """``u @ Wqkv + bqkv`` split into q | k | v column blocks (``prefix/qkv``): q, k and v are views of one output."""

    def __init__(self, params: dict[str, Any], grads: dict[str, Any], xp: Any, prefix: str, tp: Any):
        self.dense = linear(params, grads, f"{prefix}/qkv", xp, reduce_input_grad=tp if is_split(tp) else None)
        self.xp = xp
        self.weight = self.dense.weight

    def forward(self, x: Any) -> tuple[Any, Any, Any, Any]:
        """Return (q, k, v, cache) for input rows x; q, k, v are (rows, width) views of one product."""
        qkv, cache = self.dense.forward(x)
        w = qkv.shape[1] // 3
        return qkv[:, :w], qkv[:, w:2 * w], qkv[:, 2 * w:], cache

    def forward_cache(self, x: Any) -> Any:
        """Return only the cache of forward(x): the input rows."""
        return self.dense.forward_cache(x)

    def grad_buffers(self, b: int, t: int, n_heads: int, n_kv: int, hd: int, dtype: Any) -> tuple:
        """Return (dq, dk, dv, whole): (b, t, heads, hd) views of one (b, t, 3, H, hd) buffer (qkv's row layout)."""
        whole = self.xp.empty((b, t, 3, n_heads, hd), dtype=dtype)
        return whole[:, :, 0], whole[:, :, 1], whole[:, :, 2], whole

    def backward_input(self, cache: Any, grads: tuple, need_input_grad: bool) -> tuple[Any, Any]:
        """Return (dL/dx or None, state for backward_weight) from grad_buffers' arrays, filled."""
        whole = grads[3]
        return self.dense.backward_input(cache, whole.reshape(-1, whole[0, 0].size), need_input_grad)

    def backward_weight(self, cache: Any, state: Any) -> None:
        """Accumulate the gradients of prefix/qkv."""
        self.dense.backward_weight(cache, state)


class SplitQKV:
    """Three projections ``prefix/{q,k,v}`` (+ biases when ``bias``), with one tp sum of their input gradients."""

    def __init__(self, params: dict[str, Any], grads: dict[str, Any], xp: Any, prefix: str, tp: Any,
                 bias: bool = False):
        self.q = linear(params, grads, f"{prefix}/q", xp, bias=bias)
        self.k = linear(params, grads, f"{prefix}/k", xp, bias=bias)
        self.v = linear(params, grads, f"{prefix}/v", xp, bias=bias)
        self.tp = tp if is_split(tp) else None
        self.xp = xp
        self.weight = self.q.weight

    def forward(self, x: Any) -> tuple[Any, Any, Any, Any]:
        """Return (q, k, v, cache) for input rows x."""
        q, c_q = self.q.forward(x)
        k, c_k = self.k.forward(x)
        v, c_v = self.v.forward(x)
        return q, k, v, (c_q, c_k, c_v)

    def forward_cache(self, x: Any) -> Any:
        """Return only the cache of forward(x): the input rows, once per projection."""
        return tuple(layer.forward_cache(x) for layer in (self.q, self.k, self.v))

    def grad_buffers(self, b: int, t: int, n_heads: int, n_kv: int, hd: int, dtype: Any) -> tuple:
        """Return fresh (dq, dk, dv, None) of shapes (b, t, H, hd), (b, t, K, hd), (b, t, K, hd)."""
        xp = self.xp
        return (xp.empty((b, t, n_heads, hd), dtype=dtype), xp.empty((b, t, n_kv, hd), dtype=dtype),
                xp.empty((b, t, n_kv, hd), dtype=dtype), None)

    def backward_input(self, cache: Any, grads: tuple, need_input_grad: bool) -> tuple[Any, Any]:
        """Return (dL/dx or None, state for backward_weight) from grad_buffers' arrays, filled."""
        dq, dk, dv, _ = grads
        n = dq.shape[0] * dq.shape[1]
        gx, dz_q = self.q.backward_input(cache[0], dq.reshape(n, -1), need_input_grad)
        gx_k, dz_k = self.k.backward_input(cache[1], dk.reshape(n, -1), need_input_grad)
        gx_v, dz_v = self.v.backward_input(cache[2], dv.reshape(n, -1), need_input_grad)
        if need_input_grad:
            gx += gx_k
            gx += gx_v
            if self.tp is not None:
                self.tp.sum_(gx)
        return gx, (dz_q, dz_k, dz_v)

    def backward_weight(self, cache: Any, state: Any) -> None:
        """Accumulate the gradients of prefix/{q,k,v} (and their biases)."""
        for layer, c, dz in zip((self.q, self.k, self.v), cache, state, strict=True):
            layer.backward_weight(c, dz)


class CausalAttention:
    """Attention ``prefix/...`` over (micro-batch, T, d) activations: a q/k/v projection, optional RoPE, ``o``."""

    def __init__(self, qkv: FusedQKV | SplitQKV, o: Any, n_heads: int, n_kv_heads: int, head_dim: int,
                 rope: Rope | None, xp: Any, q_norm: Any = None, k_norm: Any = None, window: int = 0):
        if n_kv_heads < 1 or n_heads % n_kv_heads:
            raise ValueError(f"attention n_heads {n_heads} is not a multiple of n_kv_heads {n_kv_heads}")
        width = o.weight.shape[0]           # this rank's heads' width
        if width != n_heads * head_dim:
            raise ValueError(f"attention width {width} does not match n_heads {n_heads} of head_dim {head_dim} "
                             f"(this rank's heads)")
        self.qkv, self.o, self.rope, self.xp = qkv, o, rope, xp
        self.q_norm, self.k_norm = q_norm, k_norm        # per-head RMSNorms of q and k before RoPE (Qwen3)
        self.window = window                             # > 0: each query sees only its last ``window`` keys
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.group = n_heads // n_kv_heads
        self.scale = 1.0 / math.sqrt(head_dim)

    def _tables(self, t: int) -> tuple[Any, Any]:
        # (t, 1, hd/2): broadcast over the heads of a (b, t, heads, hd) block
        cos, sin = self.rope.tables(t)
        return cos[:, None], sin[:, None]

    def _time_major(self, x: Any, b: int, t: int, heads: int, cos_sin: Any) -> Any:
        """(b*t, heads*hd) rows as (b, K, t * G, hd): each kv head's queries (or its keys, G = 1) time-major,
        rotated into a fresh buffer with RoPE, else a view when the layout allows (one query head a kv head)."""
        hd, kv = self.head_dim, self.n_kv_heads
        group = heads // kv
        blocks = x.reshape(b, t, kv, group, hd)
        if cos_sin is None and group == 1:
            return blocks[:, :, :, 0].transpose(0, 2, 1, 3)
        out = self.xp.empty((b, kv, t, group, hd), dtype=x.dtype)
        if cos_sin is None:
            out[...] = blocks.transpose(0, 2, 1, 3, 4)
        else:
            # the rotation writes straight into the layout the products read: no separate transpose
            cos, sin = cos_sin
            rotate(self.xp, blocks, cos[:, None], sin[:, None], out=out.transpose(0, 2, 1, 3, 4))
        return out.reshape(b, kv, t * group, hd)

    def _heads(self, u: Any) -> tuple[Any, tuple]:
        """Return (the concatenated heads as (b*t, H*hd) rows, the cache without the output projection's)."""
        b, t, _ = u.shape
        n_h, n_kv, g, hd = self.n_heads, self.n_kv_heads, self.group, self.head_dim
        q, k, v, c_qkv = self.qkv.forward(rows(u))
        c_norms = None
        if self.q_norm is not None:
            q, c_qn = self.q_norm.forward(q.reshape(-1, hd))
            k, c_kn = self.k_norm.forward(k.reshape(-1, hd))
            q, k, c_norms = q.reshape(b * t, -1), k.reshape(b * t, -1), (c_qn, c_kn)
        cos_sin = None if self.rope is None else self._tables(t)
        qt = self._time_major(q, b, t, n_h, cos_sin)                   # (b, K, t * G, hd)
        kt = self._time_major(k, b, t, n_kv, cos_sin)                  # (b, K, t, hd)
        vt = v.reshape(b, t, n_kv, hd).transpose(0, 2, 1, 3)
        out, lse = flash_forward(self.xp, qt, kt, vt, self.scale, g, window=self.window)   # nothing t x t kept
        heads = out.reshape(b, n_kv, t, g, hd).transpose(0, 2, 1, 3, 4).reshape(b * t, n_h * hd)
        return heads, ((c_qkv, c_norms), qt, kt, vt, lse)

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
        """Return (dL/du or None, (projection state, dL/dy rows)) for backward_weight."""
        xp = self.xp
        (c_qkv, c_norms), qt, kt, vt, lse, c_o = cache
        b, t = g.shape[:2]
        n_h, n_kv, grp, hd = self.n_heads, self.n_kv_heads, self.group, self.head_dim
        g_heads, dz_o = self.o.backward_input(c_o, rows(g))             # (b*t, H*hd)
        # softmax backward row sums: sum_j p_ij (dout_i . v_j) = dout_i . out_i, from the heads' rows
        row_dot = (g_heads * c_o[0]).reshape(b, t, n_kv, grp, hd).sum(axis=-1)
        row_dot = row_dot.transpose(0, 2, 1, 3).reshape(b, n_kv, t * grp, 1)
        g_out = xp.ascontiguousarray(g_heads.reshape(b, t, n_kv, grp, hd).transpose(0, 2, 1, 3, 4))
        dq_t, dk_t, dv_t = flash_backward(xp, qt, kt, vt, lse, g_out.reshape(b, n_kv, t * grp, hd), row_dot,
                                          self.scale, grp, window=self.window)
        grads = self.qkv.grad_buffers(b, t, n_h, n_kv, hd, g.dtype)
        dq, dk, dv = grads[:3]
        dq_rows = dq_t.reshape(b, n_kv, t, grp, hd).transpose(0, 2, 1, 3, 4)     # (b, t, K, G, hd)
        dk_rows = dk_t.transpose(0, 2, 1, 3)                                       # (b, t, K, hd)
        dv[...] = dv_t.transpose(0, 2, 1, 3)
        if self.rope is None:
            dq.reshape(b, t, n_kv, grp, hd)[...] = dq_rows
            dk[...] = dk_rows
        else:
            cos, sin = self._tables(t)
            rotate(xp, dq_rows, cos[:, None], sin[:, None], out=dq.reshape(b, t, n_kv, grp, hd), inverse=True)
            rotate(xp, dk_rows, cos, sin, out=dk, inverse=True)
        s_norms = None
        if c_norms is not None:          # through the q and k norms, back to the projections' outputs
            # copies: the norms keep the incoming gradient for their weights, and dq, dk are overwritten next
            g_q, s_qn = self.q_norm.backward_input(c_norms[0], dq.reshape(-1, hd).copy())
            g_k, s_kn = self.k_norm.backward_input(c_norms[1], dk.reshape(-1, hd).copy())
            dq.reshape(-1, hd)[...], dk.reshape(-1, hd)[...], s_norms = g_q, g_k, (s_qn, s_kn)
        gu, s_qkv = self.qkv.backward_input(c_qkv, grads, need_input_grad)
        return (None if gu is None else gu.reshape(b, t, -1)), ((s_qkv, s_norms), dz_o)

    def backward_weight(self, cache: tuple, state: tuple) -> None:
        """Accumulate the gradients of the projections (and their biases) and of the output projection."""
        (c_qkv, c_norms), (s_qkv, s_norms) = cache[0], state[0]
        self.qkv.backward_weight(c_qkv, s_qkv)
        if c_norms is not None:
            self.q_norm.backward_weight(c_norms[0], s_norms[0])
            self.k_norm.backward_weight(c_norms[1], s_norms[1])
        self.o.backward_weight(cache[5], state[1])

    def backward(self, cache: tuple, g: Any, need_input_grad: bool = True) -> Any:
        """Accumulate the weight gradients and return dL/du."""
        gu, state = self.backward_input(cache, g, need_input_grad)
        self.backward_weight(cache, state)
        return gu
