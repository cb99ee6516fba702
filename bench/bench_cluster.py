"""2 emulated nodes (jobs/netns-cluster.sh) vs one: GPT training and llama serving at dp=2, pp=2, tp=2, and the planner.

    python bench/bench_cluster.py [--rates 10gbit,1gbit] [--rounds 2] [--steps 8] [--out FILE]   # as root

Each layout runs on 2 ranks placed **within a node** (both ranks in node 0: MPICH's shared memory) and
**across nodes** (one rank on each of 2 nodes, every message over TCP through the shaped links), at each
link rate. Every rank has one BLAS thread (HPCPIPE_THREADS=1): the 2 "nodes" share this machine's cores.

* Training: configs/plan-gpt.toml (GPT, vocab 8192, 4 blocks of d 128, untied, Adam), global batch 32
  sequences. The planner (``python -m hpcpipe.plan --ranks 2 --global-batch 32``) plans it once within a
  node and, per rate, for 2 nodes x 1 rank with ``--nodes 2 --network PROBE.json``, PROBE.json being
  ``python -m hpcpipe.plan.probe`` run on one rank of each node (the comm model calibrated across the
  links). Of each plan list the fastest plan of each layout (dp=2, pp=2, tp=2) is run as predicted for
  --steps steps, --rounds times in turns; measured = median of step_time_s after the first 2 steps, the
  fastest round (--statistic min, the default: the machine is shared, the planner predicts a quiet one)
  or the median of the rounds. Before every run the bench waits up to --quiet-wait s for the cores to be
  --quiet idle, and records the idle share and load it ran under. Bytes per step per link: the metrics'
  link_bytes (what each node sent to the
  other in the step) and, as a check, the link's own counter over the whole run (with TCP/IP headers,
  start-up and MPI's own messages).
* Serving: a random llama (d 256, 4 blocks, 8 heads / 4 key-value heads, vocabulary 256, bytes
  tokenizer) at dp=2, pp=2, tp=2; 8 clients send 24 requests (32-byte prompts, 32 new tokens, greedy);
  tokens per second over the whole load, the median request latency, and the bytes the link carried.

Results: bench/results/<today>-cluster.json (with the probes, blocking and polled allreduce; the planner's engine
calibration, its tp run's collective seconds; each layer group's whole and tp = 2 split times, ``split_s``), and a
table printed for docs/cluster.md.
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

SCRIPT = ROOT / "jobs" / "netns-cluster.sh"
NAME, NET = "hpcbench", "10.213.11"
CLUSTER_ENV = {"HPCPIPE_NETNS_NAME": NAME, "HPCPIPE_NETNS_NET": NET, "HPCPIPE_NETNS_DIR": f"/run/{NAME}-netns"}
CONFIG = ROOT / "configs" / "plan-gpt.toml"
LAYOUTS = {"dp=2": (2, 1, 1), "pp=2": (1, 2, 1), "tp=2": (1, 1, 2)}
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


def best_per_layout(plans: list[dict]) -> dict[str, dict]:
    """The fastest plan of each layout (plans come fastest first)."""
    out = {}
    for name, (dp, pp, tp) in LAYOUTS.items():
        out[name] = next(p for p in plans if (p["dp"], p["pp"], p["tp"]) == (dp, pp, tp))
    return out


def describe(p: dict) -> str:
    """A plan in a few words: layout, schedule, micro-batches x size."""
    v = f" v={p['virtual_stages']}" if p["virtual_stages"] > 1 else ""
    return f"dp={p['dp']} pp={p['pp']} tp={p['tp']} {p['schedule']}{v} {p['micro_batches']}x{p['micro_batch_size']}"


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
    before = link_counters()
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
            "load_after": os.getloadavg()[0]}


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


def main(argv: list[str] | None = None) -> int:
    """Run the bench; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="10gbit,1gbit", help="link rates, comma-separated (default 10gbit,1gbit)")
    parser.add_argument("--rounds", type=int, default=2, help="training runs per configuration, in turns (default 2)")
    parser.add_argument("--steps", type=int, default=8, help="training steps per run (default 8; 2 are warm-up)")
    parser.add_argument("--no-serve", action="store_true", help="skip the serving part")
    parser.add_argument("--statistic", choices=("min", "median"), default="min",
                        help="over the rounds: the fastest (default) or the median")
    parser.add_argument("--quiet", type=float, default=0.7, help="idle share to wait for before each run (0.7)")
    parser.add_argument("--quiet-wait", type=float, default=120, help="longest wait for it, seconds (120)")
    parser.add_argument("--out", default=dated_out("cluster"),
                        help="results file (default bench/results/<today>-cluster.json)")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("bench_cluster: needs root (jobs/netns-cluster.sh makes network namespaces)")
    if args.steps <= WARMUP or args.rounds < 1:
        raise SystemExit(f"bench_cluster: --steps must exceed the {WARMUP} warm-up steps and --rounds be >= 1")
    rates = [r for r in args.rates.split(",") if r]
    work = Path(tempfile.mkdtemp(prefix="hpcpipe-bench-cluster-", dir="/var/tmp"))
    results: dict = {"date": time.strftime("%Y-%m-%d"), "cores": os.cpu_count(),
                     "config": str(CONFIG.relative_to(ROOT)), "llama": LLAMA, "rates": rates,
                     "rounds": args.rounds, "steps": args.steps, "statistic": args.statistic,
                     "quiet": [args.quiet, args.quiet_wait],
                     "machine_before": machine(), "probes": {}, "plans": {}, "training": [], "serving": []}
    profiles = work / "profiles"
    quiet = (args.quiet, args.quiet_wait)
    pick = min if args.statistic == "min" else statistics.median
    try:
        print("planning within a node ...", flush=True)
        results["plans"]["within"] = within_plans = best_per_layout(plan(work, profiles, None))
        # the planner's calibration against real runs (engine factors; tp: the seconds its collectives took), and
        # each layer group's whole and tp = 2 split times at the largest profiled size (what tp saves of it)
        profile = json.loads(next(profiles.glob("layers-*.json")).read_text())
        results["engine"] = profile.get("engine")
        results["split_s"] = {str(g["index"]): {op: [g[op][size], g.get(f"{op}/tp2", {}).get(size)] for op in "FB"}
                              for g in profile["layers"]["groups"].values()
                              for size in [max(g["F"], key=int)]}
        weights = work / "llama.h5"
        write_llama(weights)
        for index, rate in enumerate(rates):
            cluster("up", "2", rate)
            try:
                results["probes"][rate] = net = probe(work, rate)
                print(f"{rate}: probe between nodes {net['p2p_4KiB_us']:.0f} us for 4 KiB, "
                      f"{net['p2p_64MiB_gbit_s']:.2f} Gbit/s for 64 MiB", flush=True)
                results["plans"][rate] = across_plans = best_per_layout(all_plans := plan(work, profiles, net["file"]))
                results["plans"][f"{rate}-pick"] = all_plans[0]
                placements = [("across", across_plans)] + ([("within", within_plans)] if index == 0 else [])
                runs = {(where, name): [] for where, plans in placements for name in plans}
                for _ in range(args.rounds):
                    for where, plans in placements:
                        for name, p in plans.items():
                            print(f"{rate} {where} {describe(p)} ...", flush=True)
                            runs[(where, name)].append(train_once(p, where == "within", args.steps, work, quiet))
                for (where, name), done in runs.items():
                    p = dict(placements)[where][name]
                    measured = pick([r["step_s"] for r in done])
                    results["training"].append({
                        "rate": rate if where == "across" else "shared memory", "placement": where, "layout": name,
                        "plan": describe(p), "predicted_s": p["step_time_s"], "measured_s": measured,
                        "error": p["step_time_s"] / measured - 1, "runs": done})
                if not args.no_serve:
                    for name, layout in LAYOUTS.items():
                        for where in ("across",) + (("within",) if index == 0 else ()):
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


def print_tables(results: dict) -> None:
    """The tables of docs/cluster.md (markdown)."""
    print("\n| link | placement | plan | predicted step s | measured step s | error | fastest step s | "
          "bytes/step/link (metrics) | load |")
    print("|---|---|---|---|---|---|---|---|---|")
    for t in results["training"]:
        link = max(statistics.median(r["link_bytes_per_step"][k] for r in t["runs"]) for k in range(2))
        fastest = min(r["step_min_s"] for r in t["runs"])
        # the load after the run that gave the measured time (with the median statistic: the rounds' median)
        chosen = [r["load_after"] for r in t["runs"] if r["step_s"] == t["measured_s"]]
        load = chosen[0] if chosen else statistics.median(r["load_after"] for r in t["runs"])
        print(f"| {t['rate']} | {t['placement']} | {t['plan']} | {t['predicted_s']:.3f} | {t['measured_s']:.3f} | "
              f"{t['error']:+.1%} | {fastest:.3f} | {link / 2**20:.2f} MiB | {load:.1f} |")
    for rate in results["rates"]:
        pick = results["plans"].get(f"{rate}-pick")
        measured = {t["layout"]: t["measured_s"] for t in results["training"]
                    if t["placement"] == "across" and t["rate"] == rate}
        if pick and measured:
            layout = next(n for n, lay in LAYOUTS.items() if lay == (pick["dp"], pick["pp"], pick["tp"]))
            fastest = min(measured, key=measured.get)
            print(f"{rate}, 2 nodes x 1 rank: planner picks {describe(pick)} (measured {measured[layout]:.3f} s); "
                  f"measured best {fastest} ({measured[fastest]:.3f} s)")
    if results["serving"]:
        print("\n| link | placement | layout | tokens/s | median latency s | link bytes (both ways) | load |")
        print("|---|---|---|---|---|---|---|")
        for s in results["serving"]:
            print(f"| {s['rate']} | {s['placement']} | {s['layout']} | {s['tokens_per_s']:.1f} | "
                  f"{s['latency_p50_s']:.2f} | {sum(s['link_counter_bytes']) / 2**20:.1f} MiB | "
                  f"{s['load_after']:.1f} |")


if __name__ == "__main__":
    sys.exit(main())
