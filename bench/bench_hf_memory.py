"""How much memory each rank holds while serving a Llama-3.2-1B-shaped Hugging Face model split over 4 stages.

    python bench/bench_hf_memory.py [--model-dir /tmp/llama-1b] [--out bench/results/DATE-hf-memory.json]

A random model of Llama-3.2-1B's shape (d 2048, 16 blocks, 32 query / 8 key-value heads, ff 8192, vocab
128256, tied embeddings, RoPE llama3 scaling) is written as bfloat16 safetensors (2.5 GB, one shard per
layer group, made once and reused), with a small byte-level BPE tokenizer. ``python -m hpcpipe.serve`` runs it
at pp=4 (4 ranks, float32 compute), answers 4 concurrent requests of 32 new tokens, and the peak resident memory
(VmHWM) of every rank is read from /proc before the server is stopped. The contract's goal: each rank below
0.35 x the whole model in float32 (its own stage, a tied head's copy of the embedding table, the KV cache and
the interpreter). The first stage keeps the bfloat16 embedding table as it is stored (it only gathers rows
from it, widened exactly), the last stage a float32 copy for the tied head. Two cuts are measured: the default
(balanced on each group's forward cost, where the tied head weighs 4.3 blocks) and one balanced on bytes held
([4, 6, 6, 2] layer groups: the 16-bit embedding beside three blocks, the head's float32 copy beside one).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SHAPE = {"vocab_size": 128256, "seq_len": 131072, "d_model": 2048, "n_heads": 32, "n_kv_heads": 8, "n_blocks": 16,
         "d_ff": 8192, "tie_embeddings": True, "head_dim": 64, "rope_theta": 500000.0, "norm_eps": 1e-5,
         "qkv_bias": False, "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
CUTS = {"default": None, "bytes-balanced": "[4,6,6,2]"}


def write_model(directory: Path) -> int:
    """Write the random bf16 model (one shard per layer group) and its tokenizer; return the parameter count."""
    from hpcpipe.hf.names import group_pieces, hf_config_dict
    from hpcpipe.hf.safetensors import write_safetensors

    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    n_groups = SHAPE["n_blocks"] + 2
    weight_map, total, params = {}, 0, 0
    for index in range(n_groups):
        name = f"model-{index + 1:05d}-of-{n_groups:05d}.safetensors"
        tensors = {}
        for piece in group_pieces("llama", SHAPE, index):
            value = (rng.standard_normal(piece.hf_shape, dtype=np.float32) * 0.02 if "norm" not in piece.name
                     else np.ones(piece.hf_shape, dtype=np.float32))
            full = piece.hf if piece.hf == "lm_head.weight" else "model." + piece.hf
            tensors[full] = value
            weight_map[full] = name
            params += value.size
        total += write_safetensors(directory / name, tensors, dtype="bfloat16")
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (directory / "config.json").write_text(json.dumps(hf_config_dict("llama", SHAPE, "bfloat16", (1,), 0), indent=2))
    _write_tokenizer(directory)
    return params


def _write_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    words = "pipeline stage rank tensor shard model token stream weights layer attention".split()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([" ".join(words[i:] + words[:i]) for i in range(len(words))] * 20, trainer)
    (directory / "tokenizer.json").write_text(tok.to_str())
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
         "eos_token": "<|end_of_text|>"}))


def rank_pids(marker: str) -> list[int]:
    """Pids of the python ranks whose command line holds marker (not the launcher)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        words = [a.decode(errors="replace") for a in argv]
        if marker in words and any(w.endswith(("python", "python3")) or "/python" in w for w in words[:1]):
            out.append(int(entry.name))
    return sorted(out)


def peak_rss(pid: int) -> int:
    """VmHWM of a process, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def serve_and_measure(directory: Path, cut: str | None, log: Path) -> dict:
    """Serve at pp=4, answer 4 concurrent requests, return the ranks' peak RSS and the server's stage cut."""
    marker = f'serve.model_name="bench-{os.getpid()}-{time.monotonic_ns()}"'   # finds the ranks in /proc
    args = ["mpiexec", "-n", "4", sys.executable, "-m", "hpcpipe.serve", "--weights", str(directory), "--port", "0",
            "--set", marker, "--set", "parallel.pp=4", "--set", "model.seq_len=1024", "--set", "serve.max_sequences=4",
            "--set", "run.backend=\"numpy\""]
    if cut:
        args += ["--set", f"parallel.stage_layers={cut}"]
    with open(log, "w") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            url = _wait_url(log, proc, 600)
            from openai import OpenAI
            client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
            model = client.models.list().data[0].id      # a model the server does not serve is a 404
            started = time.perf_counter()
            threads = [threading.Thread(target=client.completions.create,
                                        kwargs={"model": model, "prompt": f"pipeline stage {i}", "max_tokens": 32,
                                                "temperature": 0}) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            seconds = time.perf_counter() - started
            pids = rank_pids(marker)
            rss = [peak_rss(pid) for pid in pids]
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(120)
    return {"cut": cut or "default", "ranks": len(rss), "peak_rss_bytes": rss, "seconds_4x32_tokens": seconds}


def _wait_url(log: Path, proc: subprocess.Popen, seconds: float) -> str:
    deadline = time.time() + seconds
    while time.time() < deadline:
        found = re.search(r"on (http://[\d.]+:\d+)/v1", log.read_text())
        if found:
            return found.group(1)
        if proc.poll() is not None:
            raise SystemExit(f"serve exited with {proc.returncode}:\n{log.read_text()}")
        time.sleep(0.2)
    raise SystemExit(f"serve did not start within {seconds} s:\n{log.read_text()}")


def main(argv: list[str] | None = None) -> int:
    """Write the model if needed, serve it at both cuts, print and save the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default="/tmp/hpcpipe-llama-1b", help="where the random model is (made once)")
    ap.add_argument("--out", default=str(HERE / "results" / f"{time.strftime('%Y-%m-%d')}-hf-memory.json"))
    args = ap.parse_args(argv)
    directory = Path(args.model_dir)
    if not (directory / "config.json").exists():
        print(f"writing the random Llama-3.2-1B-shaped model to {directory} ...", flush=True)
        write_model(directory)
    from hpcpipe.config import from_dict
    from hpcpipe.nn.registry import model_specs
    n_params = sum(s.n_params for s in model_specs(from_dict({"model": {"kind": "llama", **SHAPE},
                                                                "parallel": {"pp": 1}})))
    whole = n_params * 4
    results = {"params": n_params, "whole_float32_bytes": whole, "goal_bytes": 0.35 * whole, "runs": []}
    print(f"model: {n_params / 1e9:.3f} B parameters, {whole / 2**30:.2f} GiB in float32; goal per rank "
          f"{0.35 * whole / 2**30:.2f} GiB")
    for name, cut in CUTS.items():
        run = serve_and_measure(directory, cut, Path(f"/tmp/bench-hf-memory-{name}.log"))
        results["runs"].append(run)
        shares = ", ".join(f"{r / 2**30:.2f} GiB ({r / whole:.3f}x)" for r in run["peak_rss_bytes"])
        print(f"{name:>15} cut: peak RSS per rank {shares}; 4 x 32 tokens in {run['seconds_4x32_tokens']:.1f} s; "
              f"goal {'met' if max(run['peak_rss_bytes']) < 0.35 * whole else 'NOT met'}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
