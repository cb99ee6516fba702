"""STUB (h-http branch): sampling parameters of one request, until the real hpcpipe.serve.sampling lands.

When merging, keep the other helper's sampling.py and drop this file: only the SamplingParams
dataclass below (same fields, defaults and frozenness) is used by the HTTP front end.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token: temperature 0 = greedy; top_k 0 = off; top_p 1 = off; seed of the request's RNG."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
