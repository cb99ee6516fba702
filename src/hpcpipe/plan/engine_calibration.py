"""Scale the layer profile to the engine: short real training runs, traced, against the profile's sums.

The layer profile times each group's kernels in a bench loop. A real rank
runs the same kernels inside the engine (its feed, its gradient buffers, the
caches of the micro-batches in flight) beside other ranks that compute other
things: measured on this machine, 5-25 % slower than the bench for some groups
and faster for others (a memory-bound head beside compute-bound blocks runs
faster than beside another head). Data-parallel replicas also wait for the
slowest at every step's allreduce. Two traced runs of the configured model on
the ranks that share a node measure it:

* ``replicas`` (dp = those ranks, pp = 1): the engine's F and B per
  micro-batch over the profile's sum for the same size, the factors of every
  group's F, and I, W, B, in plans without a pipeline; and ``sync_share``,
  how long the replicas wait for the slowest one's compute to end, over a
  step's compute, which plans with dp > 1 add to their busiest rank;
* ``pipeline`` (dp = 1, pp = those ranks, the profile's balanced cut, 1F1B):
  the same factors per stage, given to each stage's groups, for pipeline
  plans with 1F1B and interleaved 1F1B;
* ``pipeline_zb`` (the same layout under ZB-H1, whose backward is the
  input-gradient and weight-gradient halves): the factors for pipeline plans
  with GPipe and ZB-H1. The schedule moves what an action costs: traced on
  this machine, a head stage's forward took 40-50 % more CPU under 1F1B,
  where it follows the previous micro-batch's backward, than under ZB-H1 or
  GPipe, and one 1F1B calibration made every ZB-H1 plan look 7-14 % slower
  than it ran;
* ``tensor`` (dp = pp = 1, tp = those ranks, when the model splits over them): one tp
  rank's F and B per micro-batch, less its CPU in the tp collectives, over the
  profile's split groups (the factors of plans with tp > 1), and the seconds the
  collectives took per micro-batch and how many there were: a collective in a step
  costs more than the probe's back-to-back allreduce (its ranks arrive apart, each
  waits by polling), which plans with tp > 1 add to every collective (measured on the
  development VM, quiet: 0.3-0.5 ms for a 1 MiB sum the probe puts at 0.2 ms).
"""

from __future__ import annotations

import os
import statistics
import tempfile
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from hpcpipe.config import Config
from hpcpipe.config_checks import tp_splits
from hpcpipe.errors import ConfigError
from hpcpipe.plan.launch import launch, launcher_command
from hpcpipe.trace import load_trace

STEPS = 7               # the first two are warm-up (allocations, BLAS buffers)
TURNS = 2               # runs of each layout, taken in turns
MICRO_BATCHES = 2       # per pipeline stage (2 x pp in a pipeline run)
STEP_BUDGET_S = 0.5     # the largest profiled size whose step the profile puts under this
FACTOR_RANGE = (0.5, 2.0)
MAX_SYNC_SHARE = 0.5
# a tp collective's waiting rank polls on the CPU about this long (runtime.tp_group.YIELD_S), for traces whose
# collectives carry no CPU time of their own (written before they did)
POLL_CPU_S = 0.0005


def calibration_rows(profile: Any) -> int:
    """The micro-batch size to run: the largest profiled one whose predicted step stays short."""
    def step(rows: int) -> float:
        return MICRO_BATCHES * sum(profile.raw_seconds(op, i, rows) for op in "FB" for i in range(profile.n_layers))

    fitting = [rows for rows in profile.sizes if step(rows) <= STEP_BUDGET_S]
    return max(fitting) if fitting else min(profile.sizes)


PATH_KEYS = (("model", "init"), ("model", "adapter"), ("data", "path"), ("data", "eval_path"))


def _run_config(config: Config, dp: int, pp: int, cut: list[int], rows: int, trace: str,
                schedule: str = "1f1b", tp: int = 1) -> dict:
    out = config.to_dict()
    out["parallel"].update(dp=dp, pp=pp, tp=tp, schedule=schedule if pp > 1 else "gpipe", virtual_stages=1,
                           stage_layers=cut if pp > 1 else [])
    out["train"].update(steps=STEPS, micro_batches=MICRO_BATCHES * pp, micro_batch_size=rows, recompute="none")
    out["checkpoint"].update(dir="", resume=False)
    out["log"].update(trace=trace, metrics="", progress=False)
    # the run starts in a temporary folder: files the config names relative to the planner's folder stay found
    for section, key in PATH_KEYS:
        if out[section].get(key):
            out[section][key] = os.path.abspath(out[section][key])
    if not out["data"].get("path"):
        out["data"]["synthetic_samples"] = max(int(out["data"].get("synthetic_samples", 0)),
                                               dp * MICRO_BATCHES * pp * rows)
    return out


def summarize_trace(path: str) -> dict[str, Any]:
    """Per stage, median F and B seconds per micro-batch; the replicas' wait for the slowest; steps >= 2.

    Medians over the steps, as a run's step time is reported: one step that
    met a burst of another process moves neither. The wait of a step is how
    long after its own last compute action each rank, on average, still had
    to wait for the last rank's (one clock for the processes of a node): the
    allreduce's own transfer, already in the step's end, is not in it.
    """
    cells: dict[tuple[int, int], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    stage_of: dict[int, int] = {}
    for e in load_trace(path):
        args, kind = e.get("args", {}), e.get("cat", "")
        if args.get("step", 0) < 2 or kind not in ("F", "B", "I", "W"):
            continue
        tid = e.get("tid", 0)
        cell = cells[(args.get("step", 0), tid)]
        stage_of[tid] = int(args.get("stage", 0))
        op = "F" if kind == "F" else "B"         # a zero-bubble backward is its I and W halves together
        cell[op] += args.get("cpu_us", e["dur"]) * 1e-6
        if kind != "W":
            cell["n" + op] += 1
        cell["end"] = max(cell["end"], (e["ts"] + e["dur"]) * 1e-6)
    full = {key: c for key, c in cells.items() if c["nF"] and c["nB"]}
    if not full:
        raise ConfigError(f"the calibration trace {path!r} holds no forward and backward actions after step 1")
    stages = sorted(set(stage_of.values()))
    steps: dict[int, list[dict]] = defaultdict(list)
    for (step, _), cell in full.items():
        steps[step].append(cell)
    shares = []
    for cs in steps.values():
        last = max(c["end"] for c in cs)
        wait = sum(last - c["end"] for c in cs) / len(cs)
        shares.append(min(MAX_SYNC_SHARE, wait / max(sum(c["F"] + c["B"] for c in cs) / len(cs), 1e-12)))

    def median(op: str, stage: int) -> float:
        return statistics.median(c[op] / c["n" + op] for (_, tid), c in full.items() if stage_of[tid] == stage)

    return {"forward_s": [median("F", s) for s in stages], "backward_s": [median("B", s) for s in stages],
            "sync_share": statistics.median(shares)}


def summarize_tensor_trace(path: str) -> dict[str, Any]:
    """Of a tp run (one stage): per micro-batch, median F and B CPU seconds less the CPU of the tp collectives
    inside them, the collectives' seconds and their count; steps >= 2, medians over steps and ranks.

    A rank waiting in a collective polls on the CPU (yielding the core), then sleeps: the collective's own CPU
    time (its span's ``cpu_us``; in older traces :data:`POLL_CPU_S` at most) inside an action is not compute.
    """
    actions: list[dict] = []
    spans: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for e in load_trace(path):
        args, kind = e.get("args", {}), e.get("cat", "")
        if args.get("step", 0) < 2:
            continue
        if kind == "tp":
            spans[e.get("tid", 0)].append((e["ts"], e["ts"] + e["dur"], args.get("cpu_us")))
        elif kind in ("F", "B"):
            actions.append(e)
    cells: dict[tuple[int, int], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for e in actions:
        inside = [(end - start, cpu) for start, end, cpu in spans[e.get("tid", 0)]
                  if start >= e["ts"] and end <= e["ts"] + e["dur"]]
        cell = cells[(e["args"]["step"], e.get("tid", 0))]
        op = e["cat"]
        polled = sum(min(d, POLL_CPU_S * 1e6) if cpu is None else cpu for d, cpu in inside)
        cell[op] += max(0.0, e["args"].get("cpu_us", e["dur"]) - polled) * 1e-6
        cell["n" + op] += 1
        cell["comm"] += sum(d for d, _ in inside) * 1e-6
        cell["calls"] += len(inside)
    full = [c for c in cells.values() if c["nF"] and c["nB"] and c["calls"]]
    if not full:
        raise ConfigError(f"the calibration trace {path!r} holds no tp collectives inside forward and backward "
                          "actions after step 1")
    return {"forward_s": [statistics.median(c["F"] / c["nF"] for c in full)],
            "backward_s": [statistics.median(c["B"] / c["nB"] for c in full)],
            "collective_s": statistics.median(c["comm"] / c["nF"] for c in full),
            "collectives": statistics.median(c["calls"] / c["nF"] for c in full)}


def tensor_width(config: Config, ranks: int) -> int:
    """The tp of the tensor-parallel calibration run: the widest tp dividing ranks the model splits over (1: none)."""
    return max((t for t in range(2, ranks + 1) if ranks % t == 0 and tp_splits(config.model, t)), default=1)


def _factor(measured: float, predicted: float) -> float:
    low, high = FACTOR_RANGE
    return round(min(high, max(low, measured / max(predicted, 1e-12))), 4)


def _traced_run(config: Config, words: list[str], dp: int, cut: list[int], rows: int,
                timeout_s: float, schedule: str = "1f1b", tp: int = 1) -> dict[str, Any]:
    """Run one traced calibration layout for real; return :func:`summarize_trace` of it
    (:func:`summarize_tensor_trace` at tp > 1)."""
    from hpcpipe.config_toml import to_toml

    pp = len(cut)
    with tempfile.TemporaryDirectory(prefix="hpcpipe-calibrate-") as folder:
        trace = os.path.join(folder, "trace.json")
        path = os.path.join(folder, "calibrate.toml")
        with open(path, "w") as f:
            f.write(to_toml(_run_config(config, dp, pp, cut, rows, trace, schedule, tp),
                            "hpcpipe.plan's calibration run"))
        sched, width = f" {schedule}" if pp > 1 else "", f" x tp={tp}" if tp > 1 else ""
        what = f"the calibration run (dp={dp} x pp={pp}{sched}{width})"
        launch(words, ["hpcpipe.train", "--config", path], what, timeout_s, cwd=folder, ranks=dp * pp * tp)
        return summarize_tensor_trace(trace) if tp > 1 else summarize_trace(trace)


def _factors(profile: Any, cut: list[int], rows: int, runs: list[dict], tp: int = 1) -> dict[str, Any]:
    """One layout's runs averaged, as per-group factors over the profile (groups of a stage share its factor);
    at tp > 1 over the profile's split groups, with the collectives' seconds and count per micro-batch."""
    from hpcpipe.nn.partition import layer_ranges

    out: dict[str, Any] = {"stage_layers": cut, "forward": [], "backward": []}
    if tp > 1:
        out.update(tp=tp, rows=rows, collective_s=statistics.fmean(r["collective_s"] for r in runs),
                   collectives=statistics.fmean(r["collectives"] for r in runs))
    else:
        out["sync_share"] = statistics.fmean(r["sync_share"] for r in runs)
    for key, op in (("forward", "F"), ("backward", "B")):
        out[f"{key}_s"] = [statistics.fmean(r[f"{key}_s"][s] for r in runs) for s in range(len(cut))]
        for s, groups in enumerate(layer_ranges(cut)):
            factor = _factor(out[f"{key}_s"][s], sum(profile.raw_seconds(op, i, rows, tp) for i in groups))
            out[key].extend([factor] * len(groups))
    return out


def calibrate(config: Config, profile: Any, ranks: int, timeout_s: float = 180,
              launcher: str | list[str] | None = None,
              on_run: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Run the model for real on ``ranks`` ranks, as replicas and (ranks > 1) as a pipeline; return the factors.

    And tensor-parallel (``tensor``), when the profile measured the groups split over
    :func:`tensor_width` (the planner profiles the widths its plans may use).
    The runs take turns (replicas, 1F1B, replicas, ZB-H1, tp): a slow spell of the
    machine then falls on every layout instead of tilting one's plans against another's.
    ``on_run(done, total)`` is told before each run and after the last (the progress line).
    """
    from hpcpipe.profiles.stage_cut import measured_cut

    rows = calibration_rows(profile)
    words = launcher_command(launcher)
    pp = min(ranks, profile.n_layers)
    layouts = {"replicas": (ranks, [profile.n_layers], "gpipe", 1)}
    if pp > 1:
        cut = list(measured_cut(profile, pp, rows, raw=True))
        layouts["pipeline"] = (ranks // pp, cut, "1f1b", 1)
        layouts["pipeline_zb"] = (ranks // pp, cut, "zb-h1", 1)
    tp = tensor_width(config, ranks)
    if tp > 1 and rows in profile.sizes_at(tp):
        layouts["tensor"] = (ranks // tp, [profile.n_layers], "gpipe", tp)
    runs: dict[str, list[dict]] = {name: [] for name in layouts}
    # the replicas twice, each pipeline schedule once, in turns: four launches, as many as before the ZB-H1
    # run (six took the first plan of the MLP benchmark to 56 s of its 60 s); the tp run once, last
    order = ["replicas", "pipeline", "replicas", "pipeline_zb"] if pp > 1 else ["replicas"] * TURNS
    order += ["tensor"] if "tensor" in layouts else []
    for done, name in enumerate(order):
        if on_run is not None:
            on_run(done, len(order))
        dp, cut, schedule, width = layouts[name]
        runs[name].append(_traced_run(config, words, dp, cut, rows, timeout_s, schedule, width))
    if on_run is not None:
        on_run(len(order), len(order))
    out: dict[str, Any] = {"rows": rows, "ranks": ranks}
    for name, (_, cut, _, width) in layouts.items():
        out[name] = _factors(profile, cut, rows, runs[name], width)
    return out
