"""The load-balancing loss of a mixture of experts across pipeline stages, as transformers adds it, per chunk.

For one chunk (a replica's micro-batch) of N tokens through L sparse layers, with C_e the times expert e was
chosen and P_e the summed router probabilities of e, both over every layer and token, and R = L N::

    aux = E * sum_e (C_e / R) (P_e / R)          (transformers' load_balancing_loss_func over all layers)
    loss += coef * mean over the chunks of aux    (with one chunk: transformers' loss exactly)

The layers of a chunk sit on several stages, so the sums travel with the chunk: each stage's message to the
next carries (C, P, R) of the stages before it and its own layers'; the last stage computes aux and the
gradient each probability receives, d aux / d p_e = coef E C_e / (R^2 M) (C counts no gradient; M chunks
a replica), which travels back with the chunk's gradients. Layers record and read through :meth:`record`
and :meth:`aux_grad` for the stage and micro-batch the engine is running (:meth:`begin`).
"""

from __future__ import annotations

from typing import Any

import numpy as np


class RouterLedger:
    """Router statistics of every chunk on this rank, and the load-balancing gradient of each."""

    def __init__(self, n_experts: int, coef: float, n_micro: int, chunk_tokens: int):
        self.n_experts, self.coef, self.n_micro, self.chunk_tokens = n_experts, coef, n_micro, chunk_tokens
        self.reset()

    @property
    def forward_size(self) -> int:
        """Elements of a forward message: C, P and R."""
        return 2 * self.n_experts + 1

    def reset(self) -> None:
        """Forget the last step's chunks."""
        self.current: tuple[int, int] = (0, 0)
        self.received: dict[tuple[int, int], np.ndarray] = {}        # (stage, mb) -> sums of the stages before
        self.local: dict[tuple[int, int], dict[int, np.ndarray]] = {}  # (stage, mb) -> {layer: its C, P, R}
        self.grads: dict[int, np.ndarray] = {}                          # mb -> d loss / d p_e of every layer

    def begin(self, stage: int, mb: int) -> None:
        """Stage ``stage`` is about to compute micro-batch ``mb`` (its layers record or read that chunk's)."""
        self.current = (stage, mb)

    def record(self, layer: int, counts: Any, probs: Any, n_tokens: int) -> None:
        """A sparse layer's choices counted per expert (E,), summed probabilities (E,) and its token count."""
        entry = np.concatenate([_host(counts), _host(probs), [float(n_tokens)]])
        self.local.setdefault(self.current, {})[layer] = entry       # a recomputed forward records it again

    def forward_message(self, stage: int, mb: int) -> np.ndarray:
        """The sums of stages 0..stage for micro-batch ``mb``: what its activation carries to stage + 1."""
        total = self.received.get((stage, mb), np.zeros(self.forward_size))
        for entry in self.local.get((stage, mb), {}).values():
            total = total + entry
        return total

    def receive_forward(self, stage: int, mb: int, sums: Any) -> None:
        """The sums stage ``stage`` received with micro-batch ``mb`` (from the stage before, here or elsewhere)."""
        self.received[(stage, mb)] = _host(sums).reshape(-1)

    def finish(self, stage: int, mb: int) -> float:
        """On the last stage: the chunk's contribution to the step's summed loss (coef aux x its tokens, so the
        summed loss over the global tokens gives coef x the mean aux), and its gradient for every layer."""
        sums = self.forward_message(stage, mb)
        e = self.n_experts
        counts, probs, rows = sums[:e], sums[e:2 * e], sums[2 * e]
        aux = e * float((counts / rows) @ (probs / rows)) if rows else 0.0
        self.grads[mb] = self.coef * e * counts / (rows * rows * self.n_micro) if rows else np.zeros(e)
        return self.coef * aux * self.chunk_tokens

    def backward_message(self, mb: int) -> np.ndarray:
        """What micro-batch ``mb``'s gradient carries back: the probabilities' load-balancing gradient."""
        return self.grads[mb]

    def receive_backward(self, mb: int, grad: Any) -> None:
        """The load-balancing gradient received with micro-batch ``mb``'s gradient."""
        self.grads[mb] = _host(grad).reshape(-1)

    def aux_grad(self, probs: Any) -> Any:
        """d loss / d probs of a sparse layer of the current chunk: the same row for every token."""
        grad = self.grads[self.current[1]]
        if isinstance(probs, np.ndarray):
            return grad.astype(probs.dtype)[None, :]
        import cupy  # a GPU run's probabilities: the row goes to the device once per layer

        return cupy.asarray(grad, dtype=probs.dtype)[None, :]


def _host(a: Any) -> np.ndarray:
    """A float64 NumPy copy of a (NumPy or CuPy) array."""
    return np.asarray(a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else a, dtype=np.float64)
