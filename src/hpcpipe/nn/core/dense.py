"""Dense layers (Linear + activation) with hand-written forward and backward, in any xp backend.

Conventions follow the seeds: ``y = act(x @ weight + bias)`` with weight of
shape (in_features, out_features). Backward is split into the input-gradient
half (``backward_input``) and the weight-gradient half (``backward_weight``)
so that zero-bubble schedules can run them apart; ``backward`` runs both.
Gradients accumulate into views of the rank's flat gradient buffer.
"""

from __future__ import annotations

from typing import Any

from hpcpipe.nn.core.activations import Activation


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
    With tensor parallelism (:mod:`hpcpipe.nn.core.tensor_parallel`), a row-parallel layer (``reduce_out``:
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
        """Accumulate dL/dweight and dL/dbias for this micro-batch (nothing for a frozen layer: LoRA's base)."""
        if self.grad_weight is None:
            return
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


ADAPTER = "adapter"   # a parameter group's key for hpcpipe.nn.lora's wrapper of the maps that carry adapters


def linear(params: dict[str, Any], grads: dict[str, Any], prefix: str, xp: Any, bias: bool = True,
           reduce_out: Any = None, reduce_input_grad: Any = None, activation: Activation | None = None) -> Dense:
    """Return ``act(x @ params[prefix/weight] (+ params[prefix/bias]))`` accumulating into the matching grads.

    ``reduce_out`` / ``reduce_input_grad``: the tp group of a row- / column-parallel layer (see Dense).
    A decoder holds (micro-batch, T, d) blocks and flattens them to rows (:func:`rows`) for these maps, so
    the weight gradient is one GEMM over every token of the micro-batch. A group holding ``prefix/lora_a``
    and ``prefix/lora_b`` (LoRA) has the map wrapped by its ``ADAPTER`` (the kinds' code does not change).
    """
    dense = Dense(-1, params[f"{prefix}/weight"], params[f"{prefix}/bias"] if bias else None,
                  grads[f"{prefix}/weight"], grads[f"{prefix}/bias"] if bias else None, activation or Activation(), xp,
                  reduce_out, reduce_input_grad)
    adapter = params.get(ADAPTER)
    return adapter(dense, prefix) if adapter is not None and f"{prefix}/lora_a" in params else dense


def rows(x: Any) -> Any:
    """Return a (micro-batch, T, d) block as (micro-batch * T, d) rows (a view when contiguous)."""
    return x.reshape(-1, x.shape[-1])
