"""Calibrate the simulator's cost model from a measured training trace (``log.trace``)."""

from __future__ import annotations

from collections import defaultdict

from hpcpipe.errors import ScheduleError
from hpcpipe.schedule.costs import COMPUTE, Costs
from hpcpipe.trace import load_trace


def costs_from_trace(path: str, stage_costs: bool = True) -> Costs:
    """Calibrate a cost model from a training trace: mean duration per (op, stage), message and step costs.

    Compute costs are the CPU time of each action when the trace has it (wall
    time otherwise), so that a trace taken with more ranks than cores still
    measures the work, and ``cores`` in the simulation adds the sharing back.

    A message's cost is estimated as the shortest receive wait seen (the
    transfer of a message that was already on its way), step cost as the
    mean ALLREDUCE + OPT_STEP time per rank and step.
    """
    events = load_trace(path)
    sums: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0.0, 0])
    step_total, step_count, recv_min = 0.0, set(), None
    for e in events:
        op, args = e.get("cat", ""), e.get("args", {})
        dur = e["dur"] * 1e-6
        if op in COMPUTE:
            # CPU time is the work itself; wall time also holds time the core served other processes
            dur = args.get("cpu_us", e["dur"]) * 1e-6
            entry = sums[(op, args.get("stage", -1))]
            entry[0] += dur
            entry[1] += 1
        elif op in ("ALLREDUCE", "OPT_STEP"):
            step_total += args.get("cpu_us", e["dur"]) * 1e-6
            step_count.add((e.get("tid"), args.get("step")))
        elif op in ("RECV_F", "RECV_B"):
            recv_min = dur if recv_min is None else min(recv_min, dur)
    if not sums:
        raise ScheduleError(f"trace {path!r} holds no compute events (F, B, I, W)")
    means = {key: total / n for key, (total, n) in sums.items()}

    def overall(op: str) -> float:
        vals = [(v, sums[k][1]) for k, v in means.items() if k[0] == op]
        n = sum(c for _, c in vals)
        return sum(v * c for v, c in vals) / n if n else 0.0

    f, b, w = overall("F"), overall("B"), overall("W")
    if not b:   # a split-backward run: B = I + W
        b = overall("I") + w
    if not w and b:
        w = b / 2
    return Costs(f, b, w, recv_min or 0.0, step_total / max(len(step_count), 1),
                 means if stage_costs else {})


def trace_stages(path: str) -> int:
    """Number of pipeline stages in a trace (largest stage index seen + 1)."""
    return 1 + max((e.get("args", {}).get("stage", -1) for e in load_trace(path)), default=-1)


def calibrated_costs(path: str, pp: int, virtual: int = 1) -> Costs:
    """Per-stage costs for simulating pp x virtual stages, from a trace of the same model at any layout.

    When the trace has the same number of stages its per-stage means are used
    as they are; otherwise the mean costs are rescaled by the ratio of stage
    counts (balanced stages: a stage's work is the model's over the stage count).
    """
    target = pp * virtual
    have = trace_stages(path)
    costs = costs_from_trace(path, stage_costs=have == target)
    if have == target:
        return costs
    return Costs(costs.forward * have / target, costs.backward * have / target, costs.weight * have / target,
                 costs.comm, costs.step)
