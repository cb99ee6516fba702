"""2 emulated nodes (jobs/netns-cluster.sh) vs one: GPT training and llama serving at dp=2, pp=2, tp=2, and the planner.

    python bench/bench_cluster.py [--rates 10gbit,1gbit] [--rounds 3] [--steps 8] [--profile-once]
                                  [--statistic rounds|min|median] [--no-within] [--no-serve] [--out FILE]  # as root

Each layout runs on 2 ranks placed **within a node** (both ranks in node 0: MPICH's shared memory) and
**across nodes** (one rank on each of 2 nodes, every message over TCP through the shaped links), at each
link rate. Every rank has one BLAS thread (HPCPIPE_THREADS=1): the 2 "nodes" share this machine's cores.

* Training: configs/plan-gpt.toml (GPT, vocab 8192, 4 blocks of d 128, untied, Adam), global batch 32
  sequences. The planner (``python -m hpcpipe.plan --ranks 2 --global-batch 32``) plans it within a node
  and for 2 nodes x 1 rank with ``--nodes 2 --network PROBE.json --host-shared``, PROBE.json being
  ``python -m hpcpipe.plan.probe`` run on one rank of each node at that rate (the comm model calibrated
  across the links, once per rate). Of the first round's plans the fastest plan of each layout (dp=2, pp=2,
  tp=2) is a row; every round runs each row once (--steps steps, rows in turns), measured = the run's median
  step_time_s after the first 2 steps. Every round first measures the planner's profile (layer bench and
  engine calibration) again, in a new cache but for the within-node comm probe, and plans again; each row
  runs the same plan (layout, schedule, micro-batches) as that round predicts it, and its error is the
  median over the rounds of each round's error against its own prediction (--statistic rounds): this VM's
  speed drifts by tens of per cent within minutes, and a profile measured once compared later rounds with
  an earlier spell. --profile-once measures the profile once, at the first rate, and takes the prediction
  against the fastest round (--statistic min) or the rounds' median (median). Every statistic is kept in
  the results. Before every run and planning the
  bench waits up to --quiet-wait s for the cores to be --quiet idle, and records the idle share and load it
  ran under. Bytes per step per link: the metrics' link_bytes (what each node sent to the other in the step)
  and, as a check, the link's own counter over the whole run (with TCP/IP headers, start-up and MPI's own
  messages).
* Serving: a random llama (d 256, 4 blocks, 8 heads / 4 key-value heads, vocabulary 256, bytes
  tokenizer) at dp=2, pp=2, tp=2; 8 clients send 24 requests (32-byte prompts, 32 new tokens, greedy);
  tokens per second over the whole load, the median request latency, and the bytes the link carried.

Results: bench/results/<today>-cluster.json (with the probes, blocking and polled allreduce; each planning's
profile: its load, seconds and the planner's engine calibration, its tp run's collective seconds; each layer
group's whole and tp = 2 split times, ``split_s``, of the first), and a table printed for docs/cluster.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from bench_schedules import ENV, MPIEXEC, dated_out, idle_fraction, wait_quiet, write_results  # noqa: E402
from cluster_rows import LAYOUTS, STATISTICS, best_per_layout, describe, print_tables, same_plan, summarise  # noqa: E402

SCRIPT = ROOT / "jobs" / "netns-cluster.sh"
NAME, NET = "hpcbench", "10.213.11"
CLUSTER_ENV = {"HPCPIPE_NETNS_NAME": NAME, "HPCPIPE_NETNS_NET": NET, "HPCPIPE_NETNS_DIR": f"/run/{NAME}-netns"}
CONFIG = ROOT / "configs" / "plan-gpt.toml"
WARMUP = 2
LLAMA = {"kind": "llama", "vocab_size": 256, "seq_len": 256, "d_model": 256, "n_heads": 8, "n_kv_heads": 4,
         "n_blocks": 4, "d_ff": 768, "tie_embeddings": False, "dtype": "float32"}


def cluster(*args: str) -> str:
    """Run jobs/netns-cluster.sh with the bench's own names; its stdout (SystemExit on failure)."""
    proc = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          env={**os.environ, **CLUSTER_ENV}, check=False)
    if proc.returncode:
        raise SystemExit(f"bench_cluster: netns-cluster.sh {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout


def launcher(within: bool) -> list[str]:
    """mpiexec placing 2 ranks in node 0 (within) or one in each node (across)."""
    return [MPIEXEC, *cluster("args").split(), "-n", "2", "-ppn", "2" if within else "1"]


def link_counters() -> list[int]:
    """Bytes each node has sent over its link so far (the host end's receive counter)."""
    return [int(Path(f"/sys/class/net/{NAME}-v{k}/statistics/rx_bytes").read_text()) for k in range(2)]


def cpu_ticks() -> tuple[int, int]:
    """(steal, total) jiffies of all cores so far (/proc/stat): the hypervisor's share of this VM's time."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return fields[7], sum(fields[:8])


def steal_share(before: tuple[int, int]) -> float:
    """The share of the cores' time since ``before`` (:func:`cpu_ticks`) the hypervisor ran something else."""
    steal, total = cpu_ticks()
    return (steal - before[0]) / max(total - before[1], 1)


def run(argv: list[str], cwd: Path, timeout: float = 1800) -> subprocess.CompletedProcess:
    """Run a command with the bench's environment; SystemExit naming it when it fails."""
    env = {k: v for k, v in ENV.items() if k != "TMPDIR"}     # each node has its own /tmp
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode:
        raise SystemExit(f"bench_cluster: {' '.join(map(str, argv))} failed ({proc.returncode}):\n"
                         f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return proc


def probe(work: Path, rate: str) -> dict:
    """The planner's probe on one rank of each node: the link between nodes as the comm model sees it."""
    out = work / f"probe-{rate}.json"
    run([*launcher(False), sys.executable, "-m", "hpcpipe.plan.probe", "--out", str(out)], work)
    sys.path.insert(0, str(ROOT / "src"))
    from hpcpipe.profiles.comm_model import CommModel
    raw = json.loads(out.read_text())
    model = CommModel.from_probe(raw)
    big = 64 << 20
    # the model reads times off the measured points; the line fit is only its summary
    return {"file": str(out), "p2p_4KiB_us": model.p2p(4096) * 1e6, "p2p_64MiB_gbit_s": big * 8 / model.p2p(big) / 1e9,
            "allreduce_64MiB_gbit_s": big * 8 / model.allreduce(big, 2) / 1e9,
            "fit_latency_us": model.latency_s * 1e6, "fit_gbit_s": 8 / max(model.seconds_per_byte, 1e-30) / 1e9,
            "tp_allreduce_1MiB_ms": model.tp_allreduce(1 << 20, 2) * 1e3,
            "allreduce_1MiB_ms": model.allreduce(1 << 20, 2) * 1e3,
            "p2p": raw["p2p"], "allreduce": raw["allreduce"], "tp_allreduce": raw.get("tp_allreduce")}


def plan(work: Path, profiles: Path, network: str | None) -> list[dict]:
    """The planner's plans for 2 ranks (within a node, or 2 nodes x 1 rank over network), fastest first."""
    out = work / f"plans-{time.monotonic_ns()}.json"
    # the emulated nodes share this host's cores and memory: profiled side by side, as within a node
    more = ["--nodes", "2", "--network", network, "--host-shared"] if network else []
    run([sys.executable, "-m", "hpcpipe.plan", "--config", str(CONFIG), "--ranks", "2", "--global-batch", "32",
         "--memory-per-rank", "4GiB", "--profile-dir", str(profiles), "--json", str(out), *more], work)
    return json.loads(out.read_text())["plans"]


def train_once(p: dict, within: bool, steps: int, work: Path, quiet: tuple[float, float]) -> dict:
    """Run plan p for steps steps; its median step time after the warm-up, bytes per step per link."""
    metrics = work / f"m-{time.monotonic_ns()}.jsonl"
    cut = p["stage_layers"] if p["pp"] * p["virtual_stages"] > 1 else []
    sets = {"parallel.dp": p["dp"], "parallel.pp": p["pp"], "parallel.tp": p["tp"],
            "parallel.schedule": f'"{p["schedule"]}"', "parallel.virtual_stages": p["virtual_stages"],
            "parallel.stage_layers": json.dumps(cut), "train.micro_batches": p["micro_batches"],
            "train.micro_batch_size": p["micro_batch_size"], "train.steps": steps,
            "log.metrics": f'"{metrics}"', "checkpoint.dir": '""', "log.progress": "false"}
    idle = wait_quiet(*quiet)
    load = os.getloadavg()[0]
    before, ticks = link_counters(), cpu_ticks()
    run([*launcher(within), sys.executable, "-m", "hpcpipe.train", "--config", str(CONFIG),
         *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]], work)
    kernel = [after - b for after, b in zip(link_counters(), before, strict=True)]
    records = [json.loads(line) for line in metrics.read_text().splitlines()][WARMUP:]
    links = [sorted(r.get("link_bytes", {}).values()) for r in records]
    # the fastest step too: on a shared machine it is the one least slowed by other work
    return {"step_s": statistics.median(r["step_time_s"] for r in records),
            "step_min_s": min(r["step_time_s"] for r in records),
            # tp's own collectives (the slowest rank's seconds in the step): how much of a tp step is messages
            "tp_comm_s": statistics.median(r.get("tp_comm_s", 0.0) for r in records),
            "sent_bytes_per_step": statistics.median(r["sent_bytes"] for r in records),
            "link_bytes_per_step": [statistics.median(x[k] for x in links) for k in range(2)] if links[0] else [0, 0],
            "link_counter_bytes_per_run": kernel, "steps": steps, "idle_before": idle, "load_before": load,
            "load_after": os.getloadavg()[0], "steal_share": steal_share(ticks)}


def write_llama(path: Path) -> None:
    """A random llama with the bytes tokenizer (hpcpipe's own HDF5 weights file)."""
    sys.path.insert(0, str(ROOT / "src"))
    import numpy as np

    from hpcpipe.nn.core.decoder_model import Decoder
    from hpcpipe.nn.llama.model import LlamaModel
    from hpcpipe.nn.llama.shape import LlamaShape
    from hpcpipe.state.weights import write_weights
    c = LLAMA
    shape = LlamaShape(vocab=c["vocab_size"], seq_len=c["seq_len"], d_model=c["d_model"], n_heads=c["n_heads"],
                       n_blocks=c["n_blocks"], d_ff=c["d_ff"], tied=False, n_kv_heads=c["n_kv_heads"])
    model = Decoder(LlamaModel(shape), np, "float32", seed=0)
    groups = {i: {k: np.array(v) for k, v in model.params[i].items()} for i in range(shape.n_groups)}
    write_weights(path, groups, n_layers=shape.n_groups, model_config=c, attrs={"tokenizer": '{"kind": "bytes"}'})


def _request(url: str, prompt: str) -> tuple[float, int]:
    body = json.dumps({"prompt": prompt, "max_tokens": 32, "temperature": 0}).encode()
    t0 = time.perf_counter()
    request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        answer = json.load(response)
    return time.perf_counter() - t0, int(answer["usage"]["completion_tokens"])


def serve_once(layout: tuple[int, int, int], within: bool, weights: Path, work: Path,
               quiet: tuple[float, float]) -> dict:
    """Serve the llama at layout on 2 ranks, 8 clients x 3 requests; tokens/s, median latency, link bytes."""
    dp, pp, tp = layout
    host = f"{NET}.1"
    log = work / f"serve-{time.monotonic_ns()}.log"
    argv = [*launcher(within), sys.executable, "-m", "hpcpipe.serve", "--weights", str(weights), "--port", "0",
            "--host", host, "--set", f"parallel.dp={dp}", "--set", f"parallel.pp={pp}", "--set", f"parallel.tp={tp}",
            "--set", "serve.max_sequences=16"]
    env = {k: v for k, v in ENV.items() if k != "TMPDIR"}
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 300
        while not (found := re.search(r"on http://[\d.]+:(\d+)/v1", log.read_text())):
            if proc.poll() is not None or time.time() > deadline:
                raise SystemExit(f"bench_cluster: serve did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        url = f"http://{host}:{found.group(1)}"
        prompts = [f"request {k:02d}: the pipeline sends activ"[:32] for k in range(24)]
        _request(url, prompts[0])     # warm-up
        idle, load = wait_quiet(*quiet), os.getloadavg()[0]
        before, t0 = link_counters(), time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            done = list(pool.map(lambda text: _request(url, text), prompts))
        wall = time.perf_counter() - t0
        kernel = [after - b for after, b in zip(link_counters(), before, strict=True)]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    tokens = sum(n for _, n in done)
    return {"tokens_per_s": tokens / wall, "latency_p50_s": statistics.median(t for t, _ in done),
            "tokens": tokens, "seconds": wall, "link_counter_bytes": kernel, "idle_before": idle, "load_before": load,
            "load_after": os.getloadavg()[0]}


def machine() -> dict:
    """Load and idle share now (the machine is shared with other work)."""
    return {"load_1min": os.getloadavg()[0], "idle_share": idle_fraction(1.0), "time": time.strftime("%H:%M:%S")}


def fresh_profiles(work: Path, base: Path) -> Path:
    """An empty profile cache but for base's within-node comm model (the probe is kept, the rest measured again)."""
    out = work / f"profiles-{time.monotonic_ns()}"
    out.mkdir()
    for comm in base.glob("comm-*.json"):
        shutil.copy(comm, out)
    return out


def plan_round(work: Path, profiles: Path, network: str, placements: list[str], quiet: tuple[float, float]) -> dict:
    """Each placement's plans on the profile in ``profiles`` (measured first when it has none), and that profile."""
    idle, load = wait_quiet(*quiet), os.getloadavg()[0]
    t0, ticks = time.perf_counter(), cpu_ticks()
    plans = {where: plan(work, profiles, None if where == "within" else network) for where in placements}
    profile = json.loads(next(profiles.glob("layers-*.json")).read_text())
    return {"plans": plans, "profile": profile, "seconds": time.perf_counter() - t0, "idle_before": idle,
            "load_before": load, "load_after": os.getloadavg()[0], "steal_share": steal_share(ticks)}


def train_rate(rate: str, placements: list[str], args, work: Path, base: Path, results: dict) -> None:
    """The training rows at one link rate: --rounds rounds, each (re)planned then every row run, in turns."""
    quiet = (args.quiet, args.quiet_wait)
    rows: dict[tuple[str, str], list[dict]] = {(where, name): [] for where in placements for name in LAYOUTS}
    chosen: dict[tuple[str, str], dict] = {}
    picks = []
    for r in range(args.rounds):
        if r == 0 or args.profile_each_round:
            fresh = args.profile_each_round and any(base.glob("layers-*.json"))
            print(f"{rate} round {r + 1}: planning{' (profile measured again)' if fresh else ''} ...", flush=True)
            done = plan_round(work, fresh_profiles(work, base) if fresh else base, results["probes"][rate]["file"],
                              placements, quiet)
            plans, profile = done.pop("plans"), done.pop("profile")
            results["profiles"].append({"rate": rate, "round": r, **done, "engine": profile.get("engine"),
                                        "profile_load": profile.get("load")})
            picks.append(plans["across"][0])
            if "engine" not in results:
                # the planner's calibration against real runs (engine factors; tp: the seconds its collectives
                # took), and each layer group's whole and tp = 2 split times at the largest profiled size
                results["engine"] = profile.get("engine")
                results["split_s"] = {str(g["index"]): {op: [g[op][size], g.get(f"{op}/tp2", {}).get(size)]
                                                        for op in "FB"}
                                      for g in profile["layers"]["groups"].values() for size in [max(g["F"], key=int)]}
        for where in placements:
            for name in LAYOUTS:
                if r == 0:
                    chosen[(where, name)] = best_per_layout(plans[where])[name]
                p = same_plan(plans[where], chosen[(where, name)])
                print(f"{rate} round {r + 1} {where} {describe(p)} ...", flush=True)
                run = train_once(p, where == "within", args.steps, work, quiet)
                rows[(where, name)].append({"round": r, "plan": describe(p), "predicted_s": p["step_time_s"], **run})
    results["plans"][rate] = {name: chosen[("across", name)] for name in LAYOUTS}
    if "within" in placements:
        results["plans"]["within"] = {name: chosen[("within", name)] for name in LAYOUTS}
    results["plans"][f"{rate}-pick"] = picks[0]
    results["plans"][f"{rate}-picks"] = picks
    for (where, name), runs in rows.items():
        results["training"].append({"rate": rate if where == "across" else "shared memory", "placement": where,
                                    "layout": name, "plan": describe(chosen[(where, name)]),
                                    **summarise(runs, results["statistic"]), "runs": runs})


def main(argv: list[str] | None = None) -> int:
    """Run the bench; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="10gbit,1gbit", help="link rates, comma-separated (default 10gbit,1gbit)")
    parser.add_argument("--rounds", type=int, default=3, help="training runs per configuration, in turns (default 3)")
    parser.add_argument("--steps", type=int, default=8, help="training steps per run (default 8; 2 are warm-up)")
    parser.add_argument("--no-serve", action="store_true", help="skip the serving part")
    parser.add_argument("--no-within", action="store_true", help="run the rows across nodes only (not within one)")
    parser.add_argument("--profile-each-round", action="store_true", default=True,
                        help="(the default) measure the planner's profile again at the start of every round and "
                             "compare each round's runs with that round's prediction")
    parser.add_argument("--profile-once", dest="profile_each_round", action="store_false",
                        help="measure the profile once, at the start (the bench before 2026-11-28 16:45 UTC)")
    parser.add_argument("--statistic", choices=tuple(STATISTICS), default=None,
                        help="the row's error: rounds (median of the rounds' errors, each against its own round's "
                             "prediction; the default), min (the fastest round; the default with --profile-once) or "
                             "median (the rounds' median step)")
    parser.add_argument("--quiet", type=float, default=0.7, help="idle share to wait for before each run (0.7)")
    parser.add_argument("--quiet-wait", type=float, default=120, help="longest wait for it, seconds (120)")
    parser.add_argument("--out", default=dated_out("cluster"),
                        help="results file (default bench/results/<today>-cluster.json)")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("bench_cluster: needs root (jobs/netns-cluster.sh makes network namespaces)")
    if args.steps <= WARMUP or args.rounds < 1:
        raise SystemExit(f"bench_cluster: --steps must exceed the {WARMUP} warm-up steps and --rounds be >= 1")
    statistic = args.statistic or ("rounds" if args.profile_each_round else "min")
    rates = [r for r in args.rates.split(",") if r]
    if not rates:
        raise SystemExit("bench_cluster: --rates names no rate (e.g. 10gbit,1gbit)")
    work = Path(tempfile.mkdtemp(prefix="hpcpipe-bench-cluster-", dir="/var/tmp"))
    results: dict = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(["python", *sys.argv]),
                     "cores": os.cpu_count(), "config": str(CONFIG.relative_to(ROOT)), "llama": LLAMA, "rates": rates,
                     "rounds": args.rounds, "steps": args.steps, "profile_each_round": args.profile_each_round,
                     "statistic": statistic, "statistic_text": STATISTICS[statistic],
                     "quiet": [args.quiet, args.quiet_wait], "machine_before": machine(), "probes": {}, "plans": {},
                     "profiles": [], "training": [], "serving": []}
    quiet = (args.quiet, args.quiet_wait)
    try:
        weights = work / "llama.h5"
        if not args.no_serve:
            write_llama(weights)
        for index, rate in enumerate(rates):
            cluster("up", "2", rate)
            try:
                results["probes"][rate] = net = probe(work, rate)
                print(f"{rate}: probe between nodes {net['p2p_4KiB_us']:.0f} us for 4 KiB, "
                      f"{net['p2p_64MiB_gbit_s']:.2f} Gbit/s for 64 MiB", flush=True)
                within = index == 0 and not args.no_within
                base = work / "profiles"
                base.mkdir(exist_ok=True)
                train_rate(rate, ["across"] + (["within"] if within else []), args, work, base, results)
                if not args.no_serve:
                    for name, layout in LAYOUTS.items():
                        for where in ("across",) + (("within",) if within else ()):
                            print(f"{rate} {where} serve {name} ...", flush=True)
                            r = serve_once(layout, where == "within", weights, work, quiet)
                            results["serving"].append({"rate": rate if where == "across" else "shared memory",
                                                       "placement": where, "layout": name, **r})
            finally:
                cluster("down")
        results["machine_after"] = machine()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_results(args.out, results)
    print_tables(results)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
