"""Serving benchmark: tokens/s, TTFT and inter-token p50/p99 of `python -m hpcpipe.serve` under real HTTP clients.

    pip install -e ".[mpich]"     # aiohttp comes with hpcpipe (the server's HTTP library; the clients use it too)
    python bench/bench_serve.py [--quick] [--seconds 20] [--warmup 3] [--out bench/results/YYYY-MM-DD-serve.json]

One float32 GPT with a 96-character tokenizer (printable ASCII + newline; one
character = one token) is written once with random weights; the text it
generates is noise, which does not matter for speed: every request runs to
max_tokens. Shape (vocab 96, seq_len 256, d_model 384, 6 heads, 8 blocks,
tied head): 14.2 M parameters in the blocks, so one decode step of 32
sequences at pp = 1 is ~0.9 GFLOP of 32-row matrix products plus attention over
~100 cached positions: 20-40 ms on one core of this machine, large enough that
compute (not Python, HTTP or MPI overhead) dominates a step, small enough that a
64-token request takes ~2 s and a 20 s window holds hundreds of requests.
seq_len 256 leaves the 32 + 64 tokens of a request well inside the context.

Each layout is one server (``mpiexec -n N python -m hpcpipe.serve --port 0``,
one BLAS thread per rank) measured at 1, 8 and 32 concurrent clients in turn:
closed-loop streaming clients in this process (bench/serve_load.py), a seeded
prompt list of 32-character prompts, max_tokens 64, temperature 0; a warm-up
(starts spread over half of it) is discarded, then a window of --seconds is
measured and the clients are cancelled (the server frees their slots; the next
point starts once /metrics shows nothing running). Per point: tokens/s =
completion tokens that reached the clients inside the window / window; requests
done in the window; TTFT of requests sent in the window; inter-token gaps
between successive token arrivals of one stream inside the window; the server's
own /metrics over the same window (histogram quantiles are bucket bounds).
Before the servers, one decode step of the whole model is timed alone at 1-32
rows (least CPU time): the tokens/s ratios those costs allow are printed beside
the goals. The results go to bench/results/<today>-serve.json (--long:
-serve-long-prompts.json, --quick: -serve-quick.json) unless --out says otherwise.
Method, the measured runs and the analysis: docs/bench-serve.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
from bench_schedules import ENV, HERE, MPIEXEC, ROOT, dated_out, load, matmul_rate, wait_quiet, write_results
from serve_load import measure

CHARS = "".join(chr(c) for c in range(32, 127)) + "\n"
FULL = {"seq_len": 256, "d_model": 384, "n_heads": 6, "n_blocks": 8, "prompt_chars": 32, "max_tokens": 64}
# long contexts: 384-token prompts, so that a decode row's attention over its cached keys and values
# (and the prompts' prefill) weighs more than the weights every step streams once per group
LONG = {"seq_len": 512, "d_model": 384, "n_heads": 6, "n_blocks": 8, "prompt_chars": 384, "max_tokens": 64}
QUICK = {"seq_len": 64, "d_model": 64, "n_heads": 2, "n_blocks": 2, "prompt_chars": 16, "max_tokens": 16}
# name: (ranks, --set items)
LAYOUTS = {"pp1": (1, ["parallel.pp=1"]),
           "pp1-nocache": (1, ["parallel.pp=1", "serve.kv_cache=false"]),
           "pp2": (2, ["parallel.pp=2"]),
           "dp2xpp4": (8, ["parallel.pp=4"]),
           "pp8": (8, ["parallel.pp=8"]),
           # one micro-batch group per replica: 8 ranks share 2 cores anyway, so idle stages cost
           # nothing, and each step keeps 16 rows instead of 4 (see the step costs printed first)
           "dp2xpp4-mb1": (8, ["parallel.pp=4", "serve.micro_batches=1"])}
WORDS = ("the pipeline keeps every stage busy while tokens stream to many users at once under a "
         "latency target so decode steps overlap across ranks and the cache holds keys and values").split()


def write_model(path: str, size: dict, seed: int = 0) -> dict:
    """Write the benchmark GPT (float32, tied head, random weights, chars tokenizer); return its config."""
    from hpcpipe.nn.core.decoder_model import Decoder
    from hpcpipe.nn.gpt.model import GPTModel
    from hpcpipe.nn.gpt.shape import GPTShape
    from hpcpipe.state.weights import write_weights
    shape = GPTShape(vocab=len(CHARS), seq_len=size["seq_len"], d_model=size["d_model"], n_heads=size["n_heads"],
                     n_blocks=size["n_blocks"], tied=True)
    model = Decoder(GPTModel(shape), np, "float32", seed=seed)
    groups = {i: {name: np.array(view) for name, view in model.params[i].items()} for i in range(shape.n_groups)}
    config = {"kind": "gpt", "vocab_size": shape.vocab, "seq_len": shape.seq_len, "d_model": shape.d_model,
              "n_heads": shape.n_heads, "n_blocks": shape.n_blocks, "d_ff": 0, "tie_embeddings": True,
              "dtype": "float32"}
    write_weights(path, groups, n_layers=shape.n_groups, model_config=config,
                  attrs={"tokenizer": json.dumps({"kind": "chars", "chars": CHARS})})
    blocks = sum(v.size for i in range(1, shape.n_blocks + 1) for v in groups[i].values())
    return {**config, "params": int(model.flat.size), "block_params": int(blocks)}


def make_prompts(n: int, chars: int, seed: int = 0) -> list[str]:
    """n prompts of exactly `chars` characters: seeded word sequences, cut to length."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        text = ""
        while len(text) < chars:
            text += WORDS[rng.integers(len(WORDS))] + " "
        out.append(text[:chars])
    return out


def library_line() -> str:
    """Python, NumPy (+ its BLAS), mpi4py, the MPI library and aiohttp versions, in one line."""
    import aiohttp
    import mpi4py
    from mpi4py import MPI
    blas = ""
    try:
        deps = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        blas = f" ({deps.get('name', '?')} {deps.get('version', '?')})"
    except Exception:   # older NumPy: no dict mode
        pass
    mpi = MPI.Get_library_version().strip().splitlines()[0]
    return (f"Python {platform.python_version()}, NumPy {np.__version__}{blas}, mpi4py {mpi4py.__version__}, "
            f"{mpi}, aiohttp {aiohttp.__version__}")


def time_steps(size: dict, rows: list[int], reps: int = 15) -> dict[int, float]:
    """Least CPU time (ms) of one KV-cached decode step of the whole model over each count of sequences."""
    from hpcpipe.nn.core.decode import DecodeStage, Segment
    from hpcpipe.nn.core.decoder_model import Decoder
    from hpcpipe.nn.gpt.model import GPTModel
    from hpcpipe.nn.gpt.shape import GPTShape
    shape = GPTShape(vocab=len(CHARS), seq_len=size["seq_len"], d_model=size["d_model"], n_heads=size["n_heads"],
                     n_blocks=size["n_blocks"], tied=True)
    model = Decoder(GPTModel(shape), np, "float32", seed=0)
    arrays = {i: {k: np.array(v) for k, v in model.params[i].items()} for i in range(shape.n_groups)}
    stage = DecodeStage(GPTModel(shape), range(shape.n_groups), arrays, np, "float32", max(rows))
    # the cache filled to the middle of a request (prompt + half of max_tokens), where a step's keys sit on average
    pos = size["prompt_chars"] + size["max_tokens"] // 2
    stage.forward(np.zeros(max(rows) * pos, dtype=np.int64), [Segment(s, 0, pos) for s in range(max(rows))])
    out = {}
    for n in rows:
        segments, x = [Segment(s, pos, 1) for s in range(n)], np.zeros(n, dtype=np.int64)
        best = float("inf")
        for _ in range(reps):
            t = time.process_time()       # CPU time: on a shared machine, wall time also counts other jobs
            stage.forward(x, segments)
            best = min(best, time.process_time() - t)
        out[n] = best * 1e3
    return out


def step_costs(size: dict, rows: tuple[int, ...] = (1, 4, 8, 16, 32)) -> dict[int, float]:
    """time_steps in a subprocess with one BLAS thread (as every server rank has)."""
    code = (f"import sys, json; sys.path[:0] = {[HERE, os.path.join(ROOT, 'src')]!r}; import bench_serve; "
            f"print(json.dumps(bench_serve.time_steps({size!r}, {list(rows)!r})))")
    out = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, check=True)
    return {int(k): v for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def ceilings(steps: dict[int, float], clients: int) -> dict[str, float]:
    """Best tokens/s ratios the step costs allow at `clients` sequences on 2 cores (no HTTP, MPI or client cost).

    A round gives every sequence one token. pp = 1: one step over all sequences. pp = 2: two groups of
    clients / 2, each stage runs half the blocks of each group: round = t(clients / 2). 8 ranks with 4-row
    groups (dp2 x pp4 or pp8): 8 group-steps of t(clients / 8), the whole model each, on 2 cores.
    dp2 x pp4 with one group per replica: 2 x t(clients / 2) of work on 2 cores.
    """
    t = {n: steps.get(n) for n in (clients, clients // 2, clients // 8)}
    if any(v is None for v in t.values()):
        return {}
    return {"pp2_over_pp1": t[clients] / t[clients // 2],
            "eight_4row_groups_over_pp2": t[clients // 2] / (4 * t[clients // 8]),
            "dp2xpp4_mb1_over_pp2": 1.0}


class Server:
    """One `mpiexec -n N python -m hpcpipe.serve --port 0` job: started, waited for, stopped with SIGTERM."""

    def __init__(self, ranks: int, weights: str, sets: list[str], log: str):
        self.log = log
        self.cmd = [MPIEXEC, "-n", str(ranks), sys.executable, "-m", "hpcpipe.serve", "--weights", weights,
                    "--port", "0"]
        for item in sets:
            self.cmd += ["--set", item]
        self._out = open(log, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self._out, stderr=subprocess.STDOUT, env=ENV,
                                     cwd=os.path.dirname(weights), start_new_session=True)
        self.url = self._wait_url(180.0)

    def _text(self) -> str:
        with open(self.log) as f:
            return f.read()

    def _wait_url(self, seconds: float) -> str:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            found = re.search(r"on (http://[\d.]+:\d+)/v1", self._text())
            if found:
                return found.group(1)
            if self.proc.poll() is not None:
                raise RuntimeError(f"{shlex.join(self.cmd)} exited with {self.proc.returncode}:\n{self._text()}")
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"{shlex.join(self.cmd)} did not start in {seconds:.0f} s:\n{self._text()}")

    def stop(self) -> int:
        """SIGTERM to mpiexec (it forwards to every rank: drain and exit); the exit status."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.kill()
            return -9
        finally:
            self._out.close()

    def kill(self) -> None:
        """Kill this job's process group (launcher and ranks)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; --quick picks a tiny model, 2 s windows and a few points."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, 2 s windows, 4 points (a smoke run)")
    ap.add_argument("--long", action="store_true",
                    help="long contexts: seq_len 512, 384-token prompts, 64 new tokens (default: 32-token prompts)")
    ap.add_argument("--seconds", type=float, default=None, help="measured window per point (20; --quick 2)")
    ap.add_argument("--warmup", type=float, default=None, help="discarded warm-up per point (3; --quick 0.5)")
    ap.add_argument("--layouts", default=None, help=f"comma-separated of {','.join(LAYOUTS)} (all; --quick "
                                                    f"pp1,pp1-nocache,pp2)")
    ap.add_argument("--concurrency", default=None, help="comma-separated client counts (1,8,32; --quick 1,4)")
    ap.add_argument("--max-requests", type=int, default=100_000, help="bound on requests per point")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the results here (default: bench/results/<today>-serve.json; "
                                                "--long: -serve-long-prompts.json, --quick: -serve-quick.json)")
    ap.add_argument("--quiet-idle", type=float, default=0.9, help="before each server wait for this idle share")
    ap.add_argument("--quiet-wait", type=float, default=None, help="longest wait for quiet, s (30; --quick 0)")
    ap.add_argument("--report", metavar="JSON", help="only print the table and goals of an earlier run")
    args = ap.parse_args(argv)
    args.seconds = args.seconds or (2.0 if args.quick else 20.0)
    args.warmup = (0.5 if args.quick else 3.0) if args.warmup is None else args.warmup
    args.layouts = (args.layouts or ("pp1,pp1-nocache,pp2" if args.quick else ",".join(LAYOUTS))).split(",")
    args.concurrency = [int(c) for c in (args.concurrency or ("1,4" if args.quick else "1,8,32")).split(",")]
    args.quiet_wait = (0.0 if args.quick else 30.0) if args.quiet_wait is None else args.quiet_wait
    args.out = args.out or dated_out("serve-quick" if args.quick else "serve-long-prompts" if args.long else "serve")
    unknown = [name for name in args.layouts if name not in LAYOUTS]
    if unknown:
        ap.error(f"unknown layout(s) {unknown}; choose from {list(LAYOUTS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run every layout at every concurrency, print the table and goals, write the JSON results."""
    args = parse_args(argv)
    if args.report:
        with open(args.report) as f:
            report(json.load(f))
        return 0
    sys.path.insert(0, os.path.join(ROOT, "src"))
    size = dict(QUICK if args.quick else LONG if args.long else FULL)
    tmp = tempfile.mkdtemp(prefix="hpcpipe-bench-serve-")
    weights = os.path.join(tmp, "bench-gpt.h5")
    model = write_model(weights, size, args.seed)
    prompts = make_prompts(64, size["prompt_chars"], args.seed)
    body = {"model": "bench-gpt.h5", "max_tokens": size["max_tokens"], "temperature": args.temperature,
            "seed": args.seed, "stream": True, "stream_options": {"include_usage": True}}
    wait_quiet(args.quiet_idle, args.quiet_wait)
    sample = 0.3 if args.quick else 1.5
    rate = matmul_rate(2048, 2048, 2048, sample)
    d = size["d_model"]
    results: dict = {
        "command": shlex.join([sys.executable, *sys.argv]), "model": model, "size": size,
        "settings": {"warmup_s": args.warmup, "seconds": args.seconds, "concurrency": args.concurrency,
                     "layouts": args.layouts, "max_requests": args.max_requests,
                     "prompt_tokens": size["prompt_chars"], "max_tokens": size["max_tokens"],
                     "temperature": args.temperature, "seed": args.seed, "quick": args.quick,
                     "long": args.long},
        "machine": {"cores": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
                    "gemm_2048_1core_gflops": rate, "gemm_decode_1core_gflops": matmul_rate(32, d, 4 * d, sample),
                    "library": library_line()},
        "loads": [load()], "points": []}
    m = results["machine"]
    m["decode_step_ms"] = step_costs(size)
    top = max(args.concurrency)
    results["ceilings"] = ceilings(m["decode_step_ms"], top)
    print("one decode step of the whole model, one core: " + ", ".join(
        f"{n} rows {t:.1f} ms ({t / n:.2f} ms/token)" for n, t in m["decode_step_ms"].items()), flush=True)
    print(f"load {results['loads'][0]}; one core: 2048^3 matmul {rate:.1f} GFLOP/s, 32x{d}x{4 * d} "
          f"{m['gemm_decode_1core_gflops']:.1f} GFLOP/s; {m['library']}", flush=True)
    for name in args.layouts:
        ranks, sets = LAYOUTS[name]
        idle = wait_quiet(args.quiet_idle, args.quiet_wait)
        server = Server(ranks, weights, sets, os.path.join(tmp, f"serve-{name}.log"))
        try:
            for c in args.concurrency:
                r = measure(server.url, c, prompts, body, args.warmup, args.seconds, args.max_requests, args.seed)
                r.update(layout=name, ranks=ranks, sets=sets, kv_cache="serve.kv_cache=false" not in sets,
                         concurrency=c, idle_before=idle, load=load())
                r["model_gflops"] = r["tokens_per_s"] * 2 * model["block_params"] / 1e9
                results["points"].append(r)
                print(f"{name:12s} c={c:<3d} {r['tokens_per_s']:8.1f} tokens/s  {r['requests_done']:4d} done  "
                      f"TTFT p50 {_ms(r['ttft_p50_ms'])} p99 {_ms(r['ttft_p99_ms'])}  inter-token p50 "
                      f"{_ms(r['itl_p50_ms'])} p99 {_ms(r['itl_p99_ms'])}  (server {r['server']['tokens_per_s']:.1f}"
                      f" tokens/s; load {r['load']})", flush=True)
                idle = None
        finally:
            status = server.stop()
        if status != 0:
            print(f"warning: {name} server exited with {status}; log {server.log}", flush=True)
        results.setdefault("exit_status", {})[name] = status
    results["loads"].append(load())
    results["goals"] = goals(results["points"])
    report(results)
    write_results(args.out, results)
    print(f"\nwrote {args.out}; command: {results['command']}")
    return 0


def _ms(x: float | None) -> str:
    return f"{x:7.1f}" if x is not None else "      -"


def _point(points: list[dict], layout: str, c: int) -> dict | None:
    return next((p for p in points if p["layout"] == layout and p["concurrency"] == c), None)


def goals(points: list[dict]) -> list[dict]:
    """The issue's goals over the measured points (a goal without its points is reported as not measured)."""
    out = []
    top = max((p["concurrency"] for p in points), default=0)

    def ratio_goal(name: str, a: tuple[str, int], b: tuple[str, int], target: float) -> None:
        pa, pb = _point(points, *a), _point(points, *b)
        value = pa["tokens_per_s"] / pb["tokens_per_s"] if pa and pb and pb["tokens_per_s"] > 0 else None
        out.append({"name": name, "value": value, "target": target,
                    "pass": None if value is None else value >= target})

    ratio_goal(f"KV-cache decode >= 5x no-cache tokens/s (pp1 vs pp1-nocache, {top} clients)",
               ("pp1", top), ("pp1-nocache", top), 5.0)
    ratio_goal(f"pp=2 >= 1.8x pp=1 tokens/s ({top} clients)", ("pp2", top), ("pp1", top), 1.8)
    for eight in ("dp2xpp4", "pp8", "dp2xpp4-mb1"):
        ratio_goal(f"8 ranks ({eight}) within 1.25x of pp=2: tokens/s >= pp2 / 1.25 ({top} clients)",
                   (eight, top), ("pp2", top), 1 / 1.25)
    ratios = [(p["itl_p99_over_p50"], p["layout"], p["concurrency"]) for p in points
              if p["itl_p99_over_p50"] is not None]
    worst = max(ratios) if ratios else None
    out.append({"name": "p99 inter-token <= 3x p50 at every point (worst: "
                        f"{f'{worst[1]} c={worst[2]}' if worst else '-'})",
                "value": worst[0] if worst else None, "target": 3.0,
                "pass": None if worst is None else worst[0] <= 3.0, "upper_bound": True})
    return out


def report(res: dict) -> None:
    """Print the markdown table of every point and the PASS/FAIL goal lines (from a results dict)."""
    s, mach, model = res["settings"], res["machine"], res["model"]
    print(f"\nmodel: float32 GPT, vocab {model['vocab_size']} chars, seq_len {model['seq_len']}, d {model['d_model']}, "
          f"{model['n_heads']} heads, {model['n_blocks']} blocks, tied; {model['params']:,} parameters "
          f"({model['block_params']:,} in blocks); prompts {s['prompt_tokens']} tokens, max_tokens {s['max_tokens']}, "
          f"temperature {s['temperature']}; warm-up {s['warmup_s']} s, window {s['seconds']} s per point")
    print(f"machine: {mach['cores']} cores, one-core 2048^3 matmul {mach['gemm_2048_1core_gflops']:.1f} GFLOP/s; "
          f"{mach['library']}; load before/after {res['loads'][0]} / {res['loads'][-1]}\n")
    print("| layout | ranks | clients | tokens/s | requests done | TTFT p50 / p99 ms | inter-token p50 / p99 ms "
          "| p99/p50 | long gaps at a first token | server tokens/s | block GFLOP/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for p in res["points"]:
        ratio = f"{p['itl_p99_over_p50']:.2f}" if p["itl_p99_over_p50"] is not None else "-"
        share = p.get("itl_long_with_first_token_share")
        share = "-" if share is None else f"{share:.0%} of {p['itl_long_n']}"
        print(f"| {p['layout']} | {p['ranks']} | {p['concurrency']} | {p['tokens_per_s']:,.1f} | "
              f"{p['requests_done']} | {_ms(p['ttft_p50_ms']).strip()} / {_ms(p['ttft_p99_ms']).strip()} | "
              f"{_ms(p['itl_p50_ms']).strip()} / {_ms(p['itl_p99_ms']).strip()} | {ratio} | {share} | "
              f"{p['server']['tokens_per_s']:,.1f} | {p['model_gflops']:.2f} |")
    steps = mach.get("decode_step_ms", {})
    if steps:
        print("\none KV-cached decode step of the whole model on one core (least CPU time of 15): " + ", ".join(
            f"{n} rows {t:.1f} ms ({t / float(n):.2f} ms/token)" for n, t in steps.items()))
    if res.get("ceilings"):
        c = res["ceilings"]
        print(f"ceilings from these step costs alone: pp2/pp1 {c['pp2_over_pp1']:.2f}x; 8 ranks in 4-row groups "
              f"/ pp2 {c['eight_4row_groups_over_pp2']:.2f}x; dp2xpp4 with one group per replica / pp2 "
              f"{c['dp2xpp4_mb1_over_pp2']:.2f}x")
    print()
    for g in res["goals"]:
        verdict = {True: "PASS", False: "FAIL", None: "NOT MEASURED"}[g["pass"]]
        value = "-" if g["value"] is None else f"{g['value']:.2f}x"
        print(f"{verdict}: {g['name']}: {value} (target {'<=' if g.get('upper_bound') else '>='} "
              f"{g['target']:.2f}x)")


if __name__ == "__main__":
    sys.exit(main())
