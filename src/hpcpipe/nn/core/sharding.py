"""How a parameter is cut over the tensor-parallel ranks of a stage: the parts, and the whole again from them.

Files hold whole tensors by global layer (the layout-free contract); a rank holds, per parameter, the
positions :class:`Shard` names along one axis, or the whole tensor (replicated). Each kind says which
(its model's ``shards``): Megatron-style, a column-parallel layer keeps columns of its weight (its output
is cut; its input gradients are summed over the ranks), a row-parallel one keeps rows (its partial outputs
are summed, then a replicated bias added). Attention is cut by heads; a Llama's key/value heads are cut
when tp divides n_kv_heads, else each rank holds the kv heads its query heads use (``shared``: their
gradients are summed over the ranks holding them).

Why the embedding is cut and not replicated: a replicated table would cost every rank of the first and last
stages the whole vocab x d (the largest array of a large-vocabulary model, twice with a tied head), while the
vocabulary-parallel head needs only the rank's rows, and the lookup costs one allreduce of (tokens, d).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

REPLICATED = None


@dataclass(frozen=True)
class Shard:
    """The part of one parameter a rank holds: ``index`` (a slice or sorted int positions) along ``axis``."""

    axis: int | None                  # None: the whole tensor (replicated)
    index: Any = None                 # slice | np.ndarray of positions along axis
    shared: tuple[int, ...] = ()      # the tp ranks holding the same positions (their gradients are summed)
    # (a replicated tensor with ``shared``: every rank holds it whole and adds part of its gradient)

    def take(self, array: Any) -> Any:
        """Return this rank's part of a whole tensor."""
        if self.axis is None:
            return array
        key = [slice(None)] * array.ndim
        key[self.axis] = self.index
        return array[tuple(key)]

    def shape(self, full: tuple[int, ...]) -> tuple[int, ...]:
        """Return the shape of this rank's part of a tensor of shape ``full``."""
        if self.axis is None:
            return tuple(full)
        n = len(range(full[self.axis])[self.index]) if isinstance(self.index, slice) else len(self.index)
        return tuple(n if i == self.axis else s for i, s in enumerate(full))

    def counts_on(self, rank: int) -> bool:
        """Whether rank's copy counts in a sum over all tp ranks (a norm): every cut part once, a replicated
        tensor on rank 0, a shared part on the first rank holding it."""
        if self.axis is None:
            return rank == 0
        return not self.shared or rank == self.shared[0]


def split_range(n: int, tp: int, rank: int) -> slice:
    """The rank's contiguous part of n positions cut into tp near-equal parts (the first n % tp one longer)."""
    bounds = np.linspace(0, n, tp + 1).round().astype(int) if n % tp else np.arange(tp + 1) * (n // tp)
    return slice(int(bounds[rank]), int(bounds[rank + 1]))


def column_part(width: int, tp: int, rank: int) -> Shard:
    """The rank's near-equal part of a weight's ``width`` columns."""
    return Shard(1, split_range(width, tp, rank))


def row_part(height: int, tp: int, rank: int) -> Shard:
    """The rank's near-equal part of a tensor's ``height`` rows (a bias: its positions)."""
    return Shard(0, split_range(height, tp, rank))


def head_columns(n_heads: int, head_dim: int, tp: int, rank: int) -> slice:
    """The columns of the rank's n_heads / tp consecutive heads of width head_dim."""
    per = n_heads // tp
    return slice(rank * per * head_dim, (rank + 1) * per * head_dim)


def kv_heads_of(n_heads: int, n_kv_heads: int, tp: int, rank: int) -> range:
    """The key/value heads the query heads of a rank use (query head i uses kv head i // (n_heads / n_kv_heads))."""
    per, group = n_heads // tp, n_heads // n_kv_heads
    first = rank * per
    return range(first // group, (first + per - 1) // group + 1)


def vocab_range(vocab: int, tp: int, rank: int) -> tuple[int, int]:
    """The token ids [lo, hi) whose embedding rows and logits a rank holds."""
    part = split_range(vocab, tp, rank)
    return part.start, part.stop


def assemble(model: Any, parts: list[dict[int, dict[str, Any]]]) -> dict[int, dict[str, np.ndarray]]:
    """Whole tensors {group: {name: array}} from every tp rank's parts (rank r's at parts[r]), by ``model.shards``."""
    tp = len(parts)
    out: dict[int, dict[str, np.ndarray]] = {}
    for index, first in parts[0].items():
        out[index] = {}
        for name, array in first.items():
            full = np.empty(tuple(model.specs[index].shapes[name]), dtype=array.dtype)
            for rank in range(tp):
                shard = model.shards(index, tp, rank)[name]
                if shard.axis is None:
                    full[...] = parts[0][index][name]
                    break
                key = [slice(None)] * full.ndim
                key[shard.axis] = shard.index
                full[tuple(key)] = parts[rank][index][name]
            out[index][name] = full
    return out
