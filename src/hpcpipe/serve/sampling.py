"""Drawing the next token from one sequence's logits: greedy, temperature, top-k and top-p (nucleus) sampling.

Each sequence owns a ``Sampler`` with its own PCG64 generator seeded from its
``SamplingParams``, and every sampled token takes exactly one uniform draw (a
greedy token takes none), so the tokens depend only on the parameters and the
sequence's own logits: never on the other sequences, the batch or the layout.
A temperature below ``TEMPERATURE_FLOOR`` is greedy (as 0): below it the
distribution is argmax anyway to within exp(-1/floor) for any logit gap it
could matter for, and logits / temperature overflow float64 well before 1e-308.
Logits whose division by the temperature still overflows (|logits| near
float64's limit) are greedy too; a NaN logit is an error (ValueError), whatever
the temperature, so that a broken forward is never read as a token.
All arithmetic is float64 on the host: z = logits / temperature; top-k keeps
the k largest (ties: lower index first); softmax; top-p keeps the smallest
prefix of the probabilities sorted descending (stable) whose sum reaches top_p;
renormalise; the token is the first candidate whose cumulative probability
exceeds one uniform draw u in [0, 1). Candidates are in descending order of
probability when top-k or top-p is on, else in vocabulary order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

TEMPERATURE_FLOOR = 1e-4     # a smaller positive temperature samples greedily (documented in docs/serve.md)


def _is_int(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence picks its tokens."""

    temperature: float = 1.0   # 0 (or below TEMPERATURE_FLOOR) = greedy (argmax, first index on ties)
    top_k: int = 0             # 0 = off
    top_p: float = 1.0         # nucleus; 1 = off
    seed: int = 0
    logprobs: int = -1         # report each sampled token's log-probability and this many top alternatives; -1 = none
    prompt_logprobs: bool = False   # report the prompt tokens' log-probabilities too (echo), with the same alternatives
    grammar: str = ""          # an llguidance grammar (JSON text) every sampled token must follow; "" = none

    def __post_init__(self):
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"sampling temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"sampling top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"sampling top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if not _is_int(self.seed) or self.seed < 0:
            raise ValueError(f"sampling seed must be an integer >= 0, got {self.seed!r}")
        if not _is_int(self.logprobs) or self.logprobs < -1:
            raise ValueError(f"sampling logprobs must be an integer >= 0 (-1 = none), got {self.logprobs!r}")
        if not isinstance(self.grammar, str) or not isinstance(self.prompt_logprobs, bool):
            raise ValueError(f"sampling grammar must be a string and prompt_logprobs a bool, got "
                             f"{type(self.grammar).__name__} and {self.prompt_logprobs!r}")


def _host_float64(logits: Any) -> np.ndarray:
    """Return 1-D logits (NumPy or a device array with ``.get()``, e.g. CuPy) as a host float64 array."""
    if hasattr(logits, "get") and not isinstance(logits, np.ndarray):
        logits = logits.get()
    z = np.asarray(logits, dtype=np.float64)
    if z.ndim != 1 or z.size == 0:
        raise ValueError(f"sampling needs a non-empty 1-D logits vector, got shape {z.shape}")
    return z


class Sampler:
    """The token picker of one sequence: its parameters and its own random generator."""

    def __init__(self, params: SamplingParams):
        if not isinstance(params, SamplingParams):
            raise ValueError(f"Sampler needs SamplingParams, got {type(params).__name__}")
        self.params = params
        self.rng = np.random.Generator(np.random.PCG64(params.seed))

    def next_token(self, logits: Any) -> int:
        """Return the next token id for this sequence's latest logits (1-D, any float dtype, host or xp)."""
        z = _host_float64(logits)
        p = self.params
        if np.isnan(z).any():
            raise ValueError(f"sampling needs finite logits: {int(np.isnan(z).sum())} of {z.size} are NaN (the "
                             f"model's forward overflowed?)")
        if p.temperature < TEMPERATURE_FLOOR:
            return int(np.argmax(z))
        raw = z
        with np.errstate(over="ignore"):
            z = z / p.temperature
        top = z.max()
        if top == np.inf:         # logits / temperature overflowed (or a logit is +inf): the limit is greedy
            return int(np.argmax(raw))
        if not np.isfinite(top):
            raise ValueError(f"sampling needs at least one finite logit, the largest is {top}")
        if p.top_k == 0 and p.top_p == 1:
            # no filter: the whole vocabulary in index order, without an O(V log V) sort per token
            probs = np.exp(z - top)
            probs /= probs.sum()
            return self._draw(np.cumsum(probs), None)
        # candidates in descending order of logit, ties lower index first
        order = np.argsort(-z, kind="stable")
        if 0 < p.top_k < z.size:
            order = order[:p.top_k]
        probs = np.exp(z[order] - top)
        probs /= probs.sum()
        if p.top_p < 1:
            # the smallest prefix whose sum reaches top_p (at least one token; all of them if rounding falls short)
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p, side="left")) + 1
            order, probs = order[:keep], probs[:keep]
            probs = probs / probs.sum()
        return self._draw(np.cumsum(probs), order)

    def _draw(self, cdf: np.ndarray, order: np.ndarray | None) -> int:
        """Inverse CDF: the first candidate whose cumulative probability exceeds one uniform draw u."""
        pick = int(np.searchsorted(cdf, self.rng.random(), side="right"))
        pick = min(pick, cdf.size - 1)     # u above a last cdf a rounding below 1
        return pick if order is None else int(order[pick])
