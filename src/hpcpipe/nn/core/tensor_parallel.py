"""What the layers need of the tensor-parallel ranks of their stage: two in-place reductions, and the
vocabulary-parallel lookup and loss built on them. No MPI here: the runtime passes a group object
(:class:`hpcpipe.runtime.tp_group.TPGroup`), and one rank alone is :data:`SINGLE`.

Vocabulary-parallel cross-entropy (rank r holds the logits of token ids [lo_r, hi_r)): the row maximum
is max-reduced, the sum of exp(z - max) and the target's logit (held by one rank, 0 elsewhere) are
sum-reduced, so every rank knows each row's log-sum-exp and loss; the gradient softmax - onehot stays local.
"""

from __future__ import annotations

from typing import Any, Protocol


class Group(Protocol):
    """The tensor-parallel ranks of a stage, as the layers see them."""

    size: int
    rank: int

    def sum_(self, x: Any) -> Any:
        """Replace x with its element-wise sum over the ranks (in place); return x."""

    def max_(self, x: Any) -> Any:
        """Replace x with its element-wise maximum over the ranks (in place); return x."""


class _Single:
    """One rank: both reductions are the identity."""

    size, rank = 1, 0

    def sum_(self, x: Any) -> Any:
        return x

    def max_(self, x: Any) -> Any:
        return x


SINGLE = _Single()


def is_split(tp: Any) -> bool:
    """True when tp is a group of more than one rank."""
    return tp is not None and tp.size > 1


def vocab_lookup(xp: Any, table: Any, tokens: Any, lo: int, tp: Any) -> Any:
    """Return table rows of tokens when the table holds ids [lo, lo + rows): 0 for ids elsewhere, summed over tp."""
    if not is_split(tp):
        return table[tokens]
    local = tokens - lo
    mine = (local >= 0) & (local < table.shape[0])
    out = table[xp.where(mine, local, 0)]
    out *= mine[..., None]
    return tp.sum_(out)


def vocab_scatter_add(xp: Any, grad_table: Any, tokens: Any, rows: Any, lo: int, tp: Any) -> None:
    """Add each row of rows to grad_table's row of its token when this rank holds it (a repeated token sums)."""
    flat = tokens.reshape(-1)
    if not is_split(tp):
        xp.add.at(grad_table, flat, rows)
        return
    local = flat - lo
    mine = (local >= 0) & (local < grad_table.shape[0])
    xp.add.at(grad_table, local[mine], rows[mine])


def vocab_parallel_cross_entropy(xp: Any, logits: Any, targets: Any, scale: float, lo: int,
                                 tp: Any) -> tuple[float, Any]:
    """Return (summed cross-entropy of every target, scale * d(sum)/d(logits)) from this rank's vocabulary part.

    ``logits`` (micro-batch, T, vocab part) are consumed (the gradient is written into them), as
    :func:`hpcpipe.nn.token_loss.token_cross_entropy` does; every rank returns the same total.
    """
    z = logits.reshape(-1, logits.shape[-1])
    labels = targets.reshape(-1)
    local = labels - lo
    mine = (local >= 0) & (local < z.shape[1])
    row_max = tp.max_(z.max(axis=1, keepdims=True))
    z -= row_max
    rows = xp.arange(labels.shape[0])
    picked = z[rows, xp.where(mine, local, 0)] * mine
    xp.exp(z, out=z)
    both = xp.concatenate([z.sum(axis=1), picked])      # one reduction for the denominators and the targets
    tp.sum_(both)
    n = labels.shape[0]
    denom, picked = both[:n], both[n:]
    total = float((xp.log(denom) - picked).sum())
    z *= scale / denom[:, None]
    z[rows[mine], local[mine]] -= scale
    return total, z.reshape(logits.shape)
