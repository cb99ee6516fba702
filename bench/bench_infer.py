"""Inference throughput benchmark: sequential NumPy vs ``python -m hpcpipe.infer`` at several layouts.

    python bench/bench_infer.py                      # dims [1024]*9, 4096 rows, micro-batches of 128, 3 repeats
    python bench/bench_infer.py --repeats 5 --layouts 1x2 2x4 1x8

Every process runs with one BLAS thread. In one run, repeated and
interleaved so that load from other users hits every configuration alike:

* sequential: this process, the whole model, micro-batch by micro-batch
  (HDF5 read, 8 matmuls with out=, in-place bias and ReLU with the same kernels
  hpcpipe.infer uses, HDF5 write) - the baseline;
* each layout DPxPP: the real command under ``mpiexec -n DP*PP``; its
  rows/s is over the streaming phase the command reports (start barrier to
  last row written), which excludes process start-up and weight loading,
  as the sequential timing does.

Prints a markdown table (median and best of the repeats) with the machine's
load average before and after, and checks every output against the
sequential one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.update({k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                                     "BLIS_NUM_THREADS", "HPCPIPE_THREADS")})

import h5py  # noqa: E402  (after the thread caps)
import numpy as np  # noqa: E402

from hpcpipe.config import from_dict  # noqa: E402
from hpcpipe.nn.mlp.model import initial_arrays, layer_specs  # noqa: E402
from hpcpipe.state.weights import write_weights  # noqa: E402


def load() -> str:
    """Return the 1/5/15-minute load averages and the core count as text."""
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} cores"


def make_files(tmp: str, dims: list[int], rows: int) -> tuple[str, str, dict]:
    """Write a weights file (He init, seed 0, with bias, ReLU) and an input file; return their paths and arrays."""
    model = {"dims": dims, "bias": True, "activation": "relu", "final_activation": True, "dtype": "float32"}
    specs = layer_specs(from_dict({"model": model, "parallel": {"pp": 1}}))
    arrays = initial_arrays(specs, list(range(len(specs))), 0, "float32")
    rng = np.random.default_rng(1)
    for a in arrays.values():   # non-zero biases, so the bias add is measured too
        a["bias"] = (0.01 * rng.standard_normal(a["bias"].shape)).astype(np.float32)
    weights, data = os.path.join(tmp, "weights.h5"), os.path.join(tmp, "in.h5")
    write_weights(weights, arrays, n_layers=len(specs), model_config=model)
    with h5py.File(data, "w") as f:
        f["x"] = rng.standard_normal((rows, dims[0])).astype(np.float32)
    return weights, data, arrays


def idle_fraction(seconds: float = 1.0) -> float:
    """Return the share of all cores' time that was idle over the next `seconds` (Linux /proc/stat)."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
        return values[3] + values[4], sum(values)   # idle + iowait, total
    idle0, total0 = sample()
    time.sleep(seconds)
    idle1, total1 = sample()
    return (idle1 - idle0) / max(total1 - total0, 1)


def wait_quiet(min_idle: float, timeout: float) -> float:
    """Wait (up to timeout seconds) until the cores were at least min_idle idle for a second; return that share."""
    deadline = time.time() + timeout
    idle = idle_fraction()
    while idle < min_idle and time.time() < deadline:
        idle = idle_fraction()
    return idle


def sequential(arrays: dict, data: str, out: str, batch: int) -> tuple[float, float]:
    """Run the whole model in this process micro-batch by micro-batch; return (wall, CPU) seconds.

    Timed from the first read to the last write.
    """
    n_layers = len(arrays)
    ws = [np.ascontiguousarray(arrays[i]["weight"]) for i in range(n_layers)]
    bs = [arrays[i]["bias"] for i in range(n_layers)]
    width = max(w.shape[1] for w in ws)
    with h5py.File(data, "r") as fin, h5py.File(out, "w") as fout:
        x = fin["x"]
        n = x.shape[0]
        y = fout.create_dataset("y", (n, ws[-1].shape[1]), dtype=np.float32)
        xin = np.empty((batch, x.shape[1]), dtype=np.float32)
        bufs = [np.empty((batch, width), dtype=np.float32) for _ in range(2)]
        # the same kernels hpcpipe.infer uses, so the baseline is as fast as one process can be:
        # bias repeated over the rows and ReLU against a zero block (NumPy's broadcast-scalar loops are slower)
        bias_rows = [np.ascontiguousarray(np.broadcast_to(b, (batch, b.shape[0]))) for b in bs]
        zeros = np.zeros((batch, width), dtype=np.float32)
        t0, c0 = time.perf_counter(), time.process_time()
        for start in range(0, n, batch):
            rows = min(batch, n - start)
            x.read_direct(xin, np.s_[start:start + rows], np.s_[0:rows])
            a = xin[:rows]
            for i in range(n_layers):
                z = bufs[i % 2][:rows, :ws[i].shape[1]]
                np.matmul(a, ws[i], out=z)
                z += bias_rows[i][:rows]
                np.maximum(z, zeros[:rows, :z.shape[1]], out=z)
                a = z
            y.write_direct(np.ascontiguousarray(a), dest_sel=np.s_[start:start + rows])
        return time.perf_counter() - t0, time.process_time() - c0


def pipeline(weights: str, data: str, out: str, dp: int, pp: int, batch: int, tmp: str,
             overrides: list[str] = ()) -> tuple[dict, float]:
    """Run the real command under mpiexec; return (its report, the command's wall seconds)."""
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    mpiexec = mpiexec if os.path.exists(mpiexec) else shutil.which("mpiexec")
    report = os.path.join(tmp, f"report-{dp}x{pp}.json")
    args = [mpiexec, "-n", str(dp * pp), sys.executable, "-m", "hpcpipe.infer", "--weights", weights,
            "--input", data, "--output", out, "--report", report, "--set", f"parallel.pp={pp}",
            "--set", f"parallel.dp={dp}", "--set", f"infer.micro_batch_size={batch}"]
    for item in overrides:
        args += ["--set", item]
    t0 = time.perf_counter()
    subprocess.run(args, check=True, cwd=tmp, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    with open(report) as f:
        return json.load(f), wall


def main() -> int:
    """Run the benchmark and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layouts", nargs="+", default=["1x1", "1x2", "2x4"], help="DPxPP layouts to run")
    parser.add_argument("--quiet", type=float, default=0.0,
                        help="before each measurement wait (up to --quiet-wait s) until the cores were this idle "
                             "(0..1) for a second; 0 = do not wait")
    parser.add_argument("--quiet-wait", type=float, default=300.0)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override passed to every hpcpipe.infer run (repeatable)")
    args = parser.parse_args()
    dims = [args.width] * (args.layers + 1)
    layouts = [tuple(int(v) for v in item.split("x")) for item in args.layouts]
    load_before = load()
    results: dict[str, list[dict]] = {"sequential": []}
    loads: list[float] = []
    idle: list[float] = []    # idle share of the cores just before each measurement
    with tempfile.TemporaryDirectory() as tmp:
        weights, data, arrays = make_files(tmp, dims, args.rows)
        ref_path = os.path.join(tmp, "seq.h5")
        for _ in range(args.repeats):
            loads.append(os.getloadavg()[0])
            idle.append(wait_quiet(args.quiet, args.quiet_wait) if args.quiet else idle_fraction(0.2))
            seconds, cpu = sequential(arrays, data, ref_path, args.batch)
            results["sequential"].append({"elapsed_s": seconds, "rows_per_s": args.rows / seconds, "cpu_s": cpu})
            for dp, pp in layouts:
                idle.append(wait_quiet(args.quiet, args.quiet_wait) if args.quiet else idle_fraction(0.2))
                out = os.path.join(tmp, f"out-{dp}x{pp}.h5")
                report, wall = pipeline(weights, data, out, dp, pp, args.batch, tmp, args.set)
                report["wall_s"] = wall
                results.setdefault(f"{dp}x{pp}", []).append(report)
        with h5py.File(ref_path, "r") as f:
            ref = f["y"][...]
        diffs = {}
        for dp, pp in layouts:
            with h5py.File(os.path.join(tmp, f"out-{dp}x{pp}.h5"), "r") as f:
                diffs[f"{dp}x{pp}"] = float(np.max(np.abs(f["y"][...] - ref)))
    load_after = load()

    def med(key: str) -> float:
        return statistics.median(r["rows_per_s"] for r in results[key])

    def top(key: str) -> dict:
        return max(results[key], key=lambda r: r["rows_per_s"])   # the run least disturbed by other users

    seq_best, seq_med = top("sequential"), med("sequential")
    print(f"dims {dims}, {args.rows} rows, micro-batches of {args.batch}, one BLAS thread per rank, "
          f"{args.repeats} interleaved repeats; each row shows the fastest repeat, median rows/s beside it")
    print(f"load average before: {load_before}; after: {load_after}; 1-min load at each repeat: "
          f"{', '.join(f'{v:.2f}' for v in loads)}")
    print(f"idle share of the cores just before each measurement: {', '.join(f'{v:.2f}' for v in idle)}")
    print("cores used = CPU seconds of all ranks / elapsed (about min(ranks, cores) when nobody else runs)\n")
    print("| run | ranks | elapsed s | rows/s (median) | vs sequential (median) | latency p50 / p99 ms "
          "| fill + drain ms | bubble (ideal) | cores used | command wall s | max diff vs seq |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print(f"| sequential NumPy (1 process) | 1 | {seq_best['elapsed_s']:.3f} | {seq_best['rows_per_s']:.0f} "
          f"({seq_med:.0f}) | 1.00x | - | - | - | {seq_best['cpu_s'] / seq_best['elapsed_s']:.2f} | - | 0 |")
    for dp, pp in layouts:
        key = f"{dp}x{pp}"
        r = top(key)
        print(f"| hpcpipe.infer dp={dp} pp={pp} | {dp * pp} | {r['elapsed_s']:.3f} | {r['rows_per_s']:.0f} "
              f"({med(key):.0f}) | {r['rows_per_s'] / seq_best['rows_per_s']:.2f}x ({med(key) / seq_med:.2f}x) | "
              f"{r['latency_ms']['p50']:.1f} / {r['latency_ms']['p99']:.1f} | {r['fill_ms'] + r['drain_ms']:.1f} | "
              f"{100 * r['bubble']:.1f}% ({100 * r['ideal_bubble']:.1f}%) | {r['cpu_s'] / r['elapsed_s']:.2f} | "
              f"{r['wall_s']:.2f} | {diffs[key]:.2e} |")
    if "1x2" in results:
        print(f"\npp=2 / sequential throughput: {top('1x2')['rows_per_s'] / seq_best['rows_per_s']:.2f}x fastest "
              f"repeats, {med('1x2') / seq_med:.2f}x medians (target >= 1.8x)")
        for dp, pp in layouts:
            if dp * pp == 8:
                key = f"{dp}x{pp}"
                print(f"8 ranks ({key}) time / pp=2 time: {top('1x2')['rows_per_s'] / top(key)['rows_per_s']:.2f}x "
                      f"fastest repeats, {med('1x2') / med(key):.2f}x medians (target <= 1.25x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
