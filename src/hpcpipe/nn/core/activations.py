"""Elementwise activations with hand-written forward and backward, in any xp backend.

``forward`` returns (y, what backward needs) and may overwrite its input; ``backward`` turns dL/dy into
dL/dz in place; ``apply_`` is the allocation-free forward of inference (same operations, same order).
"""

from __future__ import annotations

import math
from typing import Any

_GELU_C = math.sqrt(2.0 / math.pi)


class Activation:
    """An elementwise activation: forward returns (y, saved); backward turns dy into dz in place."""

    name = "identity"

    def forward(self, xp: Any, z: Any) -> tuple[Any, Any]:
        """Return (activation of z, what backward needs); may overwrite z."""
        return z, None

    def backward(self, xp: Any, saved: Any, g: Any) -> Any:
        """Return dL/dz from dL/dy; may overwrite g."""
        return g

    def apply_(self, xp: Any, z: Any, scratch: Any) -> None:
        """Overwrite z with the activation of z, allocating nothing (scratch: same shape, may be clobbered).

        The forward-only path of inference; same operations in the same order as ``forward``.
        """


class ReLU(Activation):
    name = "relu"

    def __init__(self):
        self._zeros: dict = {}

    def _zeros_like(self, xp, z):
        # NumPy's maximum against a scalar takes a slow non-SIMD loop (about 4x slower on a
        # 128 x 1024 float32 block than against a same-shape array), so keep one zero block per shape
        key = (z.shape, z.dtype)
        zeros = self._zeros.get(key)
        if zeros is None:
            zeros = self._zeros[key] = xp.zeros(z.shape, dtype=z.dtype)
        return zeros

    def forward(self, xp, z):
        y = xp.maximum(z, self._zeros_like(xp, z), out=z)
        return y, y

    def backward(self, xp, saved, g):
        g *= saved > 0
        return g

    def apply_(self, xp, z, scratch):
        xp.maximum(z, self._zeros_like(xp, z), out=z)


class Tanh(Activation):
    name = "tanh"

    def forward(self, xp, z):
        y = xp.tanh(z, out=z)
        return y, y

    def backward(self, xp, saved, g):
        g *= 1 - saved * saved
        return g

    def apply_(self, xp, z, scratch):
        xp.tanh(z, out=z)


class GELU(Activation):
    """GELU, tanh approximation (as in GPT-2 and jax.nn.gelu's default)."""

    name = "gelu"

    def forward(self, xp, z):
        # c (z + 0.044715 z^3) as z (c + 0.044715 c z^2): products instead of a float power, which
        # costs NumPy about 10x a multiply; three temporaries of z's size, most work in place
        t = z * z
        t *= 0.044715 * _GELU_C
        t += _GELU_C
        t *= z
        xp.tanh(t, out=t)
        y = t + 1
        y *= z
        y *= 0.5
        return y, (z, t)

    def backward(self, xp, saved, g):
        # d/dz = 0.5 (1 + t) + 0.5 z (1 - t^2) c (1 + 3 * 0.044715 z^2)
        z, t = saved
        a = t * t
        xp.subtract(1, a, out=a)
        b = z * z
        b *= 3 * 0.044715 * _GELU_C
        b += _GELU_C
        a *= b
        a *= z
        a += 1
        xp.multiply(t, 0.5, out=b)
        a *= 0.5
        a += b
        g *= a
        return g

    def apply_(self, xp, z, scratch):
        t = scratch
        xp.power(z, 3, out=t)
        t *= 0.044715
        t += z
        t *= _GELU_C
        xp.tanh(t, out=t)
        t += 1
        z *= 0.5
        z *= t


ACTIVATIONS: dict[str, type[Activation]] = {"relu": ReLU, "gelu": GELU, "tanh": Tanh, "identity": Activation}


def make_activation(name: str) -> Activation:
    """Return the activation object for a config name (relu | gelu | tanh | identity)."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r} (known: {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]()
