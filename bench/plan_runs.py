"""bench_plan's runs: one configuration trained for real and timed, and its result over the rounds.

Every run is ``mpiexec -n N python -m hpcpipe.train`` with the configuration's ``--set`` items, after
waiting for a quiet machine (bench_schedules.wait_quiet); its step time is the median of rank 0's
step_time_s after the warm-up steps, from the run's own metrics file.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys

from bench_schedules import ENV, MPIEXEC, load, wait_quiet


def train_run(config: str, ranks: int, sets: list[str], steps: int, warmup: int, tmp: str, name: str,
              timeout: float) -> dict:
    """Run mpiexec -n ranks python -m hpcpipe.train for `steps` steps; return the median step time and peak RSS."""
    metrics = os.path.join(tmp, f"{name}.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)   # ours, from an earlier round: metrics files are appended to
    cmd = [MPIEXEC, "-n", str(ranks), sys.executable, "-m", "hpcpipe.train", "--config", config,
           "--set", f"train.steps={steps}", "--set", f"log.metrics={json.dumps(metrics)}",
           "--set", 'checkpoint.dir=""', "--set", "log.progress=false", "--set", "log.every=1"]
    for item in sets:
        cmd += ["--set", item]
    try:
        proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"cmd": shlex.join(cmd), "error": f"timed out after {timeout:.0f} s"}
    if proc.returncode:
        lines = (proc.stderr + proc.stdout).strip().splitlines()
        why = next((ln for ln in lines if "error" in ln.lower()), lines[-1] if lines else "")
        return {"cmd": shlex.join(cmd), "error": f"exit {proc.returncode}: {why.strip()}"}
    records = [json.loads(line) for line in open(metrics)]
    times = [r["step_time_s"] for r in records if r["step"] >= warmup]
    if not times:
        return {"cmd": shlex.join(cmd), "error": f"no steps after the {warmup} warm-up steps"}
    summary = [ln for ln in proc.stdout.splitlines() if ln.startswith("hpcpipe: trained")]
    return {"cmd": shlex.join(cmd), "median_s": statistics.median(times), "times": times,
            "peak_rss_bytes": max(r.get("peak_rss_bytes", 0) for r in records),
            "peak_rss_bytes_by_rank": records[-1].get("peak_rss_bytes_by_rank"),
            "summary": summary[-1] if summary else ""}


def timed(args: argparse.Namespace, config: str, sets: list[str], tmp: str, name: str, label: str,
          rnd: int) -> dict:
    """One run of one configuration (round rnd), after waiting for a quiet machine."""
    idle = wait_quiet(args.quiet_idle, args.quiet_wait)
    r = train_run(config, args.ranks, sets, args.steps, args.warmup, tmp, name, args.timeout)
    r.update(idle_before=idle, load_after=load(), round=rnd)
    ok = "error" not in r
    print(f"  {label:40s} " + (f"{r['median_s'] * 1e3:8.1f} ms/step, peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB"
                              if ok else r["error"]) + f"  (idle before {idle:.0%})", flush=True)
    return r


def combine_rounds(rounds: list[dict], statistic: str) -> dict:
    """One configuration's result over its rounds: the statistic of the rounds' medians as its median_s.

    "median" (the default) is the median of the rounds' medians; "fastest" their minimum. On this VM a
    launch keeps its speed for all its steps but the next launch of the same configuration can compute
    20-30 % faster or slower (the ranks' CPU time per action moves, not their waits): the fastest round
    rewards the configuration that drew the luckiest launch, the median of several does not. Peak RSS is
    the largest of the rounds', for the memory check.
    """
    ok = [r for r in rounds if "median_s" in r]
    if not ok:
        return {**rounds[-1], "round_medians_s": [None] * len(rounds)}
    best = dict(min(ok, key=lambda r: r["median_s"]))
    medians = [r["median_s"] for r in ok]
    best.update(round_medians_s=[r.get("median_s") for r in rounds], fastest_s=min(medians),
                median_s=statistics.median(medians) if statistic == "median" else min(medians),
                peak_rss_bytes=max(r["peak_rss_bytes"] for r in ok), statistic=statistic)
    return best
