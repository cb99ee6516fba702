"""The decoders' norms over the last axis, each with a split backward: LayerNorm (GPT) and RMSNorm (Llama).

LayerNorm: biased variance, eps 1e-5, ``(x - mean) / sqrt(var + eps) * weight + bias``.

RMSNorm, with r = 1 / sqrt(mean(x^2) + eps) per row::

    x_hat = x * r,   y = x_hat * w                 (transformers' LlamaRMSNorm: x * rsqrt(var + eps) * w)

and backward, with g_hat = g * w::

    dx = r * (g_hat - x_hat * mean(g_hat * x_hat)),   dw = sum over rows of g * x_hat
"""

from __future__ import annotations

from typing import Any

from hpcpipe.nn.core.dense import rows

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

    def forward_cache(self, x: Any) -> tuple[Any, Any]:
        """Return only the cache of forward(x)."""
        return self.forward(x)[1]

    def backward_input(self, cache: tuple[Any, Any], g: Any, need_input_grad: bool = True) -> tuple[Any, Any]:
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
        """Accumulate dL/dweight and dL/dbias (nothing when frozen: LoRA's base)."""
        if self.grad_weight is None:
            return
        self.grad_weight += rows(g * cache[0]).sum(axis=0)
        self.grad_bias += rows(g).sum(axis=0)

    def backward(self, cache: tuple[Any, Any], g: Any, need_input_grad: bool = True) -> Any:
        """Accumulate the weight gradients and return dL/dx."""
        gx, state = self.backward_input(cache, g)
        self.backward_weight(cache, state)
        return gx


class RMSNorm:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the feature axis of a (..., d) block."""

    def __init__(self, weight: Any, grad_weight: Any, eps: float, xp: Any):
        self.weight, self.grad_weight = weight, grad_weight
        self.eps = float(eps)
        self.xp = xp

    def forward(self, x: Any) -> tuple[Any, tuple[Any, Any]]:
        """Return (normalised x, cache = (x_hat, r))."""
        xp = self.xp
        x_hat = x * x                                  # the squares first, then x_hat in the same buffer
        r = x_hat.mean(axis=-1, keepdims=True)
        r += self.eps
        xp.sqrt(r, out=r)
        xp.reciprocal(r, out=r)
        xp.multiply(x, r, out=x_hat)
        return x_hat * self.weight, (x_hat, r)

    def forward_cache(self, x: Any) -> tuple[Any, Any]:
        """Return only the cache of forward(x)."""
        return self.forward(x)[1]

    def backward_input(self, cache: tuple[Any, Any], g: Any, need_input_grad: bool = True) -> tuple[Any, Any]:
        """Return (dL/dx, dL/dy); dL/dy feeds backward_weight."""
        x_hat, r = cache
        xp = self.xp
        g_hat = g * self.weight
        t = g_hat * x_hat                              # two full-size temporaries in all
        xp.multiply(x_hat, t.mean(axis=-1, keepdims=True), out=t)
        g_hat -= t
        g_hat *= r
        return g_hat, g

    def backward_weight(self, cache: tuple[Any, Any], g: Any) -> None:
        """Accumulate dL/dweight (nothing when frozen: LoRA's base)."""
        if self.grad_weight is None:
            return
        self.grad_weight += rows(g * cache[0]).sum(axis=0)

    def backward(self, cache: tuple[Any, Any], g: Any, need_input_grad: bool = True) -> Any:
        """Accumulate the weight gradient and return dL/dx."""
        gx, state = self.backward_input(cache, g)
        self.backward_weight(cache, state)
        return gx
