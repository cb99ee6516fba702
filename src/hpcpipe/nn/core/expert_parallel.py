"""A sparse layer's experts split over ep ranks: each token row goes to its expert's rank and its result back.

Rank r of the ep group holds experts [r E/ep, (r+1) E/ep) (whole experts, in order). For the N rows of a
micro-batch, routed locally to k experts each, roughly::

    order   = the N k (row, choice) pairs sorted by expert          (so by destination rank too)
    counts  = Alltoall(rows per (rank, its expert))                 (every rank sizes what it receives)
    got     = Alltoallv(x[order])                                   (by source rank, then by expert)
    results = one product per held expert over all its received rows, then Alltoallv back
    y       = sum over the k choices of w * result                  (back in each row's own order)

Backward mirrors it: dL/d(result) * w goes to the experts' ranks, dL/d(rows) comes back. The experts'
weight gradients (``backward_weight``) stay local, so zero-bubble schedules split them off as before, and a
held expert's gradient already sums the rows of every ep peer (its data-parallel average then sums only
over the replicas holding the same experts). Every ep rank of a stage runs the same action list, so the
exchanges of their layers pair up in order; a rank with no rows still exchanges (zero rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class Route:
    """Where one micro-batch's rows went: the sender's order and counts, the receiver's regrouping."""

    order: Any              # the (row, choice) pairs sent, in sending order (flat indices into (N, k))
    send_rows: list[int]    # rows sent to each ep rank
    recv_rows: list[int]    # rows received from each ep rank
    perm: Any               # received rows -> grouped by held expert (received[perm])
    sizes: list[int]        # rows of each held expert, in that grouping


class ExpertParallel:
    """The exchange of one sparse layer (``moe``: its SparseMoE) over an ep group (runtime.expert_comm)."""

    def __init__(self, moe: Any, group: Any):
        if moe.n_local * group.size != moe.n_experts:
            raise ValueError(f"expert parallelism: {moe.n_local} experts held on each of {group.size} ranks, but the "
                             f"router scores {moe.n_experts}")
        self.moe, self.group = moe, group

    def _route(self, top: Any) -> Route:
        """Exchange the counts of this micro-batch's rows per expert; return where every row goes and comes from."""
        moe, xp, size = self.moe, self.moe.xp, self.group.size
        flat = top.reshape(-1)
        order = xp.argsort(flat, kind="stable")
        counts = np.asarray(self._host(xp.bincount(flat, minlength=moe.n_experts)), dtype=np.int64)
        per_rank = counts.reshape(size, moe.n_local)
        got = self.group.exchange_counts(per_rank)                  # got[s, j]: rows of rank s for held expert j
        labels = np.repeat(np.tile(np.arange(moe.n_local), size), got.reshape(-1))
        perm = xp.asarray(np.argsort(labels, kind="stable"))
        return Route(order, per_rank.sum(axis=1).tolist(), got.sum(axis=1).tolist(), perm, got.sum(axis=0).tolist())

    @staticmethod
    def _host(a: Any) -> np.ndarray:
        return a.get() if hasattr(a, "get") else np.asarray(a)

    def _each_expert(self, received: Any, route: Route, fn: Any) -> tuple[Any, list]:
        """Apply fn(j, rows) -> (out rows, kept) to each held expert's received rows; return the outputs in the
        received order, and what each kept."""
        xp = self.moe.xp
        grouped = received[route.perm]
        out = xp.empty_like(grouped)
        kept, start = [], 0
        for j, n in enumerate(route.sizes):
            if n:
                out[start:start + n], keep = fn(j, grouped[start:start + n])
                kept.append(keep)
            start += n
        back = xp.empty_like(out)
        back[route.perm] = out
        return back, kept

    def _unsort(self, rows: Any, route: Route, n: int, k: int) -> Any:
        """(n, k, width) from rows in sending order."""
        full = self.moe.xp.empty((n * k, *rows.shape[1:]), dtype=rows.dtype)
        full[route.order] = rows
        return full.reshape(n, k, *rows.shape[1:])

    def forward(self, x: Any, top: Any, w: Any) -> tuple[Any, tuple]:
        """Return (the layer's output rows, cache) of rows x routed to ``top`` with weights ``w``."""
        n, k = top.shape
        route = self._route(top)
        got = self.group.exchange_rows(x[route.order // k], route.send_rows, route.recv_rows)
        results, kept = self._each_expert(got, route, self.moe.expert_forward)
        y = self._unsort(self.group.exchange_rows(results, route.recv_rows, route.send_rows), route, n, k)
        return (w[..., None] * y).sum(axis=1), (route, y, kept)

    def backward_input(self, cache: tuple, gy: Any, w: Any) -> tuple[Any, Any, list]:
        """Return (dL/dx through the experts, dL/dw of each choice, the held experts' weight states)."""
        route, y, kept = cache
        n, k = w.shape
        dw = (gy[:, None, :] * y).sum(axis=-1)
        scaled = (gy[:, None, :] * w[..., None]).reshape(n * k, -1)[route.order]     # dL/d(result), sending order
        got = self.group.exchange_rows(scaled, route.send_rows, route.recv_rows)
        by_expert = iter(kept)
        grads, states = self._each_expert(got, route, lambda j, rows: self.moe.expert_backward(j, next(by_expert),
                                                                                              rows))
        gx = self._unsort(self.group.exchange_rows(grads, route.recv_rows, route.send_rows), route, n, k).sum(axis=1)
        return gx, dw, states
