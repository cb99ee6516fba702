"""Affine maps of the GPT layers: a bias-optional Dense with no activation, over (rows, features) blocks.

The GPT layers hold activations as (micro-batch, T, d) blocks and flatten them
to (micro-batch * T, d) rows for these maps, so the weight gradient is one
GEMM over every token of the micro-batch (Dense's in-place BLAS path).
"""

from __future__ import annotations

from typing import Any

from hpcpipe.nn.layers import Activation, Dense


def linear(params: dict[str, Any], grads: dict[str, Any], prefix: str, xp: Any, bias: bool = True,
           reduce_out: Any = None, reduce_input_grad: Any = None) -> Dense:
    """Return ``x @ params[prefix/weight] (+ params[prefix/bias])`` accumulating into the matching grads.

    ``reduce_out`` / ``reduce_input_grad``: the tp group of a row- / column-parallel layer (see Dense).
    """
    return Dense(-1, params[f"{prefix}/weight"], params[f"{prefix}/bias"] if bias else None,
                 grads[f"{prefix}/weight"], grads[f"{prefix}/bias"] if bias else None, Activation(), xp,
                 reduce_out, reduce_input_grad)


def rows(x: Any) -> Any:
    """Return a (micro-batch, T, d) block as (micro-batch * T, d) rows (a view when contiguous)."""
    return x.reshape(-1, x.shape[-1])
