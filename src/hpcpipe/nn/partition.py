"""Cutting a model's layer groups into contiguous pipeline stages: balanced by cost, or as the user says."""

from __future__ import annotations

from typing import Any

from hpcpipe.errors import ConfigError


def partition(specs: list[Any], n_stages: int, explicit: list[int] | tuple[int, ...] = ()) -> list[range]:
    """Split layers into n_stages contiguous ranges, minimising the largest stage's FLOPs.

    ``explicit`` (layers per stage) overrides the balancing.
    """
    n = len(specs)
    if not 1 <= n_stages <= n:
        raise ConfigError(f"cannot cut {n} layers into {n_stages} stages (need 1 <= stages <= layers)")
    if explicit:
        if len(explicit) != n_stages or sum(explicit) != n or min(explicit) < 1:
            raise ConfigError(f"stage layer counts {list(explicit)} do not split {n} layers into {n_stages} stages")
        counts = list(explicit)
    else:
        cost = [s.cost for s in specs]
        prefix = [0]
        for c in cost:
            prefix.append(prefix[-1] + c)
        # best[k][i]: smallest achievable max-stage cost for the first i layers in k stages
        inf = float("inf")
        best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
        cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
        best[0][0] = 0
        for k in range(1, n_stages + 1):
            for i in range(k, n - (n_stages - k) + 1):
                for j in range(k - 1, i):
                    value = max(best[k - 1][j], prefix[i] - prefix[j])
                    if value < best[k][i]:
                        best[k][i], cut[k][i] = value, j
        counts, i = [], n
        for k in range(n_stages, 0, -1):
            j = cut[k][i]
            counts.append(i - j)
            i = j
        counts.reverse()
    return layer_ranges(counts)


def layer_ranges(counts: list[int] | tuple[int, ...]) -> list[range]:
    """Layer ranges of consecutive stages with the given layer counts."""
    ranges, start = [], 0
    for c in counts:
        ranges.append(range(start, start + c))
        start += c
    return ranges
