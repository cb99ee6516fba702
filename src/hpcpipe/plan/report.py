"""What the planner prints and writes: the table of best plans, why the best wins, the chosen config."""

from __future__ import annotations

from typing import Any

from hpcpipe.config import Config
from hpcpipe.config_toml import to_toml  # noqa: F401 - the planner's writers take it from here
from hpcpipe.plan.predict import Prediction

MIB = 1024 ** 2


def size_text(n: float) -> str:
    """Bytes as GiB, MiB, KiB or bytes (a budget given without a unit can be a few bytes)."""
    if n >= 1024 ** 3:
        return f"{n / 1024 ** 3:.2f} GiB"
    if n >= MIB:
        return f"{n / MIB:.0f} MiB"
    return f"{n / 1024:.1f} KiB" if n >= 1024 else f"{n:.0f} bytes"


def seconds_text(t: float) -> str:
    """Seconds with three significant digits in s, ms or us (a small model's actions take microseconds)."""
    if t >= 1.0 or t == 0:
        return f"{t:.3f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3g} ms"
    return f"{t * 1e6:.3g} us"


def step_column(t: float) -> str:
    """A step time for the table's 8-wide column: 4 decimals, or 3 significant digits below a millisecond."""
    return f"{t:.4f}" if t >= 1e-3 else f"{t:.3g}"


def describe(p: Prediction) -> str:
    """One plan in a few words: layout, schedule, micro-batches."""
    c = p.candidate
    v = f" v={c.virtual_stages}" if c.virtual_stages > 1 else ""
    return f"{layout(c)} {c.schedule}{v} {c.micro_batches} x {c.micro_batch_size}"


def layout(c: Any) -> str:
    """A candidate's grid: 'dp=2 x pp=4', with ' x tp=2' under tensor parallelism and ' (ep=2)' under expert
    parallelism (over the dp replicas)."""
    ep = getattr(c, "ep", 1)
    return f"dp={c.dp} x pp={c.pp}" + (f" x tp={c.tp}" if c.tp > 1 else "") + (f" (ep={ep})" if ep > 1 else "")


def table(best: list[Prediction], gpt: bool) -> str:
    """The best plans as a text table."""
    rate = "tokens/s" if gpt else "samples/s"
    # a mixture of experts' plans differ by ep too: without the column, rows of ep = 1 and 2 read as duplicates
    eps = any(getattr(p.candidate, "ep", 1) > 1 for p in best)
    ep_head = f" {'ep':>3}" if eps else ""
    head = (f"{'#':>2}  {'dp':>3} {'pp':>3} {'tp':>3}{ep_head}  {'schedule':<22} {'micro-batches':>13}  "
            f"{'stage cut':<16} {'step s':>8} {rate:>10} {'bubble':>7} {'peak/rank':>10}")
    lines = [head, "-" * len(head)]
    for n, p in enumerate(best, 1):
        c = p.candidate
        sched = c.schedule + (f" (v={c.virtual_stages})" if c.virtual_stages > 1 else "")
        cut = ",".join(str(k) for k in c.stage_layers) if len(c.stage_layers) > 1 else "-"
        cut = cut if len(cut) <= 16 else cut[:13] + "..."
        value = p.tokens_per_s if gpt else p.samples_per_s
        micro = f"{c.micro_batches} x {c.micro_batch_size}"
        ep = f" {c.ep:>3}" if eps else ""
        lines.append(f"{n:>2}  {c.dp:>3} {c.pp:>3} {c.tp:>3}{ep}  {sched:<22} {micro:>13}  "
                     f"{cut:<16} {step_column(p.step_time_s):>8} {value:>10,.0f} {p.bubble:>6.1%} "
                     f"{size_text(p.peak_bytes):>10}")
    return "\n".join(lines)


def _parts(p: Prediction) -> str:
    return (f"busiest rank computes {seconds_text(p.busy_max_s)}, pipeline bubble {p.bubble:.1%}, step end "
            f"(allreduce + optimizer) {seconds_text(p.step_end_s)}, {size_text(p.peak_bytes)} per rank")


def reason(best: Prediction, feasible: list[Prediction], over_budget: int) -> str:
    """Why the best plan wins: against the runner-up and the fastest plan of every other layout."""
    lines = [f"best: {describe(best)}, stage cut {list(best.candidate.stage_layers)} "
             f"({best.candidate.cut}): {_parts(best)}."]
    others: dict[tuple[int, int, int], Prediction] = {}
    for p in feasible[1:]:
        key = (p.candidate.dp, p.candidate.pp, p.candidate.tp)
        if key != (best.candidate.dp, best.candidate.pp, best.candidate.tp):
            others.setdefault(key, p)
    if len(feasible) > 1:
        runner = feasible[1]
        lines.append(f"runner-up: {describe(runner)} is {runner.step_time_s / best.step_time_s - 1:+.1%} "
                     f"slower: {_parts(runner)}.")
    for p in others.values():
        lines.append(f"best with {layout(p.candidate)}: {describe(p)} is "
                     f"{p.step_time_s / best.step_time_s - 1:+.1%} slower: {_parts(p)}.")
    if over_budget:
        lines.append(f"{over_budget} plan(s) were discarded for needing more memory per rank than the budget.")
    return "\n".join(lines)


def plan_dict(p: Prediction) -> dict[str, Any]:
    """A plan as JSON: what to run and what it is predicted to do."""
    c = p.candidate
    return {"dp": c.dp, "pp": c.pp, "tp": c.tp, "ep": c.ep, "schedule": c.schedule, "virtual_stages": c.virtual_stages,
            "micro_batches": c.micro_batches, "micro_batch_size": c.micro_batch_size,
            "stage_layers": list(c.stage_layers), "cut": c.cut, "step_time_s": p.step_time_s,
            "samples_per_s": p.samples_per_s, "tokens_per_s": p.tokens_per_s, "bubble": p.bubble,
            "busy_max_s": p.busy_max_s, "step_end_s": p.step_end_s, "peak_bytes_per_rank": p.peak_bytes,
            "memory": p.memory}


def planned_config(config: Config, p: Prediction) -> dict[str, dict[str, Any]]:
    """The config with the plan's layout, schedule, micro-batching and stage cut in place."""
    c = p.candidate
    out = config.to_dict()
    out["parallel"].update(pp=c.pp, dp=c.dp, tp=c.tp, ep=c.ep, schedule=c.schedule, virtual_stages=c.virtual_stages,
                           stage_layers=list(c.stage_layers) if c.pp * c.virtual_stages > 1 else [])
    out["train"].update(micro_batches=c.micro_batches, micro_batch_size=c.micro_batch_size)
    return out
