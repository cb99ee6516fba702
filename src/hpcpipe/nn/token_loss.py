"""Token cross-entropy of a language model: logits (micro-batch, T, vocab), integer targets (micro-batch, T)."""

from __future__ import annotations

from typing import Any

from hpcpipe.nn.loss import cross_entropy


def token_cross_entropy(xp: Any, logits: Any, targets: Any, scale: float) -> tuple[float, Any]:
    """Return (summed cross-entropy over every target token, scale * d(sum)/d(logits)).

    Log-sum-exp with the row maximum subtracted, as ``loss.cross_entropy`` (which it
    runs on the tokens as rows); ``scale`` = 1 / (target tokens of the global batch)
    makes the data-parallel sum of the replicas' gradients that of the global mean.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits of shape {tuple(logits.shape)} do not match targets of shape {tuple(targets.shape)}")
    total, grad = cross_entropy(xp, logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), scale)
    return total, grad.reshape(logits.shape)
