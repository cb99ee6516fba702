"""Optimizers over a rank's flat parameter buffer: SGD (momentum, weight decay), Adam, AdamW.

Semantics follow PyTorch's: SGD adds weight decay to the gradient and keeps a
momentum buffer ``buf = momentum * buf + grad``; Adam adds L2 weight decay to
the gradient; AdamW decays the weights directly. Gradient clipping by global
L2 norm is done by the caller (it needs a reduction over all stages).
"""

from __future__ import annotations

import math
from typing import Any

from hpcpipe.config import TrainConfig


class Optimizer:
    """Base class: ``step(params, grads, lr)`` updates params in place; ``state`` names the buffers.

    The update is element-wise, so it runs on any part of the buffers alike: ``step_parts`` updates
    several slices of them as one step (ZeRO-1: a data-parallel rank's shares, :mod:`hpcpipe.train.zero`),
    with the state buffers holding just those slices, end to end.
    """

    def __init__(self, cfg: TrainConfig, xp: Any, size: int, dtype: Any):
        self.cfg, self.xp = cfg, xp
        self.steps = 0
        self.state: dict[str, Any] = {}

    def step(self, params: Any, grads: Any, lr: float | None = None) -> None:
        """Apply one update to params (in place) from grads, at rate lr (default train.lr)."""
        self.step_parts([(params, grads)], lr)

    def step_parts(self, parts: list[tuple[Any, Any]], lr: float | None = None) -> None:
        """Apply one update to every (params, grads) slice; the state buffers hold the slices one after another."""
        self.steps += 1
        rate = self.cfg.lr if lr is None else lr
        offset = 0
        for params, grads in parts:
            n = params.size
            self._update(params, grads, {k: v[offset:offset + n] for k, v in self.state.items()}, rate)
            offset += n

    def _update(self, params: Any, grads: Any, state: dict[str, Any], lr: float) -> None:
        raise NotImplementedError


class SGD(Optimizer):
    """PyTorch's SGD: weight decay added to the gradient, then ``buf = momentum * buf + g``."""

    def __init__(self, cfg, xp, size, dtype):
        super().__init__(cfg, xp, size, dtype)
        if cfg.momentum:
            self.state["momentum"] = xp.zeros(size, dtype=dtype)

    def _update(self, params, grads, state, lr):
        cfg = self.cfg
        g = grads
        if cfg.weight_decay:
            g = grads + cfg.weight_decay * params
        if cfg.momentum:
            buf = state["momentum"]
            buf *= cfg.momentum
            buf += g
            g = buf
        params -= lr * g


class Adam(Optimizer):
    """PyTorch's Adam (L2 weight decay added to the gradient); :class:`AdamW` decays the weights instead."""

    decoupled = False

    def __init__(self, cfg, xp, size, dtype):
        super().__init__(cfg, xp, size, dtype)
        self.state["exp_avg"] = xp.zeros(size, dtype=dtype)
        self.state["exp_avg_sq"] = xp.zeros(size, dtype=dtype)

    def _update(self, params, grads, state, lr):
        cfg, xp = self.cfg, self.xp
        g = grads
        if cfg.weight_decay:
            if self.decoupled:
                params *= 1 - lr * cfg.weight_decay
            else:
                g = grads + cfg.weight_decay * params
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m *= cfg.beta1
        m += (1 - cfg.beta1) * g
        v *= cfg.beta2
        v += (1 - cfg.beta2) * (g * g)
        bias1 = 1 - cfg.beta1 ** self.steps
        bias2 = 1 - cfg.beta2 ** self.steps
        denom = xp.sqrt(v) / math.sqrt(bias2) + cfg.eps
        params -= (lr / bias1) * (m / denom)


class AdamW(Adam):
    """PyTorch's AdamW: decoupled weight decay."""

    decoupled = True


OPTIMIZERS = {"sgd": SGD, "adam": Adam, "adamw": AdamW}


def make_optimizer(cfg: TrainConfig, xp: Any, size: int, dtype: Any) -> Optimizer:
    """Return the optimizer named by train.optimizer for a flat buffer of the given size."""
    return OPTIMIZERS[cfg.optimizer](cfg, xp, size, dtype)


def clip_factor(global_norm: float, max_norm: float) -> float:
    """Return the factor that scales gradients of the given global norm down to max_norm (1 when off)."""
    if max_norm <= 0 or global_norm <= max_norm:
        return 1.0
    return max_norm / (global_norm + 1e-6)
