"""Tensor parallelism on this machine: the activation exchange between stages, decode latency, a training step.

    python bench/bench_tp.py [--quick] [--llama-server PATH --converter PATH] [--out FILE] [--parts a,b,c]

Three parts, every rank with one BLAS thread, ratios inside one run (the machine is shared):

* ``exchange``: stage 0's tp ranks hand a (rows, 768) float32 activation to stage 1's tp ranks at pp = 2,
  tp = 2 (4 ranks), each rank sending its share and the next stage allgathering (hpcpipe's way, ``share``),
  or tp rank 0 sending it all and the next stage broadcasting it (``root``): bench/tp_exchange_worker.py.
* ``decode``: per-token decode latency at batch 1 of a SmolLM2-135M-shaped llama with 12 query / 4 key-value
  heads of 48 (d 576, 30 blocks, ff 1536, vocabulary 49152, tied, float32), served by ``hpcpipe.serve`` at
  tp = 1 (1 rank) and tp = 2 (2 ranks), and by llama.cpp's server on one and two threads (with
  --llama-server; built as bench_real_models.py says). Per-token latency = (t(65 new tokens) - t(1 new
  token)) / 64 for one request, best of 3 each: the prompt's prefill and HTTP cancel out.
* ``train``: a training step of the GPT benchmark model (bench_gpt.py's "small" shape, Adam, float32) on 1
  rank and on 2 ranks as dp = 2, pp = 2 and tp = 2, with the tp collectives' seconds per step from the
  metrics (``tp_comm_s``), and the simulator's prediction of the tp = 2 step from the tp = 1 run's trace
  (``python -m hpcpipe.simulate --calibrate TRACE --tp 2 --tp-comm F,B`` with the measured collective time).

Results go to bench/results/<today>-tp.json unless --out says otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_real_models import Server, convert_gguf, load, prompts, write_model  # noqa: E402
from bench_schedules import ENV, MPIEXEC, dated_out, run_job, write_results  # noqa: E402

DECODE_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=12, num_key_value_heads=4, head_dim=48, max_position_embeddings=8192,
                    rope_theta=100000.0, tie_word_embeddings=True, rms_norm_eps=1e-5)
GPT_SMALL = dict(vocab=4096, seq_len=256, d_model=512, n_heads=8, n_blocks=8, d_ff=2048, micro_batches=8,
                 micro_batch_size=4)


def exchange(quick: bool) -> list[dict]:
    """Share vs root exchange of activations of 1024 .. 16384 rows of 768 floats (4 ranks)."""
    out = []
    for rows in ((1024, 8192) if quick else (1024, 4096, 16384)):
        for mode in ("share", "root"):
            r = run_job(4, "tp_exchange_worker.py", ["--mode", mode, "--rows", str(rows),
                                                     "--repeats", "10" if quick else "40"])
            print(f"exchange {mode:5s} {r['bytes'] / 2**20:6.1f} MiB: median {r['median_s'] * 1e3:.2f} ms", flush=True)
            out.append(r)
    return out


def _latency(base: str, text: str, tokens: int) -> float:
    """Best of 3: seconds of one request generating ``tokens`` tokens (load()'s warm-up request not timed)."""
    return min(load(base, [text], 1, 1, tokens)["seconds"] for _ in range(3))


def _per_token(base: str, text: str, new: int) -> dict:
    one, many = _latency(base, text, 1), _latency(base, text, new + 1)
    return {"first_token_s": one, "total_s": many, "per_token_s": (many - one) / new,
            "tokens_per_s": new / (many - one)}


def decode(directory: Path, quick: bool, port: int, llama_server: str, converter: str) -> dict:
    """Per-token decode latency at batch 1: hpcpipe tp = 1 and 2, llama.cpp 1 and 2 threads."""
    if not (directory / "config.json").exists():
        print(f"writing the random 12/4-head SmolLM2-shaped model to {directory} ...", flush=True)
        write_model(directory, DECODE_SHAPE)
    text = prompts(directory, 1, 32)[0]
    new = 16 if quick else 64
    base = f"http://127.0.0.1:{port}"
    out: dict = {}
    env = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    for tp in (1, 2):
        argv = [MPIEXEC, "-n", str(tp), sys.executable, "-m", "hpcpipe.serve", "--weights", str(directory),
                "--port", str(port), "--set", f"parallel.tp={tp}", "--set", "parallel.pp=1",
                "--set", "model.seq_len=256", "--set", "serve.max_sequences=4", "--set", "run.backend=\"numpy\""]
        with Server(argv, r"serving .* on http", env, f"/tmp/bench-tp{tp}.log"):
            out[f"hpcpipe_tp{tp}"] = _per_token(base, text, new)
        print(f"hpcpipe tp={tp}: {json.dumps(out[f'hpcpipe_tp{tp}'])}", flush=True)
    if llama_server and converter:
        gguf = directory / "model-f32.gguf"
        if not gguf.exists():
            convert_gguf(directory, Path(converter), gguf)
        for threads in (1, 2):
            argv = [llama_server, "-m", str(gguf), "--port", str(port), "-t", str(threads), "-tb", str(threads),
                    "-np", "1", "-c", "1024", "--no-warmup"]
            with Server(argv, r"listening on http", None, f"/tmp/bench-tp-llama-{threads}.log"):
                out[f"llama_cpp_threads{threads}"] = _per_token(base, text, new)
            print(f"llama.cpp {threads} thread(s): {json.dumps(out[f'llama_cpp_threads{threads}'])}", flush=True)
    if "hpcpipe_tp1" in out and "hpcpipe_tp2" in out:
        out["tp2_over_tp1"] = out["hpcpipe_tp2"]["per_token_s"] / out["hpcpipe_tp1"]["per_token_s"]
    return out


def _train_sets(layout: dict, metrics: str, trace: str, data: str, steps: int) -> list[str]:
    s = GPT_SMALL
    sets = ["model.kind=\"gpt\"", f"model.vocab_size={s['vocab']}", f"model.seq_len={s['seq_len']}",
            f"model.d_model={s['d_model']}", f"model.n_heads={s['n_heads']}", f"model.n_blocks={s['n_blocks']}",
            f"model.d_ff={s['d_ff']}", "model.tie_embeddings=false", "model.dtype=\"float32\"",
            f"parallel.dp={layout['dp']}", f"parallel.pp={layout['pp']}", f"parallel.tp={layout['tp']}",
            "parallel.schedule=\"1f1b\"", f"data.path=\"{data}\"", f"train.micro_batches={s['micro_batches']}",
            f"train.micro_batch_size={s['micro_batch_size'] // layout['dp']}", "train.optimizer=\"adam\"",
            "train.lr=1e-4", f"train.steps={steps}", f"log.metrics=\"{metrics}\"", "log.progress=false",
            "checkpoint.dir=\"\""]
    return sets + ([f"log.trace=\"{trace}\""] if trace else [])


def _token_file(path: str) -> None:
    import h5py
    import numpy as np
    rng = np.random.default_rng(0)
    s = GPT_SMALL
    n = s["micro_batches"] * s["micro_batch_size"] * 4
    with h5py.File(path, "w") as f:
        ids = rng.integers(0, s["vocab"], (n, s["seq_len"] + 1))
        f["x"], f["y"] = ids[:, :-1].astype(np.int32), ids[:, 1:].astype(np.int32)


def train(quick: bool) -> dict:
    """Step time of the GPT benchmark model at 1 rank, dp = 2, pp = 2, tp = 2; tp_comm_s; the simulator's tp = 2."""
    steps, warmup = (3, 1) if quick else (6, 2)
    out: dict = {"model": GPT_SMALL, "layouts": {}}
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "tokens.h5")
        _token_file(data)
        for name, layout in (("1 rank", dict(dp=1, pp=1, tp=1)), ("dp=2", dict(dp=2, pp=1, tp=1)),
                             ("pp=2", dict(dp=1, pp=2, tp=1)), ("tp=2", dict(dp=1, pp=1, tp=2))):
            metrics, trace = os.path.join(tmp, "m.jsonl"), os.path.join(tmp, f"trace-{layout['tp']}.json")
            if os.path.exists(metrics):
                os.remove(metrics)
            n = layout["dp"] * layout["pp"] * layout["tp"]
            cmd = [MPIEXEC, "-n", str(n), sys.executable, "-m", "hpcpipe.train"]
            for item in _train_sets(layout, metrics, trace if name in ("1 rank", "tp=2") else "", data, steps + warmup):
                cmd += ["--set", item]
            proc = subprocess.run(cmd, env=ENV, cwd=tmp, capture_output=True, text=True)
            if proc.returncode:
                raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")
            records = [json.loads(line) for line in open(metrics) if line.strip()][warmup:]
            step = statistics.median(r["step_time_s"] for r in records)
            row = {"step_s": step, "tp_comm_s": statistics.median(r.get("tp_comm_s", 0.0) for r in records),
                   "loss_step0": json.loads(open(metrics).readline())["loss"]}
            out["layouts"][name] = row
            print(f"train {name:7s}: step {step * 1e3:.1f} ms, tp collectives {row['tp_comm_s'] * 1e3:.1f} ms/step",
                  flush=True)
        # the simulator: the tp = 1 trace's costs split over 2 ranks plus the measured collective time per action
        tp2 = out["layouts"]["tp=2"]
        actions = 2 * GPT_SMALL["micro_batches"]            # one F and one B per micro-batch (1 stage)
        per_action = tp2["tp_comm_s"] / actions
        sim = subprocess.run([sys.executable, "-m", "hpcpipe.simulate", "--schedule", "1f1b", "--pp", "1",
                              "--micro-batches", str(GPT_SMALL["micro_batches"]), "--calibrate",
                              os.path.join(tmp, "trace-1.json"), "--tp", "2", "--tp-comm",
                              f"{per_action},{per_action}"], env=ENV, capture_output=True, text=True)
        line = next((ln for ln in sim.stdout.splitlines() if ln.startswith("step time")), "")
        out["simulated_tp2_step_s"] = float(line.split()[-1]) if line else None
        out["simulate_stdout"] = sim.stdout + sim.stderr
    print(f"simulated tp=2 step: {out['simulated_tp2_step_s']}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the chosen parts and write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="exchange,decode,train")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model-dir", default="/tmp/hpcpipe-smollm2-12-4")
    ap.add_argument("--llama-server", default="")
    ap.add_argument("--converter", default="")
    ap.add_argument("--port", type=int, default=8433)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    parts = args.parts.split(",")
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "load_1min": os.getloadavg()[0],
                 "command": " ".join([sys.executable, *sys.argv])}
    if "exchange" in parts:
        res["exchange"] = exchange(args.quick)
    if "decode" in parts:
        res["decode"] = decode(Path(args.model_dir), args.quick, args.port, args.llama_server, args.converter)
    if "train" in parts:
        res["train"] = train(args.quick)
    out = args.out or dated_out("tp-quick" if args.quick else "tp")
    write_results(out, res)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
