"""Log-probabilities of tokens from the last stage's logits: what ``logprobs`` (and ``echo``) report.

One entry per reported token: ``(token id, its log-probability, [(id, log-probability), ...])``, the list
holding the k most likely ids of that position, most likely first (ties: lower id first). The values are
float32 log-softmax of the model's logits for that position over the ids the sampler draws from (the
tokenizer's vocabulary), before temperature, top-k, top-p and any grammar mask, as vLLM reports them by
default: they say what the model thinks, whatever the request's sampling settings do with it.

    log_softmax(z)_i = (z_i - max z) - log(sum_j exp(z_j - max z))      (float32 throughout)

The entries are plain tuples of ints and floats: they travel from the last stage to rank 0 inside the
serving messages (hpcpipe.serve.protocol) and are turned into OpenAI's response shapes on the HTTP side.
"""

from __future__ import annotations

import math

import numpy as np

Logprob = tuple[int, float, list[tuple[int, float]]]   # token, its log-probability, the top alternatives

MAX_LOGPROBS = 20      # top alternatives a request may ask for (OpenAI's chat limit; documented in docs/serve.md)


def log_softmax32(rows: np.ndarray) -> np.ndarray:
    """Return float32 log-softmax of logits rows (..., vocab) over the last axis."""
    z = np.asarray(rows, dtype=np.float32)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True, dtype=np.float32))


def top(lp: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The k most likely ids of one row of log-probabilities, most likely first, ties by lower id."""
    if k <= 0:
        return []
    k = min(k, lp.size)
    # argpartition finds the k largest in O(V); the cut-off value's ties are then taken lowest id first
    cut = lp[np.argpartition(-lp, k - 1)[k - 1]]
    ids = np.flatnonzero(lp >= cut)
    ids = ids[np.lexsort((ids, -lp[ids]))][:k]
    return [(int(i), float(lp[i])) for i in ids]


def entries(logits: np.ndarray, tokens: list[int], k: int) -> list[Logprob] | None:
    """One entry per row of logits (rows, vocab) for the token that follows it; None if a value is not finite.

    A row whose logits are not finite (a forward that overflowed) has no log-probabilities to report: the
    caller fails that request, as it does when such logits cannot be sampled.
    """
    if len(tokens) == 0:
        return []
    lp = log_softmax32(logits)
    out = []
    for row, token in zip(lp, tokens, strict=True):
        value = float(row[token])
        if not math.isfinite(value) or not np.isfinite(row).all():
            return None
        out.append((int(token), value, top(row, k)))
    return out
