"""The final of bench_plan: the top plan against each grid configuration that came close to it, in adjacent pairs.

The first pass (every configuration, round after round) ranks the grid, but on this
VM one launch of a configuration computes 10-30 % faster or slower than the next, and
the machine has slower spells lasting tens of seconds; a grid of 13 then always holds
some configuration whose few launches were all lucky, and its minimum is biased low.
So the configurations whose first-pass step time came within --final-within of the
fastest are run again, each right after (or before, alternately) a run of the top
plan, and compared pair by pair: the ratio top / configuration of each pair, median
over the pairs. Fresh runs estimate each ratio without the first pass's selection,
and a pair's two runs share the machine's spell.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable


def finalists(rows: list[dict], within: float, is_top: Callable[[dict], bool]) -> list[int]:
    """Indices of the grid rows (not the top plan's own) within ``within`` of the fastest first-pass time."""
    times = [r["median_s"] for r in rows if "median_s" in r]
    if not times:
        return []
    bound = min(times) * (1 + within)
    return [i for i, r in enumerate(rows) if "median_s" in r and r["median_s"] <= bound and not is_top(r)]


def run_pairs(run: Callable[[int, int], dict], chosen: list[int], rounds: int) -> dict[int, dict]:
    """Run (top, row i) pairs ``rounds`` times for each chosen i; return per i its paired ratios and their median.

    ``run(k, rnd)`` runs job k (-1: the top plan, else grid row k) and returns its result (``median_s``).
    The top plan goes first in even rounds and second in odd ones, so a trend in the machine's speed
    does not favour either side.
    """
    out: dict[int, dict] = {i: {"pairs": []} for i in chosen}
    for rnd in range(rounds):
        for i in chosen:
            order = (-1, i) if rnd % 2 == 0 else (i, -1)
            got = {k: run(k, rnd) for k in order}
            if "median_s" in got[-1] and "median_s" in got[i]:
                out[i]["pairs"].append([got[-1]["median_s"], got[i]["median_s"]])
    for entry in out.values():
        ratios = [a / b for a, b in entry["pairs"]]
        entry["ratios"] = ratios
        entry["ratio"] = statistics.median(ratios) if ratios else None
    return out


def final_check(pairs: dict[int, dict], rows: list[dict], limit: float = 1.05) -> dict:
    """The claim "top within 5 % of the fastest grid run" from the pairs: the largest median ratio."""
    rated = {i: p["ratio"] for i, p in pairs.items() if p["ratio"] is not None}
    if not pairs:
        return {"value": 1.0, "limit": limit, "ok": True,
                "note": "no other grid configuration came within reach of the top plan in the first pass"}
    if len(rated) < len(pairs):   # a close configuration without one good pair was not compared: no verdict
        missing = ", ".join(f"grid-{i:02d}" for i in sorted(set(pairs) - set(rated)))
        return {"value": max(rated.values(), default=float("nan")), "limit": limit, "ok": False,
                "note": f"no pair of the final ran to the end for {missing}"}
    worst = max(rated, key=lambda i: rated[i])
    c = rows[worst]["config"]
    return {"value": rated[worst], "limit": limit, "ok": rated[worst] <= limit,
            "note": f"paired final runs: top / grid-{worst:02d} ({c['schedule']} dp{c['dp']} pp{c['pp']} "
                    f"{c['micro_batches']}x{c['micro_batch_size']}), median of {len(pairs[worst]['ratios'])} pairs"}
