"""Causal attention over tiles with an online softmax (FlashAttention's algorithm), forward and backward, in any xp.

Queries come as rows ``(..., Tq * G, hd)``, time-major: row r is query position ``q_offset + r // G`` of the
G query heads sharing one key/value head (G = 1 for plain multi-head attention); keys and values as
``(..., Tk, hd)`` at positions 0..Tk-1. A query sees the keys at or before its position. Forward, per tile of
queries, over the tiles of keys it can see, with m the running row maximum and l the running sum::

    s = q k^T * scale (future keys -inf);  m' = max(m, rowmax s);  p = exp(s - m')
    l = l e^(m - m') + rowsum p;  acc = acc e^(m - m') + p v;  m = m'
    out = acc / l,  lse = m + log l

Only ``out`` and ``lse`` (one number a query) are kept: nothing T x T outlives a tile. Backward recomputes
each tile's p = exp(s - lse) and, with D = rowsum(dout * out) (= sum_j p_j dp_j)::

    dv += p^T dout;  dp = dout v^T;  ds = p (dp - D) * scale;  dq += ds k;  dk += ds^T q

The products of a tile run over all its rows at once, so the G query heads of a kv head sum their key and
value gradients inside one product. The result equals the untiled softmax up to summation order.
"""

from __future__ import annotations

from typing import Any

TILE = 128          # queries and keys per tile: (tile x G) x tile scores a time per (sample, kv head)


def _future(xp: Any, rows: int, group: int, q_first: int, k_first: int, k_count: int) -> Any:
    """True where key k_first + c comes after the query of row r (position q_first + r // group)."""
    q_pos = xp.arange(rows) // group + q_first
    return (xp.arange(k_count) + k_first)[None, :] > q_pos[:, None]


def flash_forward(xp: Any, q: Any, k: Any, v: Any, scale: float, group: int = 1, q_offset: int = 0,
                  tile: int = TILE) -> tuple[Any, Any]:
    """Return (out (..., Tq*G, hd), lse (..., Tq*G)) of causal attention (see the module docstring)."""
    rows, hd = q.shape[-2:]
    out = xp.empty(q.shape, dtype=q.dtype)
    lse = xp.empty(q.shape[:-1], dtype=q.dtype)
    n_keys = k.shape[-2]
    for r0 in range(0, rows, tile * group):
        r1 = min(r0 + tile * group, rows)
        q_first = q_offset + r0 // group
        seen = min(n_keys, q_offset + (r1 - 1) // group + 1)       # keys some row of the tile sees
        qi = q[..., r0:r1, :]
        m = l = acc = None
        for k0 in range(0, seen, tile):
            k1 = min(k0 + tile, seen)
            s = qi @ k[..., k0:k1, :].swapaxes(-1, -2)
            s *= scale
            if k1 - 1 > q_first:                                     # the tile reaches past some query
                xp.copyto(s, -xp.inf, where=_future(xp, r1 - r0, group, q_first, k0, k1 - k0))
            top = s.max(axis=-1, keepdims=True)
            if m is None:                                            # key 0 is seen by every row: top is finite
                m = top
                s -= m
                p = xp.exp(s, out=s)
                l = p.sum(axis=-1, keepdims=True)
                acc = p @ v[..., k0:k1, :]
                continue
            new = xp.maximum(m, top)
            fade = xp.exp(m - new)
            s -= new
            p = xp.exp(s, out=s)
            l *= fade
            l += p.sum(axis=-1, keepdims=True)
            acc *= fade
            acc += p @ v[..., k0:k1, :]
            m = new
        out[..., r0:r1, :] = acc / l
        lse[..., r0:r1] = (m + xp.log(l))[..., 0]
    return out, lse


def flash_backward(xp: Any, q: Any, k: Any, v: Any, lse: Any, d_out: Any, row_dot: Any, scale: float,
                   group: int = 1, q_offset: int = 0, tile: int = TILE) -> tuple[Any, Any, Any]:
    """Return (dq, dk, dv) of :func:`flash_forward`'s causal attention for the output gradient ``d_out``;
    ``row_dot`` (..., Tq*G, 1) is rowsum(d_out * out) = sum_j p_j dp_j of each query row."""
    rows = q.shape[-2]
    n_keys = k.shape[-2]
    dq = xp.zeros(q.shape, dtype=q.dtype)
    dk = xp.zeros(k.shape, dtype=k.dtype)
    dv = xp.zeros(v.shape, dtype=v.dtype)
    for r0 in range(0, rows, tile * group):
        r1 = min(r0 + tile * group, rows)
        q_first = q_offset + r0 // group
        seen = min(n_keys, q_offset + (r1 - 1) // group + 1)
        qi, gi = q[..., r0:r1, :], d_out[..., r0:r1, :]
        for k0 in range(0, seen, tile):
            k1 = min(k0 + tile, seen)
            kj, vj = k[..., k0:k1, :], v[..., k0:k1, :]
            s = qi @ kj.swapaxes(-1, -2)
            s *= scale
            if k1 - 1 > q_first:
                xp.copyto(s, -xp.inf, where=_future(xp, r1 - r0, group, q_first, k0, k1 - k0))
            s -= lse[..., r0:r1, None]
            p = xp.exp(s, out=s)                                     # future keys: exactly 0
            dv[..., k0:k1, :] += p.swapaxes(-1, -2) @ gi
            ds = gi @ vj.swapaxes(-1, -2)
            ds -= row_dot[..., r0:r1, :]
            ds *= p
            ds *= scale
            dq[..., r0:r1, :] += ds @ kj
            dk[..., k0:k1, :] += ds.swapaxes(-1, -2) @ qi
    return dq, dk, dv
