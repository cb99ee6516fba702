"""Traces: per-rank timed engine events -> one Chrome-trace JSON file (Perfetto, chrome://tracing).

Each world rank is one track (``tid`` = world rank, named "rank R (dp D, pp P)");
each action is a complete event (``ph: "X"``) named like the IR (``s1F3``),
with its kind as category and (stage, mb, step, cpu_us) as arguments, which is what
:func:`hpcpipe.simulate.costs_from_trace` and ``--measured`` read back.
Times are each rank's ``time.perf_counter``, which is one clock for all
processes of a node; across nodes the tracks are aligned at their first event.
"""

from __future__ import annotations

import json
from typing import Any

from .comm import gather_to_root


def rank_events(events_by_step: list[tuple[int, list]], tid: int) -> list[dict]:
    """Turn [(step, [(action, start, end[, cpu]), ...]), ...] into Chrome 'X' events of one track (seconds in)."""
    out = []
    for step, events in events_by_step:
        for action, start, end, *cpu in events:
            args = {"stage": action.stage, "mb": action.mb, "step": step}
            if cpu:
                args["cpu_us"] = cpu[0] * 1e6
            out.append({"name": str(action), "cat": action.op, "ph": "X", "ts": start * 1e6,
                        "dur": (end - start) * 1e6, "pid": 0, "tid": tid, "args": args})
    return out


def write_trace(path: str, world: Any, events_by_step: list[tuple[int, list]], label: str = "") -> None:
    """Gather every rank's events on world rank 0 and write them as one Chrome-trace JSON file (collective)."""
    rank = world.Get_rank()
    mine = (rank, label or f"rank {rank}", rank_events(events_by_step, rank))
    parts = gather_to_root(world, mine, 0)
    if parts is None:
        return
    nodes_t0 = min((e["ts"] for _, _, evs in parts for e in evs), default=0.0)
    trace = []
    for r, name, evs in sorted(parts, key=lambda p: p[0]):
        trace.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": name}})
        for e in evs:
            e["ts"] -= nodes_t0
            trace.append(e)
    with open(path, "w") as f:
        json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, f)
