"""Serving on the GPU: decode tokens/s of ``python -m hpcpipe.serve`` at 1 and 64 concurrent streaming clients.

    python bench/gpu/gpu_serve.py --kind gpt --size full --log bench.log [--backend cupy]   # one JSON line
                                  [--weight-format stored]

One model per call: the benchmark GPT's shape (tied head) or a Llama of the same width (bench/gpu/gpu_common.SIZES),
float32, random weights (normal 0.02), a 96-character tokenizer (one character = one token), written once to a
temporary HDF5 file. One server, one rank (pp = 1) on the GPU, serve.max_sequences = the largest client count;
closed-loop streaming clients from bench/serve_load.py (seeded 32-character prompts, max_tokens 64,
temperature 0): per point a warm-up, then a window whose completion tokens / window = tokens/s, with TTFT and
inter-token p50/p99 and the server's own /metrics view; and the GPU memory the server holds once loaded
(nvidia-smi). ``--weight-format stored`` / ``q8_0``: the model is written as a Hugging Face directory in bfloat16
(hpcpipe's export) and served with model.weight_format so, its matrices kept on the GPU as stored
(hpcpipe.kernels.row_product) and multiplied by hpcpipe.kernels.cuda.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
from gpu_common import ROOT, SIZES, child_env, mpiexec

CHARS = "".join(chr(c) for c in range(32, 127)) + "\n"
WORDS = ("the pipeline keeps every stage busy while tokens stream to many users at once so decode steps "
         "overlap across ranks and the cache holds keys and values").split()


def write_model(path: str, kind: str, shape: dict, seed: int = 0) -> dict:
    """Write a float32 GPT (tied) or Llama (untied) with random weights and the chars tokenizer; return its config."""
    from hpcpipe.config import from_dict
    from hpcpipe.nn.registry import model_def
    from hpcpipe.state.weights import write_weights
    config = {"kind": kind, "vocab_size": len(CHARS), "seq_len": shape["seq_len"], "d_model": shape["d_model"],
              "n_heads": shape["n_heads"], "n_blocks": shape["n_blocks"], "d_ff": shape.get("d_ff", 0),
              "tie_embeddings": kind == "gpt", "dtype": "float32"}
    if kind == "llama":
        config.update(n_kv_heads=shape["n_kv_heads"], head_dim=0, rope_theta=10000.0, rope_scaling={},
                      norm_eps=1e-5, qkv_bias=False)
    model = model_def(from_dict({"model": config, "parallel": {"pp": 1}}))
    rng = np.random.default_rng(seed)
    groups = {}
    for spec in model.specs:
        group = {}
        for name, dims in spec.shapes.items():
            if name.endswith("bias"):
                group[name] = np.zeros(dims, dtype=np.float32)
            elif "norm" in name or name.startswith("ln"):
                group[name] = np.ones(dims, dtype=np.float32)
            else:
                value = rng.standard_normal(tuple(dims), dtype=np.float32)
                value *= 0.02
                group[name] = value
        groups[spec.index] = group
    write_weights(path, groups, n_layers=len(groups), model_config=config,
                  attrs={"tokenizer": json.dumps({"kind": "chars", "chars": CHARS})})
    return {**config, "params": int(sum(a.size for g in groups.values() for a in g.values()))}


def device_memory_mib() -> int | None:
    """MiB of GPU memory the compute processes hold (nvidia-smi; the server is the only one during a phase), or
    None without nvidia-smi (a rehearsal) or when it fails."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
        return sum(int(line) for line in out.split() if line.strip().isdigit())
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def prompts(n: int, chars: int, seed: int = 0) -> list[str]:
    """n prompts of exactly `chars` characters: seeded word sequences, cut to length."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        text = ""
        while len(text) < chars:
            text += WORDS[rng.integers(len(WORDS))] + " "
        out.append(text[:chars])
    return out


class Server:
    """One `mpiexec -n 1 python -m hpcpipe.serve --port 0` job: started, waited for, stopped with SIGTERM."""

    def __init__(self, weights: str, sets: list[str], log: str, start_s: float):
        self.cmd = [mpiexec(), "-n", "1", sys.executable, "-m", "hpcpipe.serve", "--weights", weights, "--port", "0"]
        for item in sets:
            self.cmd += ["--set", item]
        self.log = log
        with open(log, "a") as f:
            f.write(f"\n$ {' '.join(self.cmd)}\n")
        self._out = open(log, "a")
        self._mark = os.path.getsize(log)
        self.proc = subprocess.Popen(self.cmd, stdout=self._out, stderr=subprocess.STDOUT, env=child_env(),
                                     cwd=ROOT, start_new_session=True)
        self.url = self._wait_url(start_s)

    def _text(self) -> str:
        with open(self.log) as f:
            f.seek(self._mark)
            return f.read()

    def _wait_url(self, seconds: float) -> str:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            found = re.search(r"on (http://[\d.]+:\d+)/v1", self._text())
            if found:
                return found.group(1)
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited with {self.proc.returncode}:\n{self._text()[-2000:]}")
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"serve did not start in {seconds:.0f} s:\n{self._text()[-2000:]}")

    def stop(self) -> int:
        """SIGTERM (the server drains and exits), SIGKILL to the group after 30 s; the exit status."""
        try:
            self.proc.send_signal(signal.SIGTERM)
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait(10)
        finally:
            self._out.close()


def main() -> None:
    """Write the model, serve it, measure each client count; print one JSON line."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", default="gpt", choices=["gpt", "llama"])
    ap.add_argument("--size", default="full", choices=sorted(SIZES))
    ap.add_argument("--backend", default="cupy")
    ap.add_argument("--log", required=True, help="file the server's output is appended to")
    ap.add_argument("--weight-format", default="float32", choices=["float32", "stored", "q8_0"])
    args = ap.parse_args()
    size = SIZES[args.size]
    from serve_load import measure

    tmp = tempfile.mkdtemp(prefix="hpcpipe-gpu-serve-")
    weights = os.path.join(tmp, f"bench-{args.kind}.h5")
    t0 = time.perf_counter()
    model = write_model(weights, args.kind, size[f"serve_{args.kind}"])
    served, sets = weights, []
    if args.weight_format != "float32":
        from hpcpipe.state.hf_convert import export_hf
        from hpcpipe.state.sources import resolve_weights
        served = os.path.join(tmp, f"bench-{args.kind}-bf16")
        export_hf(resolve_weights(weights), served, "bfloat16")
        sets = ["model.dtype=float32", f'model.weight_format="{args.weight_format}"']
    write_s = time.perf_counter() - t0
    texts = prompts(64, size["prompt_chars"])
    body = {"model": os.path.basename(served), "max_tokens": size["max_tokens"], "temperature": 0.0, "seed": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    top = max(size["clients"])
    t0 = time.perf_counter()
    server = Server(served, [f"run.backend={args.backend}", "parallel.pp=1", f"serve.max_sequences={top}", *sets],
                    args.log, start_s=300)
    result = {"kind": args.kind, "model": model, "backend": args.backend, "weight_format": args.weight_format,
              "write_s": write_s,
              "start_s": time.perf_counter() - t0, "points": [],
              "device_memory_mib_loaded": device_memory_mib()}    # weights and KV pool, before any request
    try:
        for clients in size["clients"]:
            r = measure(server.url, clients, texts, body, size["warmup_s"], size["window_s"], 100_000, 0)
            result["points"].append({"clients": clients, **r})
            print(f"{args.kind} c={clients}: {r['tokens_per_s']:.1f} tokens/s, {r['requests_done']} requests done",
                  file=sys.stderr, flush=True)
    finally:
        result["exit_status"] = server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
