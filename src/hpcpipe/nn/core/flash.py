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
value gradients inside one product. The result equals the untiled softmax up to summation order. With a
sliding ``window`` W a query at position p sees the keys p - W + 1 .. p only, and the tiles wholly before
every query's window are never visited.
"""

from __future__ import annotations

from typing import Any

TILE = 128          # queries and keys per tile: (tile x G) x tile scores a time per (sample, kv head)


def _hidden(xp: Any, rows: int, group: int, q_first: int, k_first: int, k_count: int, window: int) -> Any:
    """True where key k_first + c is after the query of row r (position q_first + r // group), or, with a window,
    ``window`` or more positions before it."""
    q_pos = (xp.arange(rows) // group + q_first)[:, None]
    k_pos = (xp.arange(k_count) + k_first)[None, :]
    hidden = k_pos > q_pos
    if window:
        hidden |= k_pos <= q_pos - window
    return hidden


def _key_tiles(q_first: int, q_last: int, n_keys: int, tile: int, window: int) -> range:
    """The starts of the key tiles some query of positions q_first..q_last sees (causal, within the window)."""
    low = max(0, q_first - window + 1) if window else 0
    return range(low // tile * tile, min(n_keys, q_last + 1), tile)


def flash_forward(xp: Any, q: Any, k: Any, v: Any, scale: float, group: int = 1, q_offset: int = 0,
                  tile: int = TILE, window: int = 0) -> tuple[Any, Any]:
    """Return (out (..., Tq*G, hd), lse (..., Tq*G)) of causal attention (see the module docstring); ``window``
    > 0: a query sees only the last ``window`` keys up to its own (sliding-window attention)."""
    rows, hd = q.shape[-2:]
    out = xp.empty(q.shape, dtype=q.dtype)
    lse = xp.empty(q.shape[:-1], dtype=q.dtype)
    n_keys = k.shape[-2]
    for r0 in range(0, rows, tile * group):
        r1 = min(r0 + tile * group, rows)
        q_first, q_last = q_offset + r0 // group, q_offset + (r1 - 1) // group
        qi = q[..., r0:r1, :]
        m = xp.full(qi.shape[:-1] + (1,), -xp.inf, dtype=q.dtype)
        l = xp.zeros(m.shape, dtype=q.dtype)
        acc = xp.zeros(qi.shape, dtype=q.dtype)
        for k0 in _key_tiles(q_first, q_last, n_keys, tile, window):
            k1 = min(k0 + tile, q_last + 1, n_keys)
            s = qi @ k[..., k0:k1, :].swapaxes(-1, -2)
            s *= scale
            if k1 - 1 > q_first or (window and k0 <= q_last - window):     # some key of the tile is hidden
                xp.copyto(s, -xp.inf, where=_hidden(xp, r1 - r0, group, q_first, k0, k1 - k0, window))
            new = xp.maximum(m, s.max(axis=-1, keepdims=True))
            # a row that has seen no key yet (a window's first tiles) keeps m = -inf: shift it by 0, not by -inf
            safe = xp.where(xp.isneginf(new), 0.0, new)
            s -= safe
            p = xp.exp(s, out=s)                                         # hidden keys: exactly 0
            fade = xp.exp(m - safe)
            l *= fade
            l += p.sum(axis=-1, keepdims=True)
            acc *= fade
            acc += p @ v[..., k0:k1, :]
            m = new
        out[..., r0:r1, :] = acc / l
        lse[..., r0:r1] = (m + xp.log(l))[..., 0]
    return out, lse


def flash_backward(xp: Any, q: Any, k: Any, v: Any, lse: Any, d_out: Any, row_dot: Any, scale: float,
                   group: int = 1, q_offset: int = 0, tile: int = TILE, window: int = 0) -> tuple[Any, Any, Any]:
    """Return (dq, dk, dv) of :func:`flash_forward`'s causal attention for the output gradient ``d_out``;
    ``row_dot`` (..., Tq*G, 1) is rowsum(d_out * out) = sum_j p_j dp_j of each query row."""
    rows = q.shape[-2]
    n_keys = k.shape[-2]
    dq = xp.zeros(q.shape, dtype=q.dtype)
    dk = xp.zeros(k.shape, dtype=k.dtype)
    dv = xp.zeros(v.shape, dtype=v.dtype)
    for r0 in range(0, rows, tile * group):
        r1 = min(r0 + tile * group, rows)
        q_first, q_last = q_offset + r0 // group, q_offset + (r1 - 1) // group
        qi, gi = q[..., r0:r1, :], d_out[..., r0:r1, :]
        for k0 in _key_tiles(q_first, q_last, n_keys, tile, window):
            k1 = min(k0 + tile, q_last + 1, n_keys)
            kj, vj = k[..., k0:k1, :], v[..., k0:k1, :]
            s = qi @ kj.swapaxes(-1, -2)
            s *= scale
            if k1 - 1 > q_first or (window and k0 <= q_last - window):
                xp.copyto(s, -xp.inf, where=_hidden(xp, r1 - r0, group, q_first, k0, k1 - k0, window))
            s -= lse[..., r0:r1, None]
            p = xp.exp(s, out=s)                                     # hidden keys: exactly 0
            dv[..., k0:k1, :] += p.swapaxes(-1, -2) @ gi
            ds = gi @ vj.swapaxes(-1, -2)
            ds -= row_dot[..., r0:r1, :]
            ds *= p
            ds *= scale
            dq[..., r0:r1, :] += ds @ kj
            dk[..., k0:k1, :] += ds.swapaxes(-1, -2) @ qi
    return dq, dk, dv
