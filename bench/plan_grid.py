"""bench_plan's configurations: how one is named and set, resolved without MPI, the grid, its twin in a plan JSON.

A configuration is a dict of dp, pp, schedule, virtual_stages, micro_batches, micro_batch_size and
stage_layers (the stage cut: [] asks for hpcpipe's FLOP-balanced cut). The harness runs each one from
the same config file with ``--set`` items (``overrides_of``), and compares it with the planner's
prediction for the plan that matches it in every one of MATCH_KEYS.
"""

from __future__ import annotations

import json

MATCH_KEYS = ("dp", "pp", "schedule", "virtual_stages", "micro_batches", "stage_layers")


def describe(c: dict) -> str:
    """One table cell naming a configuration: layout, schedule, micro-batches x size, stage cut."""
    v = f" v={c['virtual_stages']}" if c["virtual_stages"] > 1 else ""
    return (f"dp={c['dp']} pp={c['pp']} {c['schedule']}{v} {c['micro_batches']}x{c['micro_batch_size']} "
            f"{c.get('stage_layers') or ''}").rstrip()


def overrides_of(c: dict) -> list[str]:
    """The --set items that make a config run configuration c (stage_layers [] = the FLOP-balanced cut)."""
    cut = c.get("stage_layers", [])
    return [f"parallel.dp={c['dp']}", f"parallel.pp={c['pp']}", f"parallel.schedule=\"{c['schedule']}\"",
            f"parallel.virtual_stages={c['virtual_stages']}",
            f"parallel.stage_layers={json.dumps(cut) if isinstance(cut, list) else repr(cut)}",
            f"train.micro_batches={c['micro_batches']}", f"train.micro_batch_size={c['micro_batch_size']}"]


def check_config(path: str, ranks: int, overrides: list[str]) -> tuple[dict | None, str]:
    """Resolve a configuration without MPI: (its values with the stage cut, '') or (None, why it cannot run)."""
    from hpcpipe.config import load_config, resolve_layout
    from hpcpipe.errors import ConfigError, ScheduleError
    from hpcpipe.nn.partition import partition
    from hpcpipe.nn.registry import model_def
    from hpcpipe.schedule.lower import lower
    from hpcpipe.schedule.registry import build_schedule, shape_of
    from hpcpipe.schedule.validate_programs import validate_programs
    try:
        cfg = load_config(path, overrides)
        dp, pp = resolve_layout(cfg, ranks)
        par, tr = cfg.parallel, cfg.train
        cut = [len(r) for r in partition(model_def(cfg).specs, pp * par.virtual_stages, par.stage_layers)]
        shape = shape_of(par.schedule, pp, tr.micro_batches, par.virtual_stages)
        validate_programs(lower(build_schedule(par.schedule, pp, tr.micro_batches, par.virtual_stages), shape), shape)
    except (ConfigError, ScheduleError) as exc:
        return None, str(exc)
    return {"dp": dp, "pp": pp, "schedule": par.schedule, "virtual_stages": par.virtual_stages,
            "micro_batches": tr.micro_batches, "micro_batch_size": tr.micro_batch_size, "stage_layers": cut,
            "n_layers": cfg.n_layers}, ""


def grid(path: str, ranks: int, global_batch: int, base_size: int) -> tuple[list[dict], list[str]]:
    """The hand-picked grid for this global batch and rank count; returns (runnable configs, skipped notes).

    Every dp x pp = ranks layout; on pipelines GPipe, 1F1B at half, the base and twice the base micro-batch
    count (base: micro-batches of the config's size), interleaved 1F1B (v=2), ZB-H1 at the base and twice,
    ZB-V (v=2); without a pipeline a few micro-batch counts. Stage cut: hpcpipe's FLOP balancing.
    """
    picks = []
    for pp in [d for d in range(1, ranks + 1) if ranks % d == 0]:
        dp = ranks // pp
        base = max(1, global_batch // (dp * base_size))
        if pp == 1:   # no pipeline: every schedule is the same, only the micro-batch count matters
            picks += [("gpipe", 1, m, dp, pp) for m in (1, max(1, base // 4), base, 2 * base)]
            continue
        picks += [(s, v, m, dp, pp) for s, v, m in
                  (("gpipe", 1, base), ("gpipe", 1, 2 * base), ("1f1b", 1, max(1, base // 2)), ("1f1b", 1, base),
                   ("1f1b", 1, 2 * base), ("interleaved-1f1b", 2, base), ("zb-h1", 1, base), ("zb-h1", 1, 2 * base),
                   ("zb-v", 2, base))]
    out, skipped, seen = [], [], set()
    for s, v, m, dp, pp in picks:
        size = global_batch // (dp * m)
        c = {"dp": dp, "pp": pp, "schedule": s, "virtual_stages": v, "micro_batches": m, "micro_batch_size": size}
        key = json.dumps(c, sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        if size < 1 or dp * m * size != global_batch:
            skipped.append(f"{describe(c)}: {dp} x {m} micro-batches do not divide the global batch {global_batch}")
            continue
        resolved, why = check_config(path, ranks, overrides_of({**c, "stage_layers": []}))
        if resolved is None:
            skipped.append(f"{describe(c)}: {why}")
        else:
            out.append({k: resolved[k] for k in MATCH_KEYS + ("micro_batch_size",)})
    return out, skipped


def matching_plan(plan_json: dict, c: dict) -> dict | None:
    """The plan JSON's entry for configuration c, if it lists the same configuration."""
    for p in plan_json.get("plans", []):
        if all(p.get(k) == c.get(k) for k in MATCH_KEYS):
            return p
    return None


def predicted(plan_json: dict, c: dict) -> float | None:
    """The plan's predicted step time of configuration c, if the plan JSON lists the same configuration."""
    p = matching_plan(plan_json, c)
    return p["step_time_s"] if p else None
