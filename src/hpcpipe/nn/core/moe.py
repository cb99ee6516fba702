"""A sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE) with a hand-written forward and split backward.

For token rows x (N, d), E experts, k of them a token::

    p = softmax(x @ Wr)                          (N, E): the router's probabilities
    top = the k largest p of each row;  w = p[top]  (divided by their sum when ``norm_topk``: Mixtral always)
    y = sum over the k chosen experts e of  w_e * swiglu_e(x)
    swiglu_e(x) = (silu(x @ Wg[e]) * (x @ Wu[e])) @ Wd[e]

Each expert multiplies the rows routed to it in one product (never one product a token). Backward, per
expert with a = silu(g), s = sigmoid(g): dh = (w * dy) @ Wd^T, d_up = dh a, d_g = dh up (s + a (1 - s)); the
router: dw = rowsum(dy * y_e) of each choice, through the normalisation (dp_j = (dw_j - sum_k dw_k w_k) / S)
and the softmax (dlogits = p (dp - sum p dp)). A load-balancing loss (``ledger``, a RouterLedger) records each
forward's expert counts and summed probabilities and adds its own dp in the backward.
"""

from __future__ import annotations

from typing import Any

from hpcpipe.nn.core.dense import rows


def _sigmoid(xp: Any, z: Any) -> Any:
    # (1 + tanh(z / 2)) / 2: no overflow warning for large |z|
    s = z * 0.5
    xp.tanh(s, out=s)
    s += 1
    s *= 0.5
    return s


class SparseMoE:
    """Router ``prefix/router/weight`` (d, E); experts ``prefix/experts/{gate,up}`` (E, d, ff), ``down`` (E, ff, d)."""

    def __init__(self, params: dict[str, Any], grads: dict[str, Any], top_k: int, norm_topk: bool, xp: Any,
                 prefix: str = "mlp", ledger: Any = None, layer: int = 0):
        self.router, self.gate = params[f"{prefix}/router/weight"], params[f"{prefix}/experts/gate"]
        self.up, self.down = params[f"{prefix}/experts/up"], params[f"{prefix}/experts/down"]
        self.g_router, self.g_gate = grads[f"{prefix}/router/weight"], grads[f"{prefix}/experts/gate"]
        self.g_up, self.g_down = grads[f"{prefix}/experts/up"], grads[f"{prefix}/experts/down"]
        self.n_experts = self.gate.shape[0]
        if not 1 <= top_k <= self.n_experts:
            raise ValueError(f"mixture of experts: top_k {top_k} must be in 1..{self.n_experts} (the experts)")
        self.top_k, self.norm_topk, self.xp = top_k, norm_topk, xp
        self.ledger, self.layer = ledger, layer    # the load-balancing loss's statistics (None: no such loss)

    def route(self, x: Any) -> tuple[Any, Any, Any]:
        """Return (probabilities (N, E), chosen experts (N, k) best first, their weights (N, k)) of rows x."""
        xp = self.xp
        logits = x @ self.router
        logits -= logits.max(axis=-1, keepdims=True)
        p = xp.exp(logits, out=logits)
        p /= p.sum(axis=-1, keepdims=True)
        top = xp.argsort(-p, axis=-1, kind="stable")[:, :self.top_k]
        w = xp.take_along_axis(p, top, axis=-1)
        if self.norm_topk:
            w = w / w.sum(axis=-1, keepdims=True)
        return p, top, w

    def _expert_rows(self, top: Any) -> list[tuple[int, Any, Any]]:
        """(expert, its token rows, which of the row's k choices it is) of every expert chosen at least once."""
        xp = self.xp
        flat = top.reshape(-1)
        order = xp.argsort(flat, kind="stable")
        counts = xp.bincount(flat, minlength=self.n_experts).tolist()     # one host copy for all experts
        out, start = [], 0
        for e, n in enumerate(counts):
            if n:
                picks = order[start:start + n]
                out.append((e, picks // self.top_k, picks % self.top_k))
            start += n
        return out

    def forward(self, u: Any) -> tuple[Any, tuple]:
        """Return (MoE output, cache) for (..., d) rows."""
        xp = self.xp
        x = rows(u)
        p, top, w = self.route(x)
        if self.ledger is not None:
            counts = xp.bincount(top.reshape(-1), minlength=self.n_experts)
            self.ledger.record(self.layer, counts, p.sum(axis=0), x.shape[0])
        out = xp.zeros(x.shape, dtype=x.dtype)
        experts = []
        for e, tokens, choice in self._expert_rows(top):
            xe = x[tokens]
            g, up = xe @ self.gate[e], xe @ self.up[e]
            s = _sigmoid(xp, g)
            act = g * s
            h = act * up
            ye = h @ self.down[e]
            out[tokens] += w[tokens, choice][:, None] * ye    # a token picks an expert once: rows are distinct
            experts.append((e, tokens, choice, xe, up, s, act, h, ye))
        return out.reshape(u.shape), (x, p, top, w, experts)

    def forward_cache(self, u: Any) -> tuple:
        """Return only the cache of forward(u)."""
        return self.forward(u)[1]

    def backward_input(self, cache: tuple, g: Any, need_input_grad: bool = True) -> tuple[Any, tuple]:
        """Return (dL/du, state for backward_weight): through every chosen expert and the router."""
        xp = self.xp
        x, p, top, w, experts = cache
        gy = rows(g)
        gx = xp.zeros(x.shape, dtype=x.dtype)
        dw = xp.zeros(w.shape, dtype=x.dtype)
        state = []
        for e, tokens, choice, xe, up, s, act, h, ye in experts:
            ge = gy[tokens]
            dw[tokens, choice] = (ge * ye).sum(axis=-1)
            scaled = ge * w[tokens, choice][:, None]               # dL/dye
            dh = scaled @ self.down[e].T
            d_up = dh * act
            slope = xp.subtract(1, s)                              # silu'(g) = s + act (1 - s)
            slope *= act
            slope += s
            d_g = dh * up
            d_g *= slope
            gx[tokens] += d_g @ self.gate[e].T + d_up @ self.up[e].T
            state.append((e, xe, h, scaled, d_g, d_up))
        dp = xp.zeros(p.shape, dtype=p.dtype)
        if self.norm_topk:                                         # w = p_top / S: through the normalisation
            total = xp.take_along_axis(p, top, axis=-1).sum(axis=-1, keepdims=True)
            dw = (dw - (dw * w).sum(axis=-1, keepdims=True)) / total
        xp.put_along_axis(dp, top, dw, axis=-1)
        if self.ledger is not None:
            dp += self.ledger.aux_grad(p)                          # the load-balancing loss's share
        d_logits = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
        gx += d_logits @ self.router.T
        return gx.reshape(g.shape), (d_logits, state)

    def backward_weight(self, cache: tuple, state: tuple) -> None:
        """Accumulate the gradients of the router and of every chosen expert's matrices."""
        x = cache[0]
        d_logits, experts = state
        self.g_router += x.T @ d_logits
        for e, xe, h, scaled, d_g, d_up in experts:
            self.g_down[e] += h.T @ scaled
            self.g_gate[e] += xe.T @ d_g
            self.g_up[e] += xe.T @ d_up

    def backward(self, cache: tuple, g: Any, need_input_grad: bool = True) -> Any:
        """Accumulate the weight gradients and return dL/du."""
        gu, state = self.backward_input(cache, g, need_input_grad)
        self.backward_weight(cache, state)
        return gu
