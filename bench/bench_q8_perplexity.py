"""q8_0 against bfloat16 on a trained model: held-out perplexity and logits' error.

    python bench/bench_q8_perplexity.py [--work DIR] [--steps N] [--out FILE]

A byte-level llama-kind model (d_model 256, 4 blocks, 4 heads of 64, SwiGLU ff 768: every matrix's input width a
multiple of 32, so every one is quantized) is trained here on Debian's fortunes (``apt-get install fortunes``)
by the real commands (``examples/text_to_hdf5.py``, ``mpiexec -n 2 python -m hpcpipe.train``), exported as a
Hugging Face directory in bfloat16 (``checkpoint export --format hf --dtype bfloat16``), and evaluated on the
held-out tenth of the text by ``python -m hpcpipe.evaluate`` with ``--weight-format`` float32 (the trained
checkpoint), stored (the bf16 directory as stored) and q8_0 (the bf16 directory quantized). Also: the largest
logit error of q8_0 and bf16 relative to float32 on held-out windows. A trained model's activations are far
smaller than a random model's, so its quantization error is the one a user meets.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODEL = {"kind": "llama", "vocab_size": 256, "seq_len": 128, "d_model": 256, "n_heads": 4, "n_kv_heads": 4,
         "n_blocks": 4, "d_ff": 768, "tie_embeddings": True}


def run(argv: list[str], **kw) -> str:
    """Run a command from the repository root; return its stdout (stderr shown on failure)."""
    proc = subprocess.run([str(a) for a in argv], cwd=ROOT, capture_output=True, text=True, **kw)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(map(str, argv))} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout + proc.stderr


def evaluate(weights: Path, data: Path, fmt: str) -> float:
    """The held-out loss (nats per token) ``hpcpipe.evaluate`` prints."""
    out = run([sys.executable, "-m", "hpcpipe.evaluate", "--weights", weights, "--data", data,
               "--weight-format", fmt])
    found = re.search(r"\"loss_nats\": ([0-9.]+)", out)
    if not found:
        raise RuntimeError(f"no loss in the evaluate output:\n{out}")
    return float(found.group(1))


def logits(weights: Path, tokens: np.ndarray, fmt: str) -> np.ndarray:
    """The model's logits over tokens with the weights ``fmt`` keeps (the evaluate command's own loader)."""
    from hpcpipe.config import from_dict
    from hpcpipe.evaluate import load_decoder, logits_of
    from hpcpipe.nn.registry import model_def
    from hpcpipe.state.sources import resolve_weights
    source = resolve_weights(weights)
    definition = model_def(from_dict({"model": {**source.model, "seq_len": tokens.shape[1]}, "parallel": {"pp": 1}}))
    return logits_of(load_decoder(source, definition, "float32", fmt), tokens)


def stage_loss(weights: Path, data: Path, fmt: str, int8_activations: bool, batch: int = 8) -> float:
    """The held-out loss (nats per token) through the compiled decode stage, the path generate and serve run: each
    window one prompt, ``batch`` windows a call, every position's logits. q8_0 multiplies int8 activations (x
    quantized to q8 blocks, AVX512-VNNI) or float32 ones as ``int8_activations`` says."""
    import h5py

    from hpcpipe.config import from_dict
    from hpcpipe.evaluate import token_losses
    from hpcpipe.kernels import cpu
    from hpcpipe.nn.core.decode import DecodeStage, Segment
    from hpcpipe.nn.registry import model_def
    from hpcpipe.state.kinds import restate_stored_shape
    from hpcpipe.state.sources import resolve_weights
    source = resolve_weights(weights)
    with h5py.File(data) as f:
        x, y = f["x"][:], f["y"][:]
    raw = restate_stored_shape({"model": {"init": str(weights), "seq_len": x.shape[1]}, "parallel": {"pp": 1}}, source)
    definition = model_def(from_dict(raw))
    layers = list(range(definition.n_layers))
    arrays = source.forward_only("float32", stored=True, quantize=fmt == "q8_0").read(layers)
    stage = DecodeStage(definition, range(definition.n_layers), arrays, np, "float32", batch, weight_format=fmt,
                        compiled=True)
    cpu.int8_activations(int8_activations)
    if fmt == "q8_0" and cpu.int8_activations() != int8_activations:
        raise RuntimeError("int8 activations asked for, but this CPU has no AVX512-VNNI")
    total, t = 0.0, x.shape[1]
    try:
        for start in range(0, len(x), batch):
            rows = x[start:start + batch]
            segments = [Segment(i, 0, t) for i in range(len(rows))]
            logits = stage.forward(rows.reshape(-1).astype(np.int64), segments, rows=list(range(len(rows) * t)))
            total += float(token_losses(logits.reshape(len(rows), t, -1), y[start:start + batch]).sum())
    finally:
        cpu.int8_activations(True)
    return total / y.size


def main(argv: list[str] | None = None) -> int:
    """Train (once), export, evaluate in every format; write the JSON results."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/bench-q8")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--out", default=str(HERE / "results" / f"{time.strftime('%Y-%m-%d')}-q8-perplexity.json"))
    args = ap.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    data = work / "data"
    if not (data / "text-test.h5").exists():
        run([sys.executable, "examples/text_to_hdf5.py", "/usr/share/games/fortunes", "--out", data, "--seq-len",
             MODEL["seq_len"], "--tokenizer", "bytes", "--held-out", "0.1"])
    checkpoints = work / "checkpoints"
    if not checkpoints.exists():
        sets = [f"model.{k}={json.dumps(v)}" for k, v in MODEL.items()]
        sets += [f'data.path="{data / "text-train.h5"}"', f"train.steps={args.steps}", "train.micro_batches=2",
                 "train.micro_batch_size=8", 'train.optimizer="adamw"', "train.lr=0.003", "parallel.dp=2",
                 "parallel.pp=1", f'checkpoint.dir="{checkpoints}"', f"checkpoint.every={args.steps}",
                 "log.progress=false"]
        start = time.perf_counter()
        run(["mpiexec", "-n", "2", sys.executable, "-m", "hpcpipe.train",
             *[a for s in sets for a in ("--set", s)]], timeout=3600)
        print(f"trained {args.steps} steps in {time.perf_counter() - start:.0f} s", flush=True)
    bf16 = work / "hf-bf16"
    if not bf16.exists():
        run([sys.executable, "-m", "hpcpipe.checkpoint", "export", checkpoints, bf16, "--format", "hf",
             "--dtype", "bfloat16"])
    test = data / "text-test.h5"
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "model": MODEL, "steps": args.steps, "loss": {}}
    for name, weights, fmt in (("float32", checkpoints, "float32"), ("bf16", bf16, "stored"),
                               ("q8_0", bf16, "q8_0")):
        res["loss"][name] = evaluate(weights, test, fmt)
    res["perplexity"] = {k: float(np.exp(v)) for k, v in res["loss"].items()}
    res["q8_0_perplexity_vs_bf16"] = res["perplexity"]["q8_0"] / res["perplexity"]["bf16"] - 1
    # the same through the compiled decode stage (evaluate computes with NumPy, float activations): q8_0 with int8
    # activations (the default where the CPU has AVX512-VNNI, as llama.cpp) against float ones and bf16
    res["stage_loss"] = {"bf16": stage_loss(bf16, test, "stored", False),
                         "q8_0_float_activations": stage_loss(bf16, test, "q8_0", False),
                         "q8_0_int8_activations": stage_loss(bf16, test, "q8_0", True)}
    res["stage_perplexity"] = {k: float(np.exp(v)) for k, v in res["stage_loss"].items()}
    res["stage_perplexity_vs_bf16"] = {k: v / res["stage_perplexity"]["bf16"] - 1
                                       for k, v in res["stage_perplexity"].items() if k != "bf16"}
    print(json.dumps({k: res[k] for k in ("loss", "stage_loss", "stage_perplexity_vs_bf16")}), flush=True)
    import h5py
    with h5py.File(test) as f:
        tokens = f["x"][:16]
    exact = logits(checkpoints, tokens, "float32")
    for name, fmt in (("bf16", "stored"), ("q8_0", "q8_0")):
        got = logits(bf16, tokens, fmt)
        res[f"{name}_logit_error"] = float(np.abs(got - exact).max() / np.abs(exact).max())
        res[f"{name}_argmax_agreement"] = float((got.argmax(-1) == exact.argmax(-1)).mean())
    got_q, got_b = logits(bf16, tokens, "q8_0"), logits(bf16, tokens, "stored")
    res["q8_0_vs_bf16_logit_error"] = float(np.abs(got_q - got_b).max() / np.abs(got_b).max())
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
