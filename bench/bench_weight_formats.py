"""Weight formats side by side: hpcpipe float32 / stored (bf16) / q8_0 against llama.cpp's f32 / bf16 / q8_0 GGUF
of the same bfloat16 checkpoint, on the same cores, in one run.

    python bench/bench_weight_formats.py --llama-bin DIR --converter PATH [--quick | --prefill-only] [--out FILE]
        [--shape smollm2-135m|amd-llama-135m] [--tp 1,2] [--formats float32,stored,q8_0] [--q8-float-too]

The model is SmolLM2-135M-shaped (random weights saved as bfloat16, as real checkpoints are; see
bench_real_models.py for the shape and tokenizer), or with ``--shape amd-llama-135m`` AMD-Llama-135m's shape
(d 768, 12 blocks, 12 heads of 64 and as many kv heads, ff 3072, vocab 32000, untied head): about the same bytes,
but heads, ff and q8_0 blocks that two tensor-parallel ranks can split (SmolLM2-135M's 9 / 3 heads cannot).
``--tp 1,2`` measures hpcpipe's decode at each tp (tp > 1: ``mpiexec -n tp``, one thread a rank, each rank
reading its part of the stored weights; greedy over the whole vocabulary: the head's columns gathered on rank
0 and the token broadcast, as generate does). Measured, each in its own process:

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
# AMD-Llama-135m's config.json (a Llama-2-style 135M model whose 12 heads split over 2 or 4 tp ranks)
SHAPES = {"smollm2-135m": None,
          "amd-llama-135m": dict(vocab_size=32000, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                 num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=2048,
                                 rope_theta=10000.0, tie_word_embeddings=False, rms_norm_eps=1e-5)}


def write_bf16_model(directory: Path, shape: dict | None = None) -> None:
    """The bench's random model (SmolLM2-shaped, or ``shape``) and tokenizer, its weights saved as bfloat16 (made
    once)."""
    import torch
    import transformers as T
    from bench_real_models import write_model
    float32 = directory.with_name(directory.name + "-f32")
    if not (float32 / "config.json").exists():
        write_model(float32, shape)
    model = T.AutoModelForCausalLM.from_pretrained(str(float32), dtype=torch.bfloat16)
    model.save_pretrained(str(directory))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (float32 / name).exists():
            (directory / name).write_bytes((float32 / name).read_bytes())


def _tp_group(tp: int):
    """The tensor-parallel group of this mpiexec's ranks (None at tp = 1)."""
    if tp == 1:
        return None
    from mpi4py import MPI

    from hpcpipe.runtime.backend import select_backend
    from hpcpipe.runtime.comm import Poller
    from hpcpipe.runtime.tp_group import TPGroup
    if MPI.COMM_WORLD.Get_size() != tp:
        raise SystemExit(f"tp = {tp} needs mpiexec -n {tp}")
    return TPGroup(MPI.COMM_WORLD, select_backend("numpy"), Poller())


def hpcpipe_child(directory: str, fmt: str, prefill: bool, tp: int = 1) -> dict | None:
    """In a fresh process (tp > 1: one of tp MPI ranks, each holding its part): load the whole model as one stage in
    ``fmt``, time decode (or a prefill), report RSS (rank 0 returns the result, the others None)."""
    import resource

    import numpy as np

    from hpcpipe.config import from_dict
    from hpcpipe.kernels.formats import inference_format
    from hpcpipe.nn.core.decode import DecodeStage, Segment
    from hpcpipe.nn.core.sharding import vocab_range
    from hpcpipe.nn.registry import model_def
    from hpcpipe.state.sources import resolve_weights
    from hpcpipe.train.setup import restate_stored_shape
    source = resolve_weights(directory)
    raw = restate_stored_shape({"model": {"init": directory, "seq_len": 1024}, "parallel": {"pp": 1}}, source)
    definition = model_def(from_dict(raw))
    fmt = inference_format(fmt)
    weights = source.forward_only("float32", half_embedding=False, stored=fmt != "float32", quantize=fmt == "q8_0")
    indices = list(range(definition.n_layers))
    group = _tp_group(tp)
    shards = None if group is None else (lambda i, names: definition.shards(i, tp, group.rank))
    stage = DecodeStage(definition, range(definition.n_layers), weights.read(indices, shards), np, "float32", 1,
                        weight_format=fmt, release=True, tp=group)
    rng = np.random.default_rng(0)
    vocab = definition.shape.vocab
    widths = [vocab_range(vocab, tp, r)[1] - vocab_range(vocab, tp, r)[0] for r in range(tp)]

    def greedy(logits: np.ndarray) -> int:
        """The argmax over the whole vocabulary (tp: the ranks' columns gathered on rank 0, the token sent back)."""
        if group is None:
            return int(np.argmax(logits[-1]))
        full = group.gather_columns(logits[-1:], widths)
        return group.comm.bcast(int(np.argmax(full[-1])) if group.rank == 0 else None, root=0)

    sync = (lambda: None) if group is None else group.comm.Barrier
    out: dict = {"format": fmt, "tp": tp, "compiled": bool(stage.compiled)}
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
        best, comm = float("inf"), 0.0
        for _ in range(3):
            sync()
            if group is not None:
                group.take_seconds()
            start = time.perf_counter()
            for t in range(NEW):
                logits = stage.forward(token, [Segment(0, PROMPT + t, 1)])
                token = np.array([greedy(logits)])
            spent = time.perf_counter() - start
            if spent < best:
                best, comm = spent, group.take_seconds() if group is not None else 0.0
        out["decode_tok_s"] = NEW / best
        if group is not None:       # the stage's sums and the head's gather, waiting included (not the broadcast)
            out["tp_comm_ms_per_token"] = 1e3 * comm / NEW
    out["peak_rss_bytes"] = own_peak_rss(os.getpid()) or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if group is not None:
        rss = group.comm.gather(out["peak_rss_bytes"], root=0)
        if group.rank:
            return None
        out["peak_rss_bytes"], out["peak_rss_bytes_ranks"] = sum(rss), rss       # the ranks' together
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


def run_hpcpipe(directory: Path, fmt: str, prefill: bool, tp: int = 1, env: dict | None = None) -> dict:
    """hpcpipe_child in a subprocess with one thread (tp > 1: ``mpiexec -n tp``, one thread a rank); ``env``:
    more variables for it."""
    env = {**os.environ, **{k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                                             "HPCPIPE_THREADS")}, **(env or {})}
    code = (f"import json, sys; sys.path.insert(0, {str(HERE)!r}); import bench_weight_formats as b; "
            f"r = b.hpcpipe_child({str(directory)!r}, {fmt!r}, {prefill!r}, {tp}); "
            f"r is None or print(json.dumps(r))")
    argv = [sys.executable, "-c", code]
    if tp > 1:
        argv = [str(Path(sys.executable).parent / "mpiexec"), "-n", str(tp), *argv]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"hpcpipe {fmt} tp={tp} failed ({proc.returncode}): {proc.stderr[-2000:]}")
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
    ap.add_argument("--prefill-only", action="store_true", help="the 512-token prompt only, no decode rows")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m", help="the random model's shape")
    ap.add_argument("--tp", default="1", help="hpcpipe's tensor-parallel sizes to measure, e.g. 1,2")
    ap.add_argument("--formats", default=",".join(FORMATS), help="weight formats to measure, e.g. stored,q8_0")
    ap.add_argument("--q8-float-too", action="store_true",
                    help="also run hpcpipe q8_0 with float activations (HPCPIPE_Q8_ACTIVATIONS=float) as 'q8_0-float'")
    ap.add_argument("--out", default=str(HERE / "results" / f"{time.strftime('%Y-%m-%d')}-weight-formats.json"))
    args = ap.parse_args(argv)
    if args.quick and args.prefill_only:
        ap.error("--quick (decode only) and --prefill-only leave nothing to measure")
    tps = [int(t) for t in args.tp.split(",")]
    formats = args.formats.split(",")
    if any(t < 1 for t in tps) or any(f not in FORMATS for f in formats):
        ap.error(f"--tp takes sizes >= 1, --formats some of {', '.join(FORMATS)}")
    default_dir = ap.get_default("model_dir")
    directory = Path(args.model_dir if args.shape == "smollm2-135m" or args.model_dir != default_dir
                     else f"/tmp/bench-{args.shape}-bf16")
    if not (directory / "config.json").exists():
        write_bf16_model(directory, SHAPES[args.shape])
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join([sys.argv[0], *(argv or sys.argv[1:])]),
                 "shape": args.shape, "load_before": os.getloadavg(), "machine": machine_rates(),
                 "token_bytes": token_bytes(directory), "hpcpipe": {}, "llama.cpp": {}}
    bandwidth = res["machine"]["copy_bytes_per_s"]
    runs = [(fmt, fmt, {}) for fmt in formats]
    if args.q8_float_too and "q8_0" in formats:
        runs.append(("q8_0-float", "q8_0", {"HPCPIPE_Q8_ACTIVATIONS": "float"}))
    for name, fmt, env in runs:
        for tp in tps:
            row = {} if args.prefill_only else run_hpcpipe(directory, fmt, prefill=False, tp=tp, env=env)
            if not args.quick:
                prefill = run_hpcpipe(directory, fmt, prefill=True, tp=tp, env=env)
                row = {**prefill, **row, "prefill_512_s": prefill["prefill_512_s"]}
            if not args.prefill_only:
                # tp ranks each read 1 / tp of the bytes, on as many cores: tp cores' copy rate over a token's bytes
                row["limit_share"] = row["decode_tok_s"] / (tp * bandwidth / res["token_bytes"][fmt])
            res["hpcpipe"][name if tp == 1 else f"{name} tp={tp}"] = row
            print(f"hpcpipe {name} tp={tp}: {json.dumps(row)}", flush=True)
    if args.llama_bin:
        binary = Path(args.llama_bin) / "llama-bench"
        for fmt, outtype in FORMATS.items():
            if fmt not in formats:
                continue
            gguf = directory.with_name(f"{directory.name}-{outtype}.gguf")
            if not gguf.exists():
                convert(directory, Path(args.converter), outtype, gguf)
            row = {} if args.prefill_only else {"decode_1t": llama_bench(binary, gguf, 1, 0, NEW),
                                                "decode_2t": llama_bench(binary, gguf, 2, 0, NEW)}
            if not args.quick:
                row["prefill_512_1t_s"] = PREFILL / llama_bench(binary, gguf, 1, PREFILL, 0)["tok_s"]
                row["prefill_512_2t_s"] = PREFILL / llama_bench(binary, gguf, 2, PREFILL, 0)["tok_s"]
            if not args.prefill_only:
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
    print(f"{'format':13} {'hp tok/s':>9} {'limit':>6} {'RSS MB':>7} {'llama.cpp 1t':>13} {'2t':>6} "
          f"{'limit':>6} {'prefill hp/1t/2t s':>20}")
    for key, h in res["hpcpipe"].items():
        fmt = key.split()[0].removesuffix("-float")
        ll = res["llama.cpp"].get(FORMATS[fmt], {})
        pre = f"{h.get('prefill_512_s', float('nan')):.2f}/{ll.get('prefill_512_1t_s', float('nan')):.2f}/" \
              f"{ll.get('prefill_512_2t_s', float('nan')):.2f}"
        print(f"{key:13} {h.get('decode_tok_s', 0):9.1f} {h.get('limit_share', 0):6.0%} "
              f"{h.get('peak_rss_bytes', 0) / 1e6:7.0f} {ll.get('decode_1t', {}).get('tok_s', 0):13.1f} "
              f"{ll.get('decode_2t', {}).get('tok_s', 0):6.1f} {ll.get('limit_share_1t', 0):6.0%} {pre:>20}")


if __name__ == "__main__":
    sys.exit(main())
