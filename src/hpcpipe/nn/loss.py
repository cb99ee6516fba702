"""Losses evaluated on the last stage: summed value plus the gradient of the global mean.

``mse`` is the mean of squared errors over every element of the global batch
(as the seeds); ``cross_entropy`` is the mean over samples of the softmax
cross entropy with integer labels. Each replica scales its gradient by
1 / (its own sample count [x width]); the data-parallel average of the
replicas then equals the gradient of the global mean.
"""

from __future__ import annotations

from typing import Any


def mse(xp: Any, pred: Any, target: Any, scale: float) -> tuple[float, Any]:
    """Return (sum of squared errors, scale * d(sum)/d(pred))."""
    diff = pred - target
    total = float((diff * diff).sum())
    diff *= 2.0 * scale
    return total, diff


def cross_entropy(xp: Any, logits: Any, labels: Any, scale: float) -> tuple[float, Any]:
    """Return (summed cross entropy over rows, scale * d(sum)/d(logits)) for integer labels."""
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp = xp.exp(shifted)
    denom = exp.sum(axis=1, keepdims=True)
    rows = xp.arange(len(labels))
    total = float((xp.log(denom[:, 0]) - shifted[rows, labels]).sum())
    grad = exp / denom
    grad[rows, labels] -= 1.0
    grad *= scale
    return total, grad


def normaliser(loss: str, n_samples: int, out_dim: int) -> int:
    """Return the count that a summed loss is divided by to give the mean."""
    return n_samples * out_dim if loss == "mse" else n_samples


LOSSES = {"mse": mse, "cross_entropy": cross_entropy}
