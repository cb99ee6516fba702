"""LayerNorm over the last axis (biased variance, eps 1e-5) with a split backward."""

from __future__ import annotations

from typing import Any

from hpcpipe.nn.linear import rows

EPS = 1e-5


class LayerNorm:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the feature axis of a (..., d) block."""

    def __init__(self, weight: Any, bias: Any, grad_weight: Any, grad_bias: Any, xp: Any):
        self.weight, self.bias = weight, bias
        self.grad_weight, self.grad_bias = grad_weight, grad_bias
        self.xp = xp

    def forward(self, x: Any) -> tuple[Any, tuple[Any, Any]]:
        """Return (normalised x, cache = (x_hat, 1 / std))."""
        xp = self.xp
        x_hat = x - x.mean(axis=-1, keepdims=True)
        rstd = 1.0 / xp.sqrt((x_hat * x_hat).mean(axis=-1, keepdims=True) + EPS)
        x_hat *= rstd
        y = x_hat * self.weight
        y += self.bias
        return y, (x_hat, rstd)

    def backward_input(self, cache: tuple[Any, Any], g: Any) -> tuple[Any, Any]:
        """Return (dL/dx, dL/dy); dL/dy feeds backward_weight."""
        x_hat, rstd = cache
        g_hat = g * self.weight
        # g_hat - mean(g_hat) - x_hat mean(g_hat x_hat), with two full-size temporaries instead of five
        gx = x_hat * (g_hat * x_hat).mean(axis=-1, keepdims=True)
        gx += g_hat.mean(axis=-1, keepdims=True)
        self.xp.subtract(g_hat, gx, out=gx)
        gx *= rstd
        return gx, g

    def backward_weight(self, cache: tuple[Any, Any], g: Any) -> None:
        """Accumulate dL/dweight and dL/dbias."""
        self.grad_weight += rows(g * cache[0]).sum(axis=0)
        self.grad_bias += rows(g).sum(axis=0)

    def backward(self, cache: tuple[Any, Any], g: Any) -> Any:
        """Accumulate the weight gradients and return dL/dx."""
        gx, state = self.backward_input(cache, g)
        self.backward_weight(cache, state)
        return gx
