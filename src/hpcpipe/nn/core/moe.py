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

With expert parallelism (``ep``: an hpcpipe.runtime.expert_comm.ExpertGroup of more than one rank) this layer
holds n_experts / ep of the experts; routing stays local and the rows travel to their experts' ranks and back
(:class:`hpcpipe.nn.core.expert_parallel.ExpertParallel`); the weight gradients stay local either way.
"""

from __future__ import annotations

from typing import Any

from hpcpipe.nn.core.dense import rows
from hpcpipe.nn.core.expert_parallel import ExpertParallel


def _sigmoid(xp: Any, z: Any) -> Any:
    # (1 + tanh(z / 2)) / 2: no overflow warning for large |z|
    s = z * 0.5
    xp.tanh(s, out=s)
    s += 1
    s *= 0.5
    return s


class SparseMoE:
    """Router ``prefix/router/weight`` (d, E); experts ``prefix/experts/{gate,up}`` (E, d, ff), ``down`` (E, ff, d)
    (with ``ep``: this rank's E / ep experts of each, in expert order)."""

    def __init__(self, params: dict[str, Any], grads: dict[str, Any], top_k: int, norm_topk: bool, xp: Any,
                 prefix: str = "mlp", ledger: Any = None, layer: int = 0, ep: Any = None):
        self.router, self.gate = params[f"{prefix}/router/weight"], params[f"{prefix}/experts/gate"]
        self.up, self.down = params[f"{prefix}/experts/up"], params[f"{prefix}/experts/down"]
        self.g_router, self.g_gate = grads[f"{prefix}/router/weight"], grads[f"{prefix}/experts/gate"]
        self.g_up, self.g_down = grads[f"{prefix}/experts/up"], grads[f"{prefix}/experts/down"]
        self.n_experts = self.router.shape[1]     # the router scores every expert, wherever it is held
        self.n_local = self.gate.shape[0]         # the experts held here
        if not 1 <= top_k <= self.n_experts:
            raise ValueError(f"mixture of experts: top_k {top_k} must be in 1..{self.n_experts} (the experts)")
        self.top_k, self.norm_topk, self.xp = top_k, norm_topk, xp
        self.ledger, self.layer = ledger, layer    # the load-balancing loss's statistics (None: no such loss)
        self.parallel = ExpertParallel(self, ep) if ep is not None and ep.size > 1 else None
        if self.parallel is None and self.n_local != self.n_experts:
            raise ValueError(f"mixture of experts: {self.n_local} of {self.n_experts} experts held without an "
                             f"expert-parallel group")

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

    def expert_forward(self, j: int, xe: Any) -> tuple[Any, tuple]:
        """Return (output rows, what its backward keeps) of local expert j over its rows xe, in one product each."""
        g, up = xe @ self.gate[j], xe @ self.up[j]
        s = _sigmoid(self.xp, g)
        act = g * s
        h = act * up
        return h @ self.down[j], (xe, up, s, act, h)

    def expert_backward(self, j: int, saved: tuple, scaled: Any) -> tuple[Any, tuple]:
        """Return (dL/dxe, state for expert_weights) of local expert j from dL/d(its output rows) ``scaled``."""
        xe, up, s, act, h = saved
        dh = scaled @ self.down[j].T
        d_up = dh * act
        slope = self.xp.subtract(1, s)                             # silu'(g) = s + act (1 - s)
        slope *= act
        slope += s
        d_g = dh * up
        d_g *= slope
        return d_g @ self.gate[j].T + d_up @ self.up[j].T, (j, xe, h, scaled, d_g, d_up)

    def expert_weights(self, state: tuple) -> None:
        """Accumulate local expert's gradients from an expert_backward state."""
        j, xe, h, scaled, d_g, d_up = state
        self.g_down[j] += h.T @ scaled
        self.g_gate[j] += xe.T @ d_g
        self.g_up[j] += xe.T @ d_up

    def forward(self, u: Any) -> tuple[Any, tuple]:
        """Return (MoE output, cache) for (..., d) rows."""
        x = rows(u)
        p, top, w = self.route(x)
        if self.ledger is not None:
            counts = self.xp.bincount(top.reshape(-1), minlength=self.n_experts)
            self.ledger.record(self.layer, counts, p.sum(axis=0), x.shape[0])
        if self.parallel is not None:
            out, experts = self.parallel.forward(x, top, w)
            return out.reshape(u.shape), (x, p, top, w, experts)
        out = self.xp.zeros(x.shape, dtype=x.dtype)
        experts = []
        for e, tokens, choice in self._expert_rows(top):
            ye, saved = self.expert_forward(e, x[tokens])
            out[tokens] += w[tokens, choice][:, None] * ye    # a token picks an expert once: rows are distinct
            experts.append((tokens, choice, ye, e, saved))
        return out.reshape(u.shape), (x, p, top, w, experts)

    def forward_cache(self, u: Any) -> tuple:
        """Return only the cache of forward(u)."""
        return self.forward(u)[1]

    def join(self) -> None:
        """Take part in an expert-parallel step with no rows of this rank's own (an idle serving replica): the
        peers' rows routed to this rank's experts are computed all the same."""
        if self.parallel is not None:
            self.forward(self.xp.zeros((0, self.router.shape[0]), dtype=self.router.dtype))

    def _experts_backward(self, experts: Any, gy: Any, w: Any) -> tuple[Any, Any, list]:
        """(dL/dx through the experts, dL/dw of each choice, expert_weights states) of the held experts' rows."""
        xp = self.xp
        if self.parallel is not None:
            return self.parallel.backward_input(experts, gy, w)
        gx = xp.zeros(gy.shape, dtype=gy.dtype)
        dw = xp.zeros(w.shape, dtype=gy.dtype)
        state = []
        for tokens, choice, ye, e, saved in experts:
            ge = gy[tokens]
            dw[tokens, choice] = (ge * ye).sum(axis=-1)
            scaled = ge * w[tokens, choice][:, None]               # dL/dye
            gxe, weights = self.expert_backward(e, saved, scaled)
            gx[tokens] += gxe
            state.append(weights)
        return gx, dw, state

    def backward_input(self, cache: tuple, g: Any, need_input_grad: bool = True) -> tuple[Any, tuple]:
        """Return (dL/du, state for backward_weight): through every chosen expert and the router."""
        xp = self.xp
        x, p, top, w, experts = cache
        gx, dw, state = self._experts_backward(experts, rows(g), w)
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
        """Accumulate the gradients of the router and of every chosen expert's matrices (local: no exchange)."""
        x = cache[0]
        d_logits, experts = state
        self.g_router += x.T @ d_logits
        for weights in experts:
            self.expert_weights(weights)

    def backward(self, cache: tuple, g: Any, need_input_grad: bool = True) -> Any:
        """Accumulate the weight gradients and return dL/du."""
        gu, state = self.backward_input(cache, g, need_input_grad)
        self.backward_weight(cache, state)
        return gu
