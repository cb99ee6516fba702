"""How each parameter of a layer group is cut over the tensor-parallel ranks of a stage (Megatron-style).

Files hold whole tensors by global layer (the layout-free contract); a rank holds, per parameter, the
positions :class:`Shard` names along one axis, or the whole tensor (replicated). With tp ranks:

* **mlp**: layers alternate column- and row-parallel. Even layers cut their weight's columns (and bias),
  so their output is cut too; odd layers cut their weight's rows (the input they receive is cut), sum
  their partial outputs over the ranks (one allreduce) and add a replicated bias.
* **gpt**: attention by heads: ``attn/qkv`` keeps the q, k and v columns of the rank's heads (column-
  parallel), ``attn/proj`` their rows (row-parallel); the MLP by hidden columns: ``mlp/fc`` column-, ``mlp/proj``
  row-parallel; LayerNorms, ``pos_emb`` and the row-parallel biases replicated. ``tok_emb`` is cut by
  vocabulary rows and the untied head by vocabulary columns (the logits and the loss are vocabulary-
  parallel: a distributed log-sum-exp), so a tied head multiplies by the rank's own embedding rows.
* **llama**: the same, q by query heads; k and v by key/value heads when tp divides n_kv_heads, else each
  rank holds the key/value heads its query heads use (replicated over tp / n_kv_heads ranks, ``shared``:
  their gradients are summed over those ranks); gate and up column-, down and o row-parallel; norms replicated.

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


def _cols(width: int, tp: int, rank: int) -> Shard:
    return Shard(1, split_range(width, tp, rank))


def _rows(height: int, tp: int, rank: int) -> Shard:
    return Shard(0, split_range(height, tp, rank))


def _heads(n_heads: int, head_dim: int, tp: int, rank: int) -> slice:
    per = n_heads // tp
    return slice(rank * per * head_dim, (rank + 1) * per * head_dim)


def mlp_shards(index: int, names: list[str], fan_in: int, fan_out: int, tp: int, rank: int) -> dict[str, Shard]:
    """Shards of MLP layer ``index``: even layers column-parallel, odd layers row-parallel."""
    if index % 2 == 0:
        return {"weight": _cols(fan_out, tp, rank), **({"bias": _rows(fan_out, tp, rank)} if "bias" in names else {})}
    return {"weight": _rows(fan_in, tp, rank), **({"bias": Shard(REPLICATED)} if "bias" in names else {})}


def gpt_shards(shape: Any, index: int, names: list[str], tp: int, rank: int) -> dict[str, Shard]:
    """Shards of GPT layer group ``index`` (names: the group's parameter names)."""
    d, dh = shape.d_model, shape.d_model // shape.n_heads
    out = dict.fromkeys(names, Shard(REPLICATED))
    if index == 0:
        out["tok_emb"] = _rows(shape.vocab, tp, rank)
    elif index <= shape.n_blocks:
        heads = _heads(shape.n_heads, dh, tp, rank)
        qkv = np.concatenate([np.arange(d)[heads] + part * d for part in range(3)])
        out.update({"attn/qkv/weight": Shard(1, qkv), "attn/qkv/bias": Shard(0, qkv),
                    "attn/proj/weight": Shard(0, heads), "mlp/fc/weight": _cols(shape.ff, tp, rank),
                    "mlp/fc/bias": _rows(shape.ff, tp, rank), "mlp/proj/weight": _rows(shape.ff, tp, rank)})
    elif "head/weight" in names:
        out["head/weight"] = _cols(shape.vocab, tp, rank)
    return out


def kv_heads_of(n_heads: int, n_kv_heads: int, tp: int, rank: int) -> range:
    """The key/value heads the query heads of a rank use (query head i uses kv head i // (n_heads / n_kv_heads))."""
    per, group = n_heads // tp, n_heads // n_kv_heads
    first = rank * per
    return range(first // group, (first + per - 1) // group + 1)


def llama_shards(shape: Any, index: int, names: list[str], tp: int, rank: int) -> dict[str, Shard]:
    """Shards of llama layer group ``index`` (names: the group's parameter names)."""
    out = dict.fromkeys(names, Shard(REPLICATED))
    if index == 0:
        out["tok_emb"] = _rows(shape.vocab, tp, rank)
    elif index <= shape.n_blocks:
        hd = shape.head_dim
        q = _heads(shape.n_heads, hd, tp, rank)
        kv = kv_heads_of(shape.n_heads, shape.n_kv_heads, tp, rank)
        kv_cols = slice(kv.start * hd, kv.stop * hd)
        shared = tuple(r for r in range(tp) if kv_heads_of(shape.n_heads, shape.n_kv_heads, tp, r) == kv) \
            if tp > shape.n_kv_heads else ()
        out.update({"attn/q/weight": Shard(1, q), "attn/o/weight": Shard(0, q),
                    "attn/k/weight": Shard(1, kv_cols, shared), "attn/v/weight": Shard(1, kv_cols, shared),
                    "mlp/gate/weight": _cols(shape.ff, tp, rank), "mlp/up/weight": _cols(shape.ff, tp, rank),
                    "mlp/down/weight": _rows(shape.ff, tp, rank)})
        if "attn/q/bias" in names:
            out.update({"attn/q/bias": Shard(0, q), "attn/k/bias": Shard(0, kv_cols, shared),
                        "attn/v/bias": Shard(0, kv_cols, shared)})
    elif "head/weight" in names:
        out["head/weight"] = _cols(shape.vocab, tp, rank)
    return out


def decoder_shards(shape: Any, index: int, names: list[str], tp: int, rank: int) -> dict[str, Shard]:
    """Shards of a decoder's layer group ``index``: llama's for a shape with key/value heads, else GPT's."""
    if hasattr(shape, "n_kv_heads"):
        return llama_shards(shape, index, names, tp, rank)
    return gpt_shards(shape, index, names, tp, rank)


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
