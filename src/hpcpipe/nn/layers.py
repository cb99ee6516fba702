"""Dense layers (Linear + activation) with hand-written forward and backward, in any xp backend.

Conventions follow the seeds: ``y = act(x @ weight + bias)`` with weight of
shape (in_features, out_features). Backward is split into the input-gradient
half (``backward_input``) and the weight-gradient half (``backward_weight``)
so that zero-bubble schedules can run them apart; ``backward`` runs both.
Gradients accumulate into views of the rank's flat gradient buffer.
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


ACTIVATIONS: dict[str, type[Activation]] = {"relu": ReLU, "tanh": Tanh, "gelu": GELU, "identity": Activation}


def make_activation(name: str) -> Activation:
    """Return the activation object for a config name (relu | gelu | tanh | identity)."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r} (known: {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]()


def blas_threads() -> int:
    """BLAS threads of this process (as hpcpipe capped them on import, or as the user set them)."""
    import os
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return os.cpu_count() or 1


def _inplace_gemm(xp: Any, grad_weight: Any) -> Any:
    """Return SciPy's BLAS sgemm/dgemm for C-contiguous NumPy float32/float64 gradients, else None.

    Only with one BLAS thread: NumPy's and SciPy's wheels each bring their own OpenBLAS,
    and with two or more threads each, the idle threads of one pool spin while the
    other computes (a 64 x 128 x 384 product and an accumulate, interleaved, took
    10.3 ms instead of 0.24 ms on 2 cores; a GPT step of one rank on 2 cores 2.0 s
    instead of 0.35-0.57 s). With more threads NumPy's product and an add are used.
    """
    import numpy as np
    if xp is not np or grad_weight is None or not grad_weight.flags.c_contiguous or blas_threads() > 1:
        return None
    try:
        from scipy.linalg import blas
    except ImportError:   # optional speed-up only: fall back to a temporary and an add
        return None
    return {np.dtype(np.float32): blas.sgemm, np.dtype(np.float64): blas.dgemm}.get(grad_weight.dtype)


class Dense:
    """One global layer: ``act(x @ weight + bias)`` with parameters and gradients as buffer views.

    ``grad_weight`` (and ``grad_bias``) None makes a forward-only layer (KV-cached decoding).
    With tensor parallelism (:mod:`hpcpipe.nn.tensor_parallel`), a row-parallel layer (``reduce_out``:
    the tp group) holds rows of the weight, sums its partial products over the ranks, then adds the
    replicated bias; a column-parallel one (``reduce_input_grad``) holds columns and sums its partial
    input gradients, where the split began.
    """

    def __init__(self, index: int, weight: Any, bias: Any | None, grad_weight: Any, grad_bias: Any | None,
                 activation: Activation, xp: Any, reduce_out: Any = None, reduce_input_grad: Any = None):
        self.index = index
        self.weight, self.bias = weight, bias
        self.grad_weight, self.grad_bias = grad_weight, grad_bias
        self.activation = activation
        self.xp = xp
        self.reduce_out, self.reduce_input_grad = reduce_out, reduce_input_grad
        self._gemm = _inplace_gemm(xp, grad_weight)

    def forward(self, x: Any) -> tuple[Any, tuple[Any, Any]]:
        """Return (output, cache) for input rows x of shape (batch, in_features)."""
        z = x @ self.weight
        if self.reduce_out is not None:
            self.reduce_out.sum_(z)
        if self.bias is not None:
            z += self.bias
        y, saved = self.activation.forward(self.xp, z)
        return y, (x, saved)

    def forward_cache(self, x: Any) -> tuple[Any, Any]:
        """Return only the cache of forward(x) (recomputation): without an activation the output is not computed."""
        if type(self.activation) is Activation:    # a row-parallel output's sum is skipped too, on every rank
            return x, None
        return self.forward(x)[1]

    def backward_input(self, cache: tuple[Any, Any], g: Any, need_input_grad: bool = True) -> tuple[Any, Any]:
        """Return (dL/dx or None, dL/dz) from dL/dy; dL/dz feeds backward_weight."""
        dz = self.activation.backward(self.xp, cache[1], g)
        gx = dz @ self.weight.T if need_input_grad else None
        if gx is not None and self.reduce_input_grad is not None:
            self.reduce_input_grad.sum_(gx)
        return gx, dz

    def backward_weight(self, cache: tuple[Any, Any], dz: Any) -> None:
        """Accumulate dL/dweight and dL/dbias for this micro-batch."""
        x = cache[0]
        if self._gemm is not None and x.flags.c_contiguous and dz.flags.c_contiguous:
            # grad_weight += x.T @ dz in one BLAS call (beta = 1): no (in, out) temporary and no
            # extra pass over it. BLAS is column-major, so work on the transposes:
            # grad_weight.T (Fortran-ordered view) += dz.T @ x.
            self._gemm(1.0, dz.T, x.T, beta=1.0, c=self.grad_weight.T, trans_b=1, overwrite_c=1)
        else:
            self.grad_weight += x.T @ dz
        if self.grad_bias is not None:
            self.grad_bias += dz.sum(axis=0)

    def backward(self, cache: tuple[Any, Any], g: Any, need_input_grad: bool = True) -> Any:
        """Accumulate weight gradients and return dL/dx (None when not needed)."""
        gx, dz = self.backward_input(cache, g, need_input_grad)
        self.backward_weight(cache, dz)
        return gx
