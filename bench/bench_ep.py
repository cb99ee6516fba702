"""Expert parallelism on this machine: decode tokens/s of a Qwen3-MoE-shaped model at ep=2 against ep=1.

    python bench/bench_ep.py [--quick] [--out FILE] [--llama-bin DIR --converter PATH]

The model: a random transformers Qwen3MoeForCausalLM with 48 experts, 8 chosen a token (Qwen3-30B-A3B's
128 / 8, scaled down), d_model 256, 4 blocks, expert width 128, 4 query / 2 key-value heads of 64, vocabulary
8192, float32. ``python -m hpcpipe.generate`` decodes one greedy sequence at

* ``ep1``: 1 rank (every expert on it);
* ``ep2``: 2 ranks, dp = 2 with ep = 2 (each rank holds 24 experts; the replica without the prompt joins its
  peer's all-to-alls every step, as a serving replica without requests does);
* ``pp2``: 2 ranks, pp = 2 (the other way to put two ranks on one sequence, every expert of a block on its stage).

Per-token latency = (t(257 new tokens) - t(1 new token)) / 256 from the command's own "generated ... in S s" line
(prefill and start-up cancel out), best of N; ep_comm_s per token (the slowest rank's seconds in the experts'
all-to-alls, from --json, the same difference) and its share of the token's time; the job's CPU seconds (every
rank, getrusage of the children) per decoded token beside it, and the load average before each layout (the
machine is shared). Every rank runs one BLAS thread. With ``--llama-bin`` (llama.cpp's build/bin) and
``--converter`` (its convert_hf_to_gguf.py) the same directory is converted to an f32 GGUF (hpcpipe computes MoE
stages in float32) and llama-bench decodes 64 tokens (``-p 0 -n 64 -r 3``) with 1 and with 2 threads in the
same run (bench_weight_formats' convert and llama_bench).
Results go to bench/results/<today>-ep.json unless --out says otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_schedules import ENV, MPIEXEC, dated_out, write_results  # noqa: E402

SHAPE = dict(vocab_size=8192, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=48,
             num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=512, tie_word_embeddings=False,
             decoder_sparse_step=1, mlp_only_layers=[])
LAYOUTS = {"ep1": (1, ["--set", "parallel.pp=1"]),
           "ep2": (2, ["--set", "parallel.pp=1", "--set", "parallel.ep=2"]),
           "pp2": (2, ["--set", "parallel.pp=2"])}
PROMPT = "the pipeline stage sends activations to the next rank"
LONG = 256          # decoded tokens timed (start-up's CPU varies by more than 64 tokens' worth under load)


def write_model(directory: Path) -> None:
    """A random Qwen3-MoE of SHAPE and a byte-level BPE tokenizer."""
    import torch
    import transformers as T
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    torch.manual_seed(0)
    model = T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(**SHAPE, bos_token_id=0, eos_token_id=1)).eval()
    model.generation_config.eos_token_id = None
    model.save_pretrained(str(directory))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=SHAPE["vocab_size"], special_tokens=["<|endoftext|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([PROMPT * 20] * 200, trainer)
    T.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                              eos_token="<|im_end|>").save_pretrained(str(directory))


def generate(directory: Path, ranks: int, args: list[str], tokens: int) -> tuple[float, float, float]:
    """(the command's generation seconds, the job's CPU seconds, its ep_comm_s) of one greedy generation."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = directory.with_name(f"result-{time.monotonic_ns()}.json")
    cmd = [MPIEXEC, "-n", str(ranks), sys.executable, "-m", "hpcpipe.generate", "--weights", str(directory),
           "--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", str(tokens), "--json", str(result), *args]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    found = re.search(r"generated (\d+) tokens in ([0-9.]+) s", proc.stderr)
    if proc.returncode or found is None or int(found.group(1)) != tokens:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return float(found.group(2)), cpu, float(json.loads(result.read_text()).get("ep_comm_s", 0.0))


def measure(directory: Path, repeats: int) -> dict:
    """Per-token decode latency and CPU seconds of every layout."""
    out = {}
    for name, (ranks, args) in LAYOUTS.items():
        load = os.getloadavg()[0]
        runs = []
        for _ in range(repeats):
            short, short_cpu, short_ep = generate(directory, ranks, args, 1)
            long, long_cpu, long_ep = generate(directory, ranks, args, LONG + 1)
            runs.append(((long - short) / LONG, (long_cpu - short_cpu) / LONG, (long_ep - short_ep) / LONG))
        best = min(runs)
        out[name] = {"ranks": ranks, "args": args, "load_average_1m_before": load, "per_token_s_runs": runs,
                     "per_token_s": best[0], "tokens_per_s": 1.0 / best[0] if best[0] > 0 else 0.0,
                     "cpu_s_per_token": min(run[1] for run in runs),
                     "ep_comm_s_per_token": best[2], "ep_comm_share": best[2] / best[0] if best[0] > 0 else 0.0}
        print(f"{name}: {out[name]['tokens_per_s']:.1f} tokens/s ({best[0] * 1e3:.2f} ms/token, "
              f"{out[name]['cpu_s_per_token'] * 1e3:.2f} CPU ms/token over all ranks, ep_comm_s "
              f"{best[2] * 1e3:.2f} ms/token = {out[name]['ep_comm_share']:.0%}; load {load:.1f})", flush=True)
    return out


def measure_llama(directory: Path, bin_dir: Path, converter: Path) -> dict:
    """llama.cpp's decode tokens/s on the same model (f32 GGUF), 1 and 2 threads, with the load before each."""
    from bench_weight_formats import convert, llama_bench
    gguf = directory.with_name(directory.name + "-f32.gguf")
    convert(directory, converter, "f32", gguf)
    out = {"gguf": "f32", "command": "llama-bench -m MODEL -t T -p 0 -n 64 -r 3 -o json"}
    for threads in (1, 2):
        load = os.getloadavg()[0]
        row = llama_bench(bin_dir / "llama-bench", gguf, threads, 0, 64)
        out[f"decode_{threads}t"] = {**row, "load_average_1m_before": load}
        print(f"llama.cpp {threads} thread(s): {row['tok_s']:.1f} tokens/s (load {load:.1f})", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one repeat instead of three")
    parser.add_argument("--out", default=dated_out("ep"))
    parser.add_argument("--llama-bin", default="", help="llama.cpp's build/bin (llama-bench)")
    parser.add_argument("--converter", default="", help="llama.cpp's convert_hf_to_gguf.py")
    args = parser.parse_args()
    llama: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "qwen3-moe-48x8"
        write_model(directory)
        started = time.strftime("%Y-%m-%dT%H:%M:%S")
        layouts = measure(directory, 1 if args.quick else 3)
        if args.llama_bin:
            llama = measure_llama(directory, Path(args.llama_bin), Path(args.converter))
    ratio = layouts["ep2"]["tokens_per_s"] / layouts["ep1"]["tokens_per_s"]
    write_results(args.out, {"bench": "ep", "command": " ".join(["python", *sys.argv]), "started": started,
                             "cores": os.cpu_count(), "model": SHAPE,
                             "layouts": layouts, "ep2_over_ep1": ratio, "llama.cpp": llama,
                             "note": "wall seconds per decoded token (best of runs) on a machine shared with "
                                     "other engineers' tests; CPU seconds summed over the job's ranks"})
    print(f"ep=2 / ep=1 decode tokens/s: {ratio:.2f}x; written {args.out}", flush=True)


if __name__ == "__main__":
    main()
