"""Is a cached profile whole? What a hand edit or a half-written file can break, said in one phrase.

A profile cache file that parses as JSON and carries the right key may still
hold a missing group, a time that is not a number, or a negative size; used as
it is, the planner would fail with a traceback or plan on nonsense. The planner
measures such a file again; training with ``parallel.stage_layers = "profile"``
refuses it and names it.
"""

from __future__ import annotations

import math
from typing import Any

SERIES = ("F", "I", "W", "B", "stash_bytes", "work_bytes")
OPTIMIZER_FIELDS = ("seconds_per_param", "work_bytes_per_param", "state_buffers")
OPTIMIZERS = ("sgd", "sgd+momentum", "adam", "adamw")     # what layer_profile measures, every time


def optimizer_name(train: Any) -> str:
    """The optimizer variant whose update cost differs: sgd, sgd+momentum, adam, adamw."""
    momentum = train.optimizer == "sgd" and train.momentum > 0
    return train.optimizer + ("+momentum" if momentum else "")


# no measurement (seconds, bytes or a count) comes near this; squared it stays a float (1e308 overflowed the fit)
LARGEST = 1e15


def _number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and 0 <= value <= LARGEST)


def _series_problem(name: str, series: Any) -> str | None:
    if not isinstance(series, dict) or not series:
        return f"{name} holds no measurements"
    for rows, value in series.items():
        if not (isinstance(rows, str) and rows.isdigit() and int(rows) > 0):
            return f"{name} has micro-batch size {rows!r}"
        if not _number(value):
            return f"{name} at {rows} rows is {value!r}, not a number from 0 to {LARGEST:g}"
    return None


def _group_problem(signature: str, group: Any) -> str | None:
    if not isinstance(group, dict):
        return f"layer group {signature!r} is missing"
    if not (isinstance(group.get("params"), int) and group["params"] >= 0):
        return f"layer group {signature!r} has params {group.get('params')!r}"
    sizes = None
    for name in SERIES:
        problem = _series_problem(f"layer group {signature!r} {name}", group.get(name))
        if problem:
            return problem
        if sizes is None:
            sizes = set(group[name])
        elif set(group[name]) != sizes:
            return f"layer group {signature!r} measured {name} at other sizes than F"
    return None


def _engine_problem(engine: Any) -> str | None:
    if not isinstance(engine, dict):
        return "engine is not a table"
    for name in ("replicas", "pipeline", "pipeline_zb"):
        run = engine.get(name)
        if run is None:
            continue
        if not isinstance(run, dict):
            return f"engine {name} is not a table"
        for field in ("forward", "backward"):
            values = run.get(field)
            if not (isinstance(values, list) and values and all(_number(v) and v > 0 for v in values)):
                return f"engine {name} {field} is {values!r}, not a list of positive factors"
        if name == "replicas" and not (_number(run.get("sync_share", 0.0)) and run.get("sync_share", 0.0) <= 1):
            return f"engine replicas sync_share is {run.get('sync_share')!r}"
    return None


def profile_problem(data: dict) -> str | None:
    """Return what is wrong with a cached layer profile (one phrase), or None when it is whole."""
    layers = data.get("layers")
    if not isinstance(layers, dict):
        return "it has no layers table"
    groups, signatures = layers.get("groups"), layers.get("signatures")
    if not isinstance(groups, dict) or not groups:
        return "it holds no layer groups"
    if not (isinstance(signatures, list) and signatures and all(isinstance(s, str) for s in signatures)):
        return "its list of layer groups (signatures) is empty or not a list of names"
    for signature in dict.fromkeys(signatures):
        problem = _group_problem(signature, groups.get(signature))
        if problem:
            return problem
    optimizers = layers.get("optimizer")
    if not isinstance(optimizers, dict):
        return "it has no optimizer measurements"
    for name in OPTIMIZERS:
        entry = optimizers.get(name)
        if not (isinstance(entry, dict) and all(_number(entry.get(f)) for f in OPTIMIZER_FIELDS)):
            return f"optimizer {name!r} is {entry!r}"
    if not isinstance(data.get("comm"), dict):
        return "it has no communication model (comm)"
    if "engine" in data:
        return _engine_problem(data["engine"])
    return None
