"""GPU benchmark of issue 30: GPT training (hpcpipe at pp = 1 and 2 vs a plain PyTorch step), MFU against the
cuBLAS rates measured in the same run, and serving decode tokens/s at 1 and 64 clients (GPT and Llama).

    python bench/gpu/bench_gpu.py --out $OUT/bench.json --log $OUT/bench.log [--budget-s 300] [--rehearse]

Phases, in order of importance, each a subprocess whose output goes to --log; a phase starts only if its
estimated time still fits in --budget-s (else it is recorded as skipped, with the reason), and the JSON is
rewritten after every phase, so a run cut short still leaves its numbers:

  matmul      bench/gpu/gpu_matmul.py: CuPy fp32 / TF32 / bf16 (2-D n^3 and attention-shaped batched), torch
  hpcpipe-pp1 bench/gpu/gpu_train_worker.py on 1 rank: fp32, then TF32 (run.tf32) in the same process
  torch       bench/gpu/gpu_torch_train.py: fp32, TF32, bf16 autocast
  hpcpipe-pp2 the worker on 2 ranks sharing the GPU
  serve-gpt, serve-llama   bench/gpu/gpu_serve.py
  serve-llama-stored       the Llama from a bfloat16 checkpoint kept as stored on the GPU (model.weight_format)
  decode-graphs            bench/gpu/gpu_decode_graphs.py: one stage's decode steps, eager and replayed from CUDA
                           graphs (1 and 64 sequences; bf16 as stored and float32)

MFU = tokens/s x FLOPs per token (bench/gpt_cost.py: 6 x non-embedding parameters + attention, causal mask
counted fully) / the measured CuPy 2-D rate of the same precision. --rehearse (no CuPy): the quick sizes on
NumPy and torch on the CPU, the matmul phase on NumPy, so that every piece runs before a GPU lease.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

from gpu_common import HERE, ROOT, SIZES, Budget, last_json, mpiexec, run_logged

# seconds each phase is expected to take at the full size (the budget check); quick sizes take a fraction
ESTIMATE = {"matmul": 40, "hpcpipe-pp1": 90, "torch": 60, "hpcpipe-pp2": 90, "serve-gpt": 80, "serve-llama": 80,
            "serve-llama-stored": 80, "decode-graphs": 45}


def phases(args) -> list[tuple[str, list[str]]]:
    """(name, argv) of every phase for this run."""
    py, size, backend = sys.executable, args.size, "numpy" if args.rehearse else "cupy"
    n = str(SIZES[size]["matmul_n"])
    train = [os.path.join(HERE, "gpu_train_worker.py"), "--size", size, "--phases", "fp32,tf32", "--backend", backend]
    torch_args = ["--device", "cpu", "--phases", "fp32"] if args.rehearse else ["--phases", "fp32,tf32,bf16"]
    out = [("matmul", [py, os.path.join(HERE, "gpu_matmul.py"), "--n", n] + (["--cpu"] if args.rehearse else [])),
           ("hpcpipe-pp1", [mpiexec(), "-n", "1", py, *train]),
           ("torch", [py, os.path.join(HERE, "gpu_torch_train.py"), "--size", size, *torch_args]),
           ("hpcpipe-pp2", [mpiexec(), "-n", "2", py, *train])]
    for kind in ("gpt", "llama"):
        out.append((f"serve-{kind}", [py, os.path.join(HERE, "gpu_serve.py"), "--kind", kind, "--size", size,
                                      "--backend", backend, "--log", args.log]))
    out.append(("serve-llama-stored", [py, os.path.join(HERE, "gpu_serve.py"), "--kind", "llama", "--size", size,
                                       "--backend", backend, "--log", args.log, "--weight-format", "stored"]))
    out.append(("decode-graphs", [py, os.path.join(HERE, "gpu_decode_graphs.py"), "--size", size,
                                  "--backend", backend]))
    return out


def flops_per_token(size: str) -> float:
    """Training FLOPs per token of the benchmark GPT (untied head), as bench/gpt_cost.py counts them."""
    sys.path[:0] = [os.path.dirname(HERE), os.path.join(ROOT, "src")]
    import gpt_cost

    from hpcpipe.nn.gpt.shape import GPTShape
    g = SIZES[size]["gpt"]
    return float(gpt_cost.flops_per_token(GPTShape(vocab=g["vocab"], seq_len=g["seq_len"], d_model=g["d_model"],
                                                   n_heads=g["n_heads"], n_blocks=g["n_blocks"], d_ff=g["d_ff"],
                                                   tied=False)))


def rate_of(matmul: dict | None, precision: str) -> float | None:
    """TFLOP/s the MFU of a precision divides by: CuPy's 2-D rate (NumPy's in a rehearsal)."""
    if not matmul:
        return None
    return matmul.get(f"cupy_2d_{precision}") or (matmul.get("numpy_2d_fp32") if precision == "fp32" else None)


def training_rows(results: dict, fpt: float) -> list[dict]:
    """One row per (framework, pp, precision): tokens/s, MFU, ratio to torch at the same precision, bytes moved."""
    matmul = results["phases"].get("matmul", {}).get("result")
    torch_phases = (results["phases"].get("torch", {}).get("result") or {}).get("phases", {})
    rows = []
    for name in ("hpcpipe-pp1", "hpcpipe-pp2", "torch"):
        res = results["phases"].get(name, {}).get("result")
        if not res:
            continue
        for precision, p in res["phases"].items():
            rate = rate_of(matmul, precision)
            ref = torch_phases.get(precision, {}).get("tokens_per_s")
            moved = [r["host_device_bytes_per_step"] for r in p.get("ranks", [])]
            rows.append({"run": name, "pp": res.get("pp", 1), "precision": precision,
                         "tokens_per_s": p["tokens_per_s"], "step_s": p["median_s"],
                         "mfu": p["tokens_per_s"] * fpt / (rate * 1e12) if rate else None,
                         "vs_torch": p["tokens_per_s"] / ref if ref and name != "torch" else None,
                         "host_device_bytes_per_step_by_rank": [max(m) if m else 0 for m in moved] or None})
    return rows


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f} ms"


def report(results: dict) -> str:
    """The tables printed last (the device tool's reply carries the end of the output)."""
    lines = [f"== {results['date']} {results.get('gpu', '?')} size={results['size']} "
             f"flops/token={results['flops_per_token']:.3g}"]
    matmul = results["phases"].get("matmul", {}).get("result") or {}
    rates = {k: v for k, v in matmul.items() if isinstance(v, float) and ("cupy" in k or "torch_2d" in k
                                                                           or "numpy" in k)}
    lines.append("matmul TFLOP/s: " + ", ".join(f"{k} {v:.3g}" for k, v in rates.items()))
    for k, v in matmul.items():
        if k.endswith("_error"):
            lines.append(f"  {k}: {v}")
    lines.append(f"{'run':12s} {'pp':>2s} {'prec':5s} {'tokens/s':>10s} {'step s':>8s} {'MFU':>6s} "
                 f"{'x torch':>7s}  host<->device bytes/step by rank")
    for r in results["training"]:
        mfu = f"{r['mfu'] * 100:5.1f}%" if r["mfu"] is not None else "    -"
        ratio = f"{r['vs_torch']:7.2f}" if r["vs_torch"] is not None else "      -"
        moved = r["host_device_bytes_per_step_by_rank"]
        lines.append(f"{r['run']:12s} {r['pp']:2d} {r['precision']:5s} {r['tokens_per_s']:10.0f} "
                     f"{r['step_s']:8.3f} {mfu} {ratio}  {'-' if moved is None else moved}")
    for kind in ("gpt", "llama", "llama-stored"):
        res = results["phases"].get(f"serve-{kind}", {}).get("result")
        if res and res.get("device_memory_mib_loaded") is not None:
            lines.append(f"serve {kind:12s} GPU memory once loaded: {res['device_memory_mib_loaded']} MiB")
        for p in (res or {}).get("points", []):
            lines.append(f"serve {kind:12s} clients {p['clients']:3d}: {p['tokens_per_s']:8.1f} tokens/s, "
                         f"TTFT p50 {_ms(p['ttft_p50_ms'])}, inter-token p50 {_ms(p['itl_p50_ms'])} "
                         f"p99 {_ms(p['itl_p99_ms'])}, {p['requests_done']} requests done")
    for p in (results["phases"].get("decode-graphs", {}).get("result") or {}).get("points", []):
        lines.append(f"decode step {p['weights']:15s} {p['clients']:3d} sequences: eager "
                     f"{p['eager_ms_per_step']:.2f} ms, CUDA graphs {p['graphed_ms_per_step']:.2f} ms "
                     f"({p['speedup']:.2f}x), logits differ {p['max_rel_logit_diff']:.1e}")
    for name, ph in results["phases"].items():
        if ph["status"] != "ok":
            lines.append(f"{name}: {ph['status']}" + (f" ({ph.get('reason', '')})" if ph.get("reason") else ""))
    return "\n".join(lines)


def main() -> int:
    """Run the phases that fit the budget; write the JSON after each; print the tables."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--rehearse", action="store_true", help="no GPU: quick sizes, NumPy, torch on the CPU")
    ap.add_argument("--only", default="", help="comma-separated phase names to run (default all)")
    args = ap.parse_args()
    args.size = "quick" if args.rehearse else "full"
    budget = Budget(args.budget_s)
    scale = 1.0 if args.size == "full" else 0.25
    results = {"date": time.strftime("%Y-%m-%d"), "host": platform.node(), "size": args.size,
               "sizes": SIZES[args.size], "rehearsal": args.rehearse, "python": sys.version.split()[0],
               "flops_per_token": flops_per_token(args.size), "phases": {}, "training": []}
    try:
        import cupy
        results["gpu"] = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    except Exception as exc:   # the rehearsal
        results["gpu"] = f"none ({type(exc).__name__})"
    wanted = set(filter(None, args.only.split(",")))
    for name, cmd in phases(args):
        if wanted and name not in wanted:
            continue
        need = ESTIMATE[name] * scale
        if not budget.allows(need):
            results["phases"][name] = {"status": "skipped",
                                       "reason": f"{budget.left():.0f} s of the budget left, needs about {need:.0f}"}
            continue
        t0 = time.monotonic()
        print(f"[bench] {name} ({budget.left():.0f} s left)", flush=True)
        status, output = run_logged(cmd, args.log, timeout=min(budget.left(), 2.5 * need + 30))
        parsed = last_json(output)
        ok = status == 0 and parsed is not None
        results["phases"][name] = {"status": "ok" if ok else f"failed (exit {status})",
                                   "seconds": time.monotonic() - t0, "result": parsed}
        if not ok:
            results["phases"][name]["reason"] = output.strip().splitlines()[-1][:300] if output.strip() else ""
        results["training"] = training_rows(results, results["flops_per_token"])
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    text = report(results)
    results["report"] = text
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(text, flush=True)
    return 0 if all(p["status"] in ("ok", "skipped") for p in results["phases"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
