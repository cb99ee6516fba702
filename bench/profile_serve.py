"""Where a serving rank's time goes under concurrent load: py-spy samples of every rank while closed-loop clients run.

    python bench/profile_serve.py [--pp 1] [--clients 32] [--requests 2] [--weight-format q8_0] [--out FILE]

Serves bench_real_models' SmolLM2-135M-shaped model as it does (one BLAS thread a rank), warms it, then samples
each rank's threads (idle ones too, so waits count) with ``py-spy record`` for the length of the load and sorts
each rank's main-thread samples into: the compiled blocks (StagePlan.forward), the head's product, sampling,
waits for other ranks (runtime.comm / mailbox), and the rest of the engine's Python; the HTTP thread's busy
samples are counted apart. py-spy must be installed (``pip install py-spy``) and allowed to read the ranks
(same user). The shares are of wall time: the timing of the load itself is bench_real_models' job.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_real_models as real  # noqa: E402

# main-thread categories, the first whose marker is in a sample's stack wins
CATEGORIES = [("compiled blocks", "StagePlan.forward"), ("head product", "FusedStage.logits"),
              ("sampling", "SamplerTable."), ("waits for other ranks", "hpcpipe/runtime/comm.py"),
              ("waits for other ranks", "hpcpipe/runtime/mailbox.py"), ("engine python", "hpcpipe/serve/")]
# leaves that wait: the engine loop's own line is its poll sleep (time.sleep is C: py-spy shows the caller's line)
IDLE = ("select (", "wait (", "sleep", "poll (", "epoll", "Condition.wait", "_recv", "Poller.wait",
        "loop (hpcpipe/serve/engine.py")


def rank_pids() -> list[int]:
    """The serving ranks on this machine: processes run as ``python -m hpcpipe.serve`` (not mpiexec, not workers)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[1:3] == [b"-m", b"hpcpipe.serve"] and b"mpiexec" not in argv[0]:
            pids.append(int(entry.name))
    return sorted(pids)


def breakdown(raw: str) -> dict:
    """Sort py-spy's raw samples (``--threads``) of one rank into the categories; shares of the main thread's."""
    main, http, other, leaves = collections.Counter(), collections.Counter(), 0, collections.Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        if "run_job (" in stack:
            leaf = stack.rsplit(";", 1)[-1]
            name = next((c for c, marker in CATEGORIES if marker in stack), "other")
            if name in ("engine python", "other") and any(i in leaf for i in IDLE):
                name = "engine poll sleeps"
            main[name] += n
            if name not in ("compiled blocks", "head product"):
                leaves[f"{name}: {leaf}"] += n
        elif "http_api.py" in stack:
            http["idle" if any(i in stack.rsplit(";", 1)[-1] for i in IDLE) else "busy"] += n
        else:
            other += n
    total = sum(main.values()) or 1
    return {"main_samples": total, "main": {k: v / total for k, v in main.most_common()},
            "http_thread_busy_share": http["busy"] / total, "other_thread_samples": other,
            "top_other_leaves": {k: v / total for k, v in leaves.most_common(12)}}


def main(argv: list[str] | None = None) -> int:
    """Serve, load, sample the ranks, print and write the breakdown."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pp", type=int, default=1, choices=(1, 2, 3, 4))
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=2, help="requests per client")
    ap.add_argument("--weight-format", choices=sorted(real.GGUF_TYPES), default="q8_0")
    ap.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    ap.add_argument("--port", type=int, default=8437)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if args.clients < 1 or args.requests < 1:
        raise SystemExit("profile_serve: --clients and --requests must be at least 1")
    half = args.weight_format != "float32"
    directory = Path("/tmp/hpcpipe-smollm2-shape" + ("-bf16" if half else ""))
    if not (directory / "config.json").exists():
        real.write_model(directory, dtype="bfloat16" if half else "float32")
    texts = real.prompts(directory, 64, real.PROMPT_TOKENS)
    base = f"http://127.0.0.1:{args.port}"
    argv_serve = ["mpiexec", "-n", str(args.pp), sys.executable, "-m", "hpcpipe.serve", "--weights", str(directory),
                  "--port", str(args.port), "--set", f"parallel.pp={args.pp}", "--set", "model.seq_len=1024",
                  "--set", f"serve.max_sequences={args.clients}", "--set", "run.backend=\"numpy\"",
                  "--set", f"model.weight_format=\"{args.weight_format}\""]
    env = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    res: dict = {"command": " ".join(sys.argv), "load_before": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory() as tmp, real.Server(argv_serve, r"serving .* on http", env,
                                                           f"{tmp}/serve.log"):
        real.load(base, texts, min(4, args.clients), 1)                      # warm every path
        pids = rank_pids()
        spies = [subprocess.Popen(["py-spy", "record", "-p", str(pid), "-d", "600", "-r", str(args.rate), "-f", "raw",
                                   "--threads", "--idle", "--nonblocking", "-o", f"{tmp}/{pid}.txt"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for pid in pids]
        time.sleep(1.0)                                                      # py-spy attached
        res["load"] = real.load(base, texts, args.clients, args.requests)
        for spy in spies:
            spy.send_signal(2)                                               # SIGINT: py-spy writes what it has
            spy.wait(60)
        res["ranks"] = [breakdown(Path(f"{tmp}/{pid}.txt").read_text()) for pid in pids]
    res["load_after"] = os.getloadavg()[0]
    print(f"{args.clients} clients, pp={args.pp}, {args.weight_format}: {res['load']['tokens_per_s']:.1f} tokens/s "
          f"(load {res['load_before']:.2f} -> {res['load_after']:.2f})")
    for rank, r in enumerate(res["ranks"]):
        shares = ", ".join(f"{k} {v:.1%}" for k, v in r["main"].items())
        print(f"  rank {rank} main thread ({r['main_samples']} samples): {shares}; "
              f"HTTP thread busy {r['http_thread_busy_share']:.1%} of that time")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
