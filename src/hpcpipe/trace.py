"""Chrome traces (Perfetto, chrome://tracing): written by training and inference, read back by the simulator.

Each world rank is one track (``tid`` = world rank, named "rank R (dp D, pp P)").
Training writes each action as a complete event (``ph: "X"``) named like the IR
(``s1F3``), with its kind as category and (stage, mb, step, cpu_us) as
arguments, which is what :func:`hpcpipe.schedule.calibrate.costs_from_trace`
and ``simulate --measured`` read back. Inference writes each micro-batch's
phases (read/recv, send-wait, compute, write/send). Times are each rank's
``time.perf_counter``, one clock for all processes of a node; across nodes
the tracks are aligned at their first event. Nothing here uses MPI: the
callers gather the per-rank parts (:func:`hpcpipe.runtime.comm.gather_to_root`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from hpcpipe.errors import ConfigError, ScheduleError
from hpcpipe.runtime.topology import rank_name
from hpcpipe.state.directory_protocol import read_regular
from hpcpipe.state.outputs import write_json_output

COMPUTE = ("F", "B", "I", "W")
TRACE_BYTES = 16 << 30     # a bound far above any trace (the read is of a regular file: it ends)


def _track(tid: int, name: str) -> dict[str, Any]:
    return {"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": name}}


def rank_events(events_by_step: list[tuple[int, list]], tid: int) -> list[dict]:
    """Turn [(step, [(action, start, end[, cpu]), ...]), ...] into Chrome 'X' events of one track (seconds in)."""
    out = []
    for step, events in events_by_step:
        for action, start, end, *cpu in events:
            if isinstance(action, str):     # a named span inside actions (tensor-parallel collectives)
                named: dict[str, Any] = {"step": step}
                if cpu:
                    named["cpu_us"] = cpu[0] * 1e6
                out.append({"name": action, "cat": action.split()[0], "ph": "X", "ts": start * 1e6,
                            "dur": (end - start) * 1e6, "pid": 0, "tid": tid, "args": named})
                continue
            args = {"stage": action.stage, "mb": action.mb, "step": step}
            if cpu:
                args["cpu_us"] = cpu[0] * 1e6
            out.append({"name": str(action), "cat": action.op, "ph": "X", "ts": start * 1e6,
                        "dur": (end - start) * 1e6, "pid": 0, "tid": tid, "args": args})
    return out


def training_trace(parts: list[tuple[int, str, list[dict]]]) -> dict[str, Any]:
    """Merge every rank's (rank, label, rank_events) into one Chrome trace, aligned at the first event."""
    nodes_t0 = min((e["ts"] for _, _, evs in parts for e in evs), default=0.0)
    trace = []
    for r, name, evs in sorted(parts, key=lambda p: p[0]):
        trace.append(_track(r, name))
        for e in evs:
            trace.append({**e, "ts": e["ts"] - nodes_t0})
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def inference_trace(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Return every rank's micro-batch phases as Chrome-trace JSON (one track per world rank, microseconds)."""
    t0 = min(p["start"] for p in parts)
    events: list[dict[str, Any]] = []
    for p in sorted(parts, key=lambda q: q["rank"]):
        tid, first, last = p["rank"], p["pp_rank"] == 0, p["last"]
        events.append(_track(tid, f"rank {tid} ({rank_name(p['dp_rank'], p['pp_rank'])})"))
        phases = (("read" if first else "recv", 0, 1), ("send-wait", 1, 2), ("compute", 2, 3),
                  ("write" if last else "send", 3, 4))
        for m, rows, ev in zip(p["mbs"], p["rows"], p["events"], strict=True):
            for cat, a, b in phases:
                if cat == "send-wait" and ev[b] - ev[a] < 1e-6:
                    continue
                name = f"s{p['pp_rank']}F{m}" if cat == "compute" else f"{cat} {m}"
                events.append({"name": name, "cat": cat, "ph": "X", "ts": (ev[a] - t0) * 1e6,
                               "dur": (ev[b] - ev[a]) * 1e6, "pid": 0, "tid": tid,
                               "args": {"mb": int(m), "rows": int(rows), "stage": p["pp_rank"]}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_json(path: str, obj: Any, kind: str = "trace", what: str = "trace path") -> None:
    """Write obj (a trace or a report) as JSON to path, marked with its kind, whole, never over another's file."""
    write_json_output(path, obj, kind, what)


def load_trace(path: str) -> list[dict]:
    """Return the complete ('X') events of a Chrome trace written by hpcpipe (times in microseconds)."""
    try:
        data = json.loads(read_regular(Path(path), TRACE_BYTES, "trace"))   # a named pipe would block for good
    except ConfigError as exc:
        raise ScheduleError(str(exc)) from None
    except (ValueError, RecursionError) as exc:
        raise ScheduleError(f"cannot read trace {path!r}: {exc}") from None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ScheduleError(f"trace {path!r} is not a Chrome trace: expected a JSON object with a "
                            f"\"traceEvents\" list (or a list of events), got {_kind(data)}")
    return [_checked(e, i, path) for i, e in enumerate(events)
            if not isinstance(e, dict) or e.get("ph") == "X"]


# the fields of a complete event the readers use, and what each must be
_NUMBER_FIELDS = ("ts", "dur")
_INT_ARGS = ("step", "stage", "mb")


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string"}.get(type(value), type(value).__name__)


def _checked(e: Any, i: int, path: str) -> dict:
    """Return trace event i if it is a complete event every reader can use; ScheduleError names what is wrong."""
    where = f"trace {path!r}: traceEvents[{i}]"
    if not isinstance(e, dict):
        raise ScheduleError(f"{where} is {_kind(e)}, not an event object")
    for key in _NUMBER_FIELDS:
        value = e.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ScheduleError(f"{where} has {key} = {value!r}; a finite number of microseconds is needed")
    if e["dur"] < 0 or not math.isfinite(e["ts"] + e["dur"]):
        raise ScheduleError(f"{where} has dur = {e['dur']!r} (ts = {e['ts']!r}); a duration must be >= 0 and end "
                            f"at a finite time")
    if isinstance(e.get("tid"), bool) or not isinstance(e.get("tid"), int):
        raise ScheduleError(f"{where} has tid = {e.get('tid')!r}; an integer track (the world rank) is needed")
    for key in ("name", "cat"):
        if key in e and not isinstance(e[key], str):
            raise ScheduleError(f"{where} has {key} = {e[key]!r}; a string is needed")
    args = e.setdefault("args", {})
    if not isinstance(args, dict):
        raise ScheduleError(f"{where} has args = {args!r}; an object is needed")
    for key in _INT_ARGS:
        if key in args and (isinstance(args[key], bool) or not isinstance(args[key], int)):
            raise ScheduleError(f"{where} has args.{key} = {args[key]!r}; an integer is needed")
    cpu = args.get("cpu_us")
    if cpu is not None and (isinstance(cpu, bool) or not isinstance(cpu, int | float) or not math.isfinite(cpu)
                            or cpu < 0):
        raise ScheduleError(f"{where} has args.cpu_us = {cpu!r}; a finite number >= 0 is needed")
    e.setdefault("cat", "")
    e.setdefault("name", e["cat"])
    return e


def measured_events(path: str, step: int | None = None) -> list[list[tuple[str, float, float]]]:
    """Return per-rank (name, start, end) of one step of a trace (the last one when step is None), seconds."""
    events = load_trace(path)
    if not events:
        raise ScheduleError(f"trace {path!r} holds no complete events (\"ph\": \"X\"): nothing was measured")
    steps = sorted({e.get("args", {}).get("step", 0) for e in events})
    chosen = steps[-1] if step is None else step
    picked = [e for e in events if e.get("args", {}).get("step", 0) == chosen]
    if not picked:
        raise ScheduleError(f"trace {path!r} has no events for step {chosen} (steps: {steps})")
    ranks = sorted({e["tid"] for e in picked})
    t0 = min(e["ts"] for e in picked)
    out = []
    for r in ranks:
        mine = sorted((e for e in picked if e["tid"] == r), key=lambda e: e["ts"])
        out.append([(e["cat"] if e["cat"] not in COMPUTE else e["name"], (e["ts"] - t0) * 1e-6,
                     (e["ts"] + e["dur"] - t0) * 1e-6) for e in mine])
    return out
