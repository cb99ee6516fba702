"""What the engine needs of a model kind, declared once: layer groups, their parameters, layers and boundaries.

The trainer, the partition, the parameter buffers and the state code see a model only through
:class:`ModelDef`: ``specs`` (one per HDF5 layer group, with ``index``, ``kind``, ``shapes``,
``n_params``, ``cost``), ``init_arrays``, ``build_layer``, the activation shape at each group
boundary and the loss. Each kind (:mod:`hpcpipe.nn.registry`) implements it in its own folder.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from hpcpipe.nn.core.sharding import Shard
from hpcpipe.nn.protocol import Layer


@dataclass(frozen=True)
class GroupSpec:
    """One decoder layer group: parameters (HDF5 names below /layers/NNNN/), forward cost per token."""

    index: int
    shapes: dict[str, tuple[int, ...]]
    cost: int
    act_elements: int           # elements per sample (window) the group caches for its backward
    kind: str = "gpt"
    frozen: frozenset[str] = frozenset()   # parameters that do not train (LoRA's base): no gradient, no optimizer state

    @property
    def n_params(self) -> int:
        """Number of scalars in the group's parameters."""
        return sum(math.prod(s) for s in self.shapes.values())


class ModelDef:
    """What the engine needs of a model kind; built once from the config (``registry.model_def``)."""

    kind: str
    specs: list
    tied: bool = False
    loss_fn: Callable

    @property
    def n_layers(self) -> int:
        """Number of layer groups (HDF5 /layers entries)."""
        return len(self.specs)

    def init_arrays(self, indices: list[int], seed: int, dtype: str) -> dict[int, dict[str, np.ndarray]]:
        """Return the deterministic initial parameters of the given groups."""
        raise NotImplementedError

    def build_layer(self, index: int, params: dict[str, Any], grads: dict[str, Any], xp: Any,
                    tok_emb: Any = None, grad_tok_emb: Any = None, tp: Any = None) -> Layer:
        """Return the layer of group ``index`` over its parameter and gradient views (``tp``: the stage's
        tensor-parallel group, whose rank holds the parts :meth:`shards` names)."""
        raise NotImplementedError

    def shards(self, index: int, tp: int, rank: int) -> dict[str, Shard]:
        """The part of each parameter of group ``index`` tp rank ``rank`` holds (hpcpipe.nn.core.sharding)."""
        raise NotImplementedError

    def boundary_shared(self, index: int) -> bool:
        """Whether the activation entering group ``index`` is the same on every tp rank (else each holds a part)."""
        return True

    def router_ledger(self, n_micro: int, chunk_tokens: int) -> Any:
        """The statistics an auxiliary loss gathers across stages (a RouterLedger) for layers built after this
        call, or None when the model has no such loss; ``n_micro`` chunks of ``chunk_tokens`` a replica."""
        return None

    def tp_loss(self, tp: Any) -> Callable:
        """The loss function of a last stage whose tp ranks hold parts of the output (loss_fn at tp = 1)."""
        return self.loss_fn

    def boundary(self, index: int, batch: int, tp: int = 1, rank: int = 0) -> tuple[tuple[int, ...], str | None]:
        """Return (shape, dtype or None for the model's dtype) of the activation entering group ``index`` on tp
        rank ``rank`` of ``tp``; ``index == n_layers`` is the model's output."""
        raise NotImplementedError

    def samples_norm(self, n_samples: int) -> int:
        """Return the count a summed loss over n_samples samples is divided by to give the mean."""
        raise NotImplementedError
