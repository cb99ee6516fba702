"""Benchmark: the simulator's command-line path at pp = 1024, 8192 micro-batches (the issue's size).

    python bench/bench_simulate.py [--rounds 3] [--pp 1024] [--micro-batches 8192] [--schedules gpipe,1f1b]

For each schedule, every round runs in fresh processes (so page faults on
first use and NumPy's import count, as they do for a user):

* a child process times the phases of ``python -m hpcpipe.simulate``'s
  path, in-process: build the timeline arrays, validate them
  (``validate_timeline``), simulate them (``simulate_timeline``);
* the command itself, ``python -m hpcpipe.simulate --schedule S --pp P
  --micro-batches M`` (costs 1,2,1,0), is timed as a whole process (wall
  time, interpreter start and output included), once validating and once
  with ``--no-validate``.

Prints one markdown table: best of the rounds per column, and the median of
the in-process total. The machine may be shared: the load average before and
after is printed with the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ENV = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src"), "OMP_NUM_THREADS": "1",
       "OPENBLAS_NUM_THREADS": "1"}
VIRTUAL = {"interleaved-1f1b": 2, "zb-v": 2}  # virtual stages used for a schedule (1 otherwise)


def child(name: str, pp: int, n_micro: int, virtual: int) -> dict:
    """Time the command's phases in this (fresh) process; return them with the results."""
    t0 = time.perf_counter()
    from hpcpipe.schedule.costs import Costs
    from hpcpipe.schedule.registry import build_timeline
    from hpcpipe.schedule.sweep import simulate_timeline
    from hpcpipe.schedule.validate_timeline import validate_timeline
    t1 = time.perf_counter()
    timeline = build_timeline(name, pp, n_micro, virtual)
    t2 = time.perf_counter()
    validate_timeline(timeline)
    t3 = time.perf_counter()
    costs = Costs(1.0, 2.0, 1.0, 0.0)
    if virtual > 1:
        costs = costs.scaled(1.0 / virtual)      # as simulate_schedule does: costs are per whole stage
    result = simulate_timeline(timeline, costs)
    t4 = time.perf_counter()
    actions = int((timeline.ops >= 0).sum())
    return {"import_s": t1 - t0, "build_s": t2 - t1, "validate_s": t3 - t2, "simulate_s": t4 - t3,
            "actions": actions, "ticks": timeline.n_ticks, "step_time": result.step_time,
            "bubble": result.bubble, "peak_rank0": result.peak_stashed[0]}


def run_child(name: str, pp: int, n_micro: int, virtual: int) -> dict:
    """Run child() in a fresh interpreter and return its measurements."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, str(pp), str(n_micro), str(virtual)]
    out = subprocess.run(cmd, env=ENV, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_cli(name: str, pp: int, n_micro: int, virtual: int, validate: bool) -> float:
    """Wall time of one ``python -m hpcpipe.simulate`` process."""
    cmd = [sys.executable, "-m", "hpcpipe.simulate", "--schedule", name, "--pp", str(pp),
           "--micro-batches", str(n_micro), "--virtual-stages", str(virtual), "--costs", "1,2,1,0"]
    if not validate:
        cmd.append("--no-validate")
    start = time.perf_counter()
    out = subprocess.run(cmd, env=ENV, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - start
    if "simulator        vectorised" not in out.stdout:
        raise RuntimeError(f"{' '.join(cmd)} did not take the vectorised path:\n{out.stdout[:2000]}")
    return wall


def main() -> int:
    """Entry point: run the rounds and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pp", type=int, default=1024)
    parser.add_argument("--micro-batches", type=int, default=8192)
    parser.add_argument("--schedules", default="gpipe,1f1b,zb-h1,interleaved-1f1b,zb-v")
    parser.add_argument("--child", nargs=4, metavar=("SCHEDULE", "PP", "M", "V"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        name, pp, n_micro, virtual = args.child
        print(json.dumps(child(name, int(pp), int(n_micro), int(virtual))))
        return 0
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    load_before = os.getloadavg()
    rows = []
    for name in args.schedules.split(","):
        virtual = VIRTUAL.get(name, 1)
        runs, cli, cli_fast = [], [], []
        for _ in range(args.rounds):       # one process at a time: the machine has 2 cores and is shared
            runs.append(run_child(name, args.pp, args.micro_batches, virtual))
            cli.append(run_cli(name, args.pp, args.micro_batches, virtual, validate=True))
            cli_fast.append(run_cli(name, args.pp, args.micro_batches, virtual, validate=False))
        best = {key: min(r[key] for r in runs) for key in ("build_s", "validate_s", "simulate_s")}
        totals = [r["build_s"] + r["validate_s"] + r["simulate_s"] for r in runs]
        plain = [r["build_s"] + r["simulate_s"] for r in runs]
        first = runs[0]
        rows.append(f"| {name} | {args.pp} x {args.micro_batches}" + (f" (v={virtual})" if virtual > 1 else "")
                    + f" | {first['actions']:,} | {first['ticks']:,} | {best['build_s']:.3f} "
                    f"| {best['validate_s']:.3f} | {best['simulate_s']:.3f} | {min(plain):.3f} "
                    f"| {min(totals):.3f} ({statistics.median(totals):.3f}) | {min(cli):.2f} / {min(cli_fast):.2f} "
                    f"| {first['step_time']:.6g} | {first['bubble']:.4f} |")
    load_after = os.getloadavg()
    print(f"load average before/after: {load_before[0]:.2f} / {load_after[0]:.2f} on {os.cpu_count()} cores; "
          f"best of {args.rounds} fresh-process rounds (median in parentheses); costs F,B,W,comm = 1,2,1,0")
    print()
    print("| schedule | pp x micro-batches | compute actions | ticks | build s | validate s | simulate s "
          "| build + simulate s | build + validate + simulate s | `python -m hpcpipe.simulate` wall s "
          "(validating / --no-validate) | step time | bubble |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
