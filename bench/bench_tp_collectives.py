"""How a tp collective's wait changes its time: blocking Allreduce, TPGroup's polled Iallreduce, yield-only polling.

    python bench/bench_tp_collectives.py [--rate 10gbit] [--nbytes 1048576] [--repeats 40] [--out FILE]   # as root

On 2 emulated nodes (jobs/netns-cluster.sh, the bench's own names) and within one node, 2 ranks sum a float32
buffer of --nbytes in place, --repeats times each way, after a barrier and between 4 ms of matrix products (as
a tp step reaches its collectives: the ranks arrive apart). ``polled`` is what runtime.tp_group.TPGroup does (an
Iallreduce waited for by runtime.prompt_wait.PromptWait: sched_yield polls for YIELD_S plus twice the fastest
earlier sum of that size, then sleeps doubling to 1 ms); ``fixed-window`` is the wait before that (sched_yield
polls for YIELD_S only, then the sleeps); ``yield-only`` polls with sched_yield until it completes. MPI advances a
nonblocking collective only inside its calls, so over TCP the sleeping polls stretch a transfer made of several
pieces. Median and mean milliseconds per sum, rank 0's.

Results: bench/results/<today>-tp-collectives.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

COMPUTE_S = 0.004


def worker(nbytes: int, repeats: int, out: str) -> None:
    """Under mpiexec -n 2: time the three waits after a barrier and between computes; rank 0 writes out."""
    import numpy as np

    from hpcpipe.runtime.comm import MPI, Poller
    from hpcpipe.runtime.prompt_wait import PromptWait
    from hpcpipe.runtime.tp_group import YIELD_S

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    buf = np.ones(nbytes // 4, np.float32)
    a = np.random.default_rng(rank).standard_normal((2048, 64)).astype(np.float32)
    b = np.random.default_rng(1).standard_normal((64, 192)).astype(np.float32)
    poller = Poller()
    prompt = PromptWait(poller, YIELD_S)

    def yielded() -> None:
        request = world.Iallreduce(MPI.IN_PLACE, buf)
        while not request.Test():
            os.sched_yield()

    ways = {"blocking": lambda: world.Allreduce(MPI.IN_PLACE, buf),
            "polled": lambda: prompt.wait([world.Iallreduce(MPI.IN_PLACE, buf)], ("reduce", buf.nbytes)),
            "fixed-window": lambda: poller.wait([world.Iallreduce(MPI.IN_PLACE, buf)], YIELD_S),
            "yield-only": yielded}
    results = {}
    for name, wait in ways.items():
        for between in ("barrier", "compute"):
            wait()
            times = []
            for _ in range(repeats):
                if between == "compute":
                    start = time.perf_counter()
                    while time.perf_counter() - start < COMPUTE_S:
                        a @ b
                else:
                    world.Barrier()
                t0 = time.perf_counter()
                wait()
                times.append(time.perf_counter() - t0)
            results[f"{name} after {between}"] = {"median_ms": statistics.median(times) * 1e3,
                                                  "mean_ms": statistics.fmean(times) * 1e3}
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def main(argv: list[str] | None = None) -> int:
    """Run the bench (as root); returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="10gbit", help="the emulated link's rate (default 10gbit)")
    parser.add_argument("--nbytes", type=int, default=1 << 20, help="bytes summed (default 1 MiB: a tp=2 block's "
                        "sum in configs/plan-gpt.toml at 32 rows)")
    parser.add_argument("--repeats", type=int, default=40, help="sums per way (default 40)")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help="results file (default bench/results/<today>-tp-collectives.json)")
    args = parser.parse_args(argv)
    if args.worker:
        worker(int(args.worker[0]), int(args.worker[1]), args.worker[2])
        return 0
    from bench_cluster import cluster, launcher, run
    from bench_schedules import dated_out, write_results

    if os.geteuid() != 0:
        raise SystemExit("bench_tp_collectives: needs root (jobs/netns-cluster.sh makes network namespaces)")
    if args.nbytes < 4 or args.repeats < 1:
        raise SystemExit("bench_tp_collectives: --nbytes must be >= 4 and --repeats >= 1")
    results: dict = {"date": time.strftime("%Y-%m-%d"), "time": time.strftime("%H:%M:%S"), "rate": args.rate,
                     "nbytes": args.nbytes, "repeats": args.repeats, "compute_s": COMPUTE_S,
                     "load_before": os.getloadavg()[0], "placements": {}}
    work = Path(tempfile.mkdtemp(prefix="hpcpipe-bench-tpc-", dir="/var/tmp"))
    cluster("up", "2", args.rate)
    try:
        for where in ("across", "within"):
            out = work / f"{where}.json"
            run([*launcher(where == "within"), sys.executable, str(Path(__file__).resolve()), "--worker",
                 str(args.nbytes), str(args.repeats), str(out)], work)
            results["placements"][where] = json.loads(out.read_text())
    finally:
        cluster("down")
    results["load_after"] = os.getloadavg()[0]
    path = args.out or dated_out("tp-collectives")
    write_results(path, results)
    for where, ways in results["placements"].items():
        for name, t in ways.items():
            print(f"{where:7s} {name:26s} median {t['median_ms']:7.3f} ms  mean {t['mean_ms']:7.3f} ms")
    print(f"load {results['load_before']:.2f} -> {results['load_after']:.2f}; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
