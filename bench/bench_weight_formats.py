"""Weight formats side by side: hpcpipe float32 / stored (bf16) / q8_0 against llama.cpp's f32 / bf16 / q8_0 GGUF
of the same bfloat16 checkpoint, on the same cores, in one run.

    python bench/bench_weight_formats.py --llama-bin DIR --converter PATH [--quick] [--formats F,..] [--q8-float-too]
                                          [--out FILE]

The model is SmolLM2-135M-shaped (random weights saved as bfloat16, as real checkpoints are; see
bench_real_models.py for the shape and tokenizer). Measured, each in its own process:

* decode tokens/s at batch 1 on one core (one rank, one thread; llama-bench ``-t 1 -p 0 -n 64``) after a
  32-token prompt, and hpcpipe's peak RSS (the process's ru_maxrss: weights, cache and interpreter);
* a 512-token prompt's time (hpcpipe one rank; llama-bench ``-p 512 -n 0`` with one and two threads);
* each engine's share of the physical limit: one core's copy bandwidth over the bytes a token reads
  (the weights in that format, the tied embedding read once as the head).

llama.cpp is built outside CI from the ``llama-cpp-python`` sdist's vendored source (``cmake -B build
-DGGML_NATIVE=ON -DLLAMA_CURL=OFF && cmake --build build``: llama-bench, llama-quantize); the GGUFs come from its
``convert_hf_to_gguf.py`` (``--outtype f32 / bf16 / q8_0``; it imports ``sentencepiece`` before falling back to
the BPE tokenizer: ``pip install sentencepiece``). Without --llama-bin those rows are skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
PROMPT, NEW, PREFILL = 32, 64, 512
FORMATS = {"float32": "f32", "stored": "bf16", "q8_0": "q8_0"}      # hpcpipe -> the GGUF of the same numbers


def write_bf16_model(directory: Path) -> None:
    """The bench's SmolLM2-shaped random model and tokenizer, its weights saved as bfloat16 (made once)."""
    import torch
    import transformers as T
    from bench_real_models import write_model
    float32 = directory.with_name(directory.name + "-f32")
    if not (float32 / "config.json").exists():
        write_model(float32)
    model = T.AutoModelForCausalLM.from_pretrained(str(float32), dtype=torch.bfloat16)
    model.save_pretrained(str(directory))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (float32 / name).exists():
            (directory / name).write_bytes((float32 / name).read_bytes())


def hpcpipe_child(directory: str, fmt: str, prefill: bool) -> dict:
    """In a fresh process: load the whole model as one stage in ``fmt``, time decode (or a prefill), report RSS."""
    import resource

    import numpy as np

    from hpcpipe.config import from_dict
    from hpcpipe.kernels.formats import inference_format
    from hpcpipe.nn.core.decode import DecodeStage, Segment
    from hpcpipe.nn.registry import model_def
    from hpcpipe.state.sources import resolve_weights
    from hpcpipe.train.setup import restate_stored_shape
    source = resolve_weights(directory)
    raw = restate_stored_shape({"model": {"init": directory, "seq_len": 1024}, "parallel": {"pp": 1}}, source)
    definition = model_def(from_dict(raw))
    fmt = inference_format(fmt)
    weights = source.forward_only("float32", half_embedding=False, stored=fmt != "float32", quantize=fmt == "q8_0")
    indices = list(range(definition.n_layers))
    stage = DecodeStage(definition, range(definition.n_layers), weights.read(indices), np, "float32", 1,
                        weight_format=fmt,
                        release=True)
    rng = np.random.default_rng(0)
    vocab = definition.shape.vocab
    out: dict = {"format": fmt, "compiled": bool(stage.compiled)}
    if prefill:
        stage.forward(rng.integers(0, vocab, 8), [Segment(0, 0, 8)])          # warm the kernels
        times = []
        for _ in range(3):
            start = time.perf_counter()
            stage.forward(rng.integers(0, vocab, PREFILL), [Segment(0, 0, PREFILL)])
            times.append(time.perf_counter() - start)
        out["prefill_512_s"] = min(times)
    else:
        stage.forward(rng.integers(0, vocab, PROMPT), [Segment(0, 0, PROMPT)])
        token = np.array([1])
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            for t in range(NEW):
                logits = stage.forward(token, [Segment(0, PROMPT + t, 1)])
                token = np.array([int(np.argmax(logits[-1]))])
            best = min(best, time.perf_counter() - start)
        out["decode_tok_s"] = NEW / best
    out["peak_rss_bytes"] = own_peak_rss(os.getpid()) or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def own_peak_rss(pid: int) -> int:
    """A running process's own peak resident bytes (VmHWM), 0 where /proc has none.

    Not getrusage's ru_maxrss: Linux carries the parent's resident size at fork into the child's (the bench's
    parent keeps ~600 MB resident after measuring the copy rate), so every child read at least that.
    """
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_hpcpipe(directory: Path, fmt: str, prefill: bool, env: dict | None = None) -> dict:
    """hpcpipe_child in a subprocess with one thread (its own peak RSS); ``env``: more variables for it."""
    env = {**os.environ, **{k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                                             "HPCPIPE_THREADS")}, **(env or {})}
    code = (f"import json, sys; sys.path.insert(0, {str(HERE)!r}); import bench_weight_formats as b; "
            f"print(json.dumps(b.hpcpipe_child({str(directory)!r}, {fmt!r}, {prefill!r})))")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def convert(directory: Path, converter: Path, outtype: str, gguf: Path) -> None:
    """llama.cpp's converter, its pre-tokenizer check told 'gpt-2' (the bench tokenizer's pre-tokenizer)."""
    code = (f"import sys; sys.path[:0] = [{str(converter.parent)!r}, {str(converter.parent / 'gguf-py')!r}]\n"
            "import conversion.base as b\n"
            "b.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'gpt-2'\n"
            f"sys.argv = ['convert', {str(directory)!r}, '--outtype', {outtype!r}, '--outfile', {str(gguf)!r}]\n"
            f"import runpy; runpy.run_path({str(converter)!r}, run_name='__main__')\n")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def llama_bench(binary: Path, gguf: Path, threads: int, prompt: int, new: int) -> dict:
    """llama-bench's mean tokens/s (and the process's peak RSS) for one test."""
    argv = [str(binary), "-m", str(gguf), "-t", str(threads), "-p", str(prompt), "-n", str(new), "-r", "3",
            "-o", "json"]
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.DEVNULL, text=True)
        peak = 0
        while proc.poll() is None:        # its own VmHWM while it runs (see own_peak_rss)
            peak = max(peak, own_peak_rss(proc.pid))
            time.sleep(0.05)
        if proc.returncode:
            raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode})")
        out.seek(0)
        row = json.loads(out.read())[0]
    return {"tok_s": row["avg_ts"], "peak_rss_bytes": peak}


def token_bytes(directory: Path) -> dict:
    """Bytes a decode token reads per format: every matrix once, the tied table once more as the head (f32)."""
    config = json.loads((directory / "config.json").read_text())
    d, ff, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    hd = config.get("head_dim") or d // config["num_attention_heads"]
    qkv = d * hd * (config["num_attention_heads"] + 2 * config["num_key_value_heads"])
    matrices = layers * (qkv + hd * config["num_attention_heads"] * d + 3 * d * ff)
    head = config["vocab_size"] * d
    per = {"float32": 4.0, "stored": 2.0, "q8_0": 34 / 32}
    return {fmt: (matrices + head) * size for fmt, size in per.items()}


def main(argv: list[str] | None = None) -> int:
    """Measure every row and write the JSON results."""
    from bench_real_models import machine_rates
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default="/tmp/bench-smollm2-bf16")
    ap.add_argument("--llama-bin", default="", help="llama.cpp's build/bin (llama-bench)")
    ap.add_argument("--converter", default="", help="llama.cpp's convert_hf_to_gguf.py")
    ap.add_argument("--quick", action="store_true", help="decode only, no prefill rows")
    ap.add_argument("--formats", default=",".join(FORMATS),
                    help=f"comma-separated subset of {','.join(FORMATS)} (default: all)")
    ap.add_argument("--q8-float-too", action="store_true",
                    help="also run hpcpipe q8_0 with float activations (HPCPIPE_Q8_ACTIVATIONS=float) as 'q8_0-float'")
    ap.add_argument("--out", default=str(HERE / "results" / f"{time.strftime('%Y-%m-%d')}-weight-formats.json"))
    args = ap.parse_args(argv)
    formats = [f for f in args.formats.split(",") if f]
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not formats:
        ap.error(f"--formats: {unknown or formats} not among {', '.join(FORMATS)}")
    directory = Path(args.model_dir)
    if not (directory / "config.json").exists():
        write_bf16_model(directory)
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "argv": sys.argv[1:] if argv is None else argv,
                 "load_before": os.getloadavg(),
                 "machine": machine_rates(), "token_bytes": token_bytes(directory), "hpcpipe": {}, "llama.cpp": {}}
    bandwidth = res["machine"]["copy_bytes_per_s"]
    runs = [(fmt, fmt, {}) for fmt in formats]
    if args.q8_float_too and "q8_0" in formats:
        runs.append(("q8_0-float", "q8_0", {"HPCPIPE_Q8_ACTIVATIONS": "float"}))
    for name, fmt, env in runs:
        row = run_hpcpipe(directory, fmt, prefill=False, env=env)
        if not args.quick:
            row["prefill_512_s"] = run_hpcpipe(directory, fmt, prefill=True, env=env)["prefill_512_s"]
        row["limit_share"] = row["decode_tok_s"] / (bandwidth / res["token_bytes"][fmt])
        res["hpcpipe"][name] = row
        print(f"hpcpipe {name}: {json.dumps(row)}", flush=True)
    if args.llama_bin:
        binary = Path(args.llama_bin) / "llama-bench"
        for fmt, outtype in ((f, FORMATS[f]) for f in formats):
            gguf = directory.with_name(f"{directory.name}-{outtype}.gguf")
            if not gguf.exists():
                convert(directory, Path(args.converter), outtype, gguf)
            row = {"decode_1t": llama_bench(binary, gguf, 1, 0, NEW), "decode_2t": llama_bench(binary, gguf, 2, 0, NEW)}
            if not args.quick:
                row["prefill_512_1t_s"] = PREFILL / llama_bench(binary, gguf, 1, PREFILL, 0)["tok_s"]
                row["prefill_512_2t_s"] = PREFILL / llama_bench(binary, gguf, 2, PREFILL, 0)["tok_s"]
            row["limit_share_1t"] = row["decode_1t"]["tok_s"] / (bandwidth / res["token_bytes"][fmt])
            res["llama.cpp"][outtype] = row
            print(f"llama.cpp {outtype}: {json.dumps(row)}", flush=True)
    res["load_after"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    report(res)
    return 0


def report(res: dict) -> None:
    """Print the side-by-side table."""
    print(f"\none core: copy {res['machine']['copy_bytes_per_s'] / 1e9:.1f} GB/s; load {res['load_before']}")
    print(f"{'format':10} {'hpcpipe tok/s':>14} {'limit':>6} {'RSS MB':>7} {'llama.cpp 1t':>13} {'2t':>6} "
          f"{'limit':>6} {'prefill hp/1t/2t s':>20}")
    rows = [(f, FORMATS[f]) for f in res["hpcpipe"] if f in FORMATS] + [("q8_0-float", "q8_0")] * (
        "q8_0-float" in res["hpcpipe"])
    for fmt, outtype in rows:
        h, ll = res["hpcpipe"].get(fmt, {}), res["llama.cpp"].get(outtype, {})
        pre = f"{h.get('prefill_512_s', float('nan')):.2f}/{ll.get('prefill_512_1t_s', float('nan')):.2f}/" \
              f"{ll.get('prefill_512_2t_s', float('nan')):.2f}"
        print(f"{fmt:10} {h.get('decode_tok_s', 0):14.1f} {h.get('limit_share', 0):6.0%} "
              f"{h.get('peak_rss_bytes', 0) / 1e6:7.0f} {ll.get('decode_1t', {}).get('tok_s', 0):13.1f} "
              f"{ll.get('decode_2t', {}).get('tok_s', 0):6.1f} {ll.get('limit_share_1t', 0):6.0%} {pre:>20}")


if __name__ == "__main__":
    sys.exit(main())
