"""The layer protocol: what every layer of a stage offers the engine, declared once.

A layer owns views of its parameters and gradients (given at construction) and
runs on micro-batches. Its backward is split in two halves so that zero-bubble
schedules can run them apart: ``backward_input`` returns the input gradient and
a state, ``backward_weight`` accumulates the weight gradients from that state.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Layer(Protocol):
    """One global layer (an MLP's Dense, a GPT's embedding, block or head) as the stage and the engine use it."""

    def forward(self, x: Any) -> tuple[Any, Any]:
        """Return (output, cache) for one micro-batch."""

    def forward_cache(self, x: Any) -> Any:
        """Return only the cache of forward(x) (recomputation: the output may be skipped)."""

    def backward_input(self, cache: Any, g: Any, need_input_grad: bool = True) -> tuple[Any, Any]:
        """Return (dL/dx, or None when not needed or not defined, and the state backward_weight needs)."""

    def backward_weight(self, cache: Any, state: Any) -> None:
        """Accumulate this micro-batch's parameter gradients from backward_input's state."""

    def backward(self, cache: Any, g: Any, need_input_grad: bool = True) -> Any:
        """Both halves: accumulate the parameter gradients and return dL/dx."""
