"""A SmolLM2-135M-shaped Hugging Face model served by hpcpipe, by transformers and by llama.cpp's server on the
same cores: decode tokens/s at batch 1 and with 32 concurrent clients, and the time of a 512-token prefill.

    python bench/bench_real_models.py [--llama-server PATH] [--converter PATH] [--quick]
                                      [--clients32-only | --prefill-only] [--hpcpipe-set KEY=VALUE ...] [--out FILE]

The model is random (nothing can be downloaded here) but has SmolLM2-135M's shape: d 576, 30 blocks, 9 query
/ 3 key-value heads of 64, ff 1536, vocab 49152, tied embeddings, float32, RoPE theta 100000; its tokenizer
is a byte-level BPE (GPT-2's pre-tokenizer) trained on Debian's fortunes. Every engine runs on this machine's
cores with one BLAS thread per rank (hpcpipe), two threads (transformers, and llama.cpp for its two-thread
rows), the load from closed-loop HTTP clients in this process (non-streamed requests; tokens from each
response's usage). The goals (issue: real models): 32 concurrent clients at pp=2 at least llama.cpp's server
throughput; batch 1 at pp=1 at least 2x transformers; a 512-token prefill no slower than transformers.

llama.cpp is built once, outside CI, from the source of the ``llama-cpp-python`` package (its vendored
llama.cpp): ``cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF && cmake --build build --target llama-server``;
the model is converted to GGUF f32 with its ``convert_hf_to_gguf.py``, told that the tokenizer's pre-tokenizer
is GPT-2's (it is: its hash check knows only published tokenizers). Without --llama-server those rows are
skipped. Also measured: one core's memory bandwidth (a 256 MiB copy) and float32 GEMM rate, and from them the
least time a decode step can take (the weights a token reads over the bandwidth).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
GGUF_TYPES = {"float32": "f32", "stored": "bf16", "q8_0": "q8_0"}   # hpcpipe's weight format -> llama.cpp's
SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
             num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rope_theta=100000.0,
             tie_word_embeddings=True, rms_norm_eps=1e-5)
PROMPT_TOKENS, NEW_TOKENS, PREFILL = 32, 64, 512


def write_model(directory: Path, shape: dict | None = None, dtype: str = "float32") -> None:
    """A random model of the shape above (or ``shape``) saved in ``dtype`` and a byte-level BPE tokenizer."""
    import torch
    import transformers as T
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(**(shape or SHAPE), bos_token_id=0, eos_token_id=1)).eval()
    model.generation_config.eos_token_id = None      # every request generates its max_tokens
    model.to(getattr(torch, dtype)).save_pretrained(str(directory))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=8192, special_tokens=["<|endoftext|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_text().splitlines(), trainer)
    T.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                              eos_token="<|im_end|>").save_pretrained(str(directory))


def _text() -> str:
    folder = Path("/usr/share/games/fortunes")
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix not in (".dat", ".u8")) \
        if folder.is_dir() else []
    text = "".join(p.read_text(errors="replace") for p in files)
    return text or "the pipeline stage sends activations to the next rank over MPI. " * 4000


def prompts(directory: Path, n: int, length: int) -> list[str]:
    """n texts of exactly ``length`` tokens under the model's tokenizer, from different places of the corpus."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    ids = tok.encode(_text()[:2_000_000]).ids
    step = max(1, (len(ids) - length) // max(n, 1))
    return [tok.decode(ids[k * step:k * step + length]) for k in range(n)]


def machine_rates() -> dict:
    """One core's copy bandwidth (bytes/s) and the float32 2048^3 GEMM rate (FLOP/s, the BLAS's default threads:
    every core), best of a few."""
    a = np.ones(64 << 20, dtype=np.float32)
    b = np.empty_like(a)
    copy = min(_timed(lambda: np.copyto(b, a)) for _ in range(5))
    x = np.random.default_rng(0).standard_normal((2048, 2048), dtype=np.float32)
    gemm = min(_timed(lambda: x @ x) for _ in range(3))
    return {"copy_bytes_per_s": 2 * a.nbytes / copy, "gemm_flops": 2 * 2048 ** 3 / gemm}


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def transformers_rates(directory: Path, texts: list[str], long: str, quick: bool) -> dict:
    """tokens/s of greedy generate at batch 1 and 32 (two threads) and the seconds of a 512-token prefill."""
    import torch
    import transformers as T
    torch.set_num_threads(2)
    tok = T.AutoTokenizer.from_pretrained(str(directory), padding_side="left")
    tok.pad_token = tok.bos_token
    model = T.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    out = {}
    with torch.no_grad():
        for batch in (1, 32 if not quick else 4):
            enc = tok(texts[:batch], return_tensors="pt", padding=True)
            model.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
            t = time.perf_counter()
            model.generate(**enc, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                           pad_token_id=tok.pad_token_id)
            out[f"batch{batch}_tokens_per_s"] = batch * NEW_TOKENS / (time.perf_counter() - t)
        ids = tok(long, return_tensors="pt").input_ids
        model(ids)
        # as generate's prefill does: the logits of the last position only (the others would add a
        # (512, 576) x (576, 49152) product that no engine needs for the first token)
        out["prefill_512_s"] = min(_timed(lambda: model(ids, use_cache=True, logits_to_keep=1)) for _ in range(3))
    return out


async def _client(session, url: str, body: dict, texts: list[str], index: int, requests: int, tokens: list[int]):
    for k in range(requests):
        async with session.post(url, json={**body, "prompt": texts[(index + k) % len(texts)]}) as resp:
            doc = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"{url}: {resp.status} {doc}")
            tokens.append(doc["usage"]["completion_tokens"])


async def _load(base: str, texts: list[str], clients: int, requests: int, max_tokens: int) -> dict:
    import aiohttp
    body = {"max_tokens": max_tokens, "temperature": 0}    # no "model": each server serves one
    url = base + "/v1/completions"
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        await _client(session, url, body, texts, 0, 1, [])          # warm-up
        tokens: list[int] = []
        t = time.perf_counter()
        await asyncio.gather(*(_client(session, url, body, texts, i, requests, tokens) for i in range(clients)))
        seconds = time.perf_counter() - t
    return {"clients": clients, "requests": len(tokens), "tokens": sum(tokens), "seconds": seconds,
            "tokens_per_s": sum(tokens) / seconds}


def load(base: str, texts: list[str], clients: int, requests: int, max_tokens: int = NEW_TOKENS) -> dict:
    """Closed-loop load: ``clients`` concurrent clients, ``requests`` each; tokens from the responses' usage."""
    return asyncio.run(_load(base, texts, clients, requests, max_tokens))


def prefill_seconds(base: str, longs: list[str]) -> float:
    """Best of 3: the latency of a 512-token prompt with max_tokens = 1 (prefill, one token, HTTP).

    Every request sends a prompt not sent before: llama.cpp's server keeps a slot's prompt cached and
    would answer a repeated prompt without prefilling it (0.025 s for 512 tokens).
    """
    return asyncio.run(_prefills(base, longs))


async def _prefills(base: str, longs: list[str]) -> float:
    import aiohttp
    body = {"max_tokens": 1, "temperature": 0}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        await _client(session, base + "/v1/completions", body, longs[:1], 0, 1, [])     # warm-up
        best = float("inf")
        for text in longs[1:4]:
            t = time.perf_counter()
            await _client(session, base + "/v1/completions", body, [text], 0, 1, [])
            best = min(best, time.perf_counter() - t)
    return best


class Server:
    """A server process (its own session) until the block ends; waits for ``ready`` in its log."""

    def __init__(self, argv: list[str], ready: str, env: dict | None = None, log: str = "/tmp/bench-server.log"):
        self.log = Path(log)
        self._out = open(self.log, "w")
        self.proc = subprocess.Popen(argv, stdout=self._out, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, start_new_session=True)
        deadline = time.time() + 900
        while not re.search(ready, self.log.read_text()):
            if self.proc.poll() is not None or time.time() > deadline:
                raise SystemExit(f"{argv[0]} did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self._out.close()


def hpcpipe_rates(directory: Path, texts: list[str], longs: list[str], quick: bool, port: int,
                  weight_format: str = "float32", only: str = "", extra: tuple = ()) -> dict:
    """hpcpipe serve: batch 1 at pp=1, 32 clients at pp=2 (one BLAS thread per rank), 512-token prefills
    (``only``: "clients32", the 32 clients at pp=2 only; "prefill", the prefills only); ``extra``: more --set
    KEY=VALUE for every server."""
    out = {}
    base = f"http://127.0.0.1:{port}"
    env = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    common = ["--set", "model.seq_len=1024", "--set", "serve.max_sequences=32", "--set", "run.backend=\"numpy\"",
              "--set", f"model.weight_format=\"{weight_format}\""]
    common += [arg for setting in extra for arg in ("--set", setting)]
    for pp in (2,) if only == "clients32" else (1, 2):
        argv = ["mpiexec", "-n", str(pp), sys.executable, "-m", "hpcpipe.serve", "--weights", str(directory),
                "--port", str(port), "--set", f"parallel.pp={pp}", *common]
        with Server(argv, r"serving .* on http", env, f"/tmp/bench-hpcpipe-pp{pp}.log"):
            if not only:
                out[f"pp{pp}_batch1"] = load(base, texts, 1, 2 if quick else 4)
            if only != "prefill":
                out[f"pp{pp}_clients32"] = load(base, texts, 32 if not quick else 4, 1 if quick else 2)
            if only != "clients32":
                out[f"pp{pp}_prefill_512_s"] = prefill_seconds(base, longs)
    if only == "clients32":
        return out
    # the prefill with the pipeline tuned for it: 128-token chunks, and the blocks cut evenly (the default
    # cut counts the head's products for every row, as a decode step runs them; a prefill needs one row)
    argv += ["--set", "serve.prefill_tokens=128", "--set", "parallel.stage_layers=[16,16]"]
    with Server(argv, r"serving .* on http", env, "/tmp/bench-hpcpipe-pp2-prefill.log"):
        out["pp2_tuned_prefill_512_s"] = prefill_seconds(base, longs)
    return out


def convert_gguf(directory: Path, converter: Path, gguf: Path, outtype: str = "f32") -> None:
    """Convert the model to GGUF ``outtype`` with llama.cpp's converter, its pre-tokenizer check told 'gpt-2'."""
    code = (f"import sys; sys.path[:0] = [{str(converter.parent)!r}, {str(converter.parent / 'gguf-py')!r}]\n"
            "import conversion.base as b\n"
            "b.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'gpt-2'\n"
            f"sys.argv = ['convert', {str(directory)!r}, '--outtype', {outtype!r}, '--outfile', {str(gguf)!r}]\n"
            f"import runpy; runpy.run_path({str(converter)!r}, run_name='__main__')\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def llama_cpp_rates(server: Path, gguf: Path, texts: list[str], longs: list[str], quick: bool, port: int,
                    only: str = "") -> dict:
    """llama.cpp's server: batch 1 on one and two threads, 32 concurrent clients (32 slots) on two threads, the
    prefill on two threads (``only``: as hpcpipe_rates)."""
    out = {}
    base = f"http://127.0.0.1:{port}"
    layouts = {"clients32": ((2, 32),), "prefill": ((2, 1),)}.get(only, ((1, 1), (2, 1), (2, 32)))
    for threads, slots in layouts:
        argv = [str(server), "-m", str(gguf), "--port", str(port), "-t", str(threads), "-tb", str(threads),
                "-np", str(slots), "-c", str(1024 * slots), "--no-warmup"]
        with Server(argv, r"listening on http", None, f"/tmp/bench-llama-{threads}-{slots}.log"):
            clients = 1 if slots == 1 else (32 if not quick else 4)
            if only != "prefill":
                out[f"threads{threads}_clients{clients}"] = load(base, texts, clients, (2 if quick else 4)
                                                                 if clients == 1 else (1 if quick else 2))
            if slots == 1 and threads == 2:
                out["threads2_prefill_512_s"] = prefill_seconds(base, longs)
    return out


def main(argv: list[str] | None = None) -> int:
    """Run every engine, print the table and the goals, write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default="", help="default /tmp/hpcpipe-smollm2-shape (-bf16 for 16-bit formats)")
    ap.add_argument("--weight-format", choices=sorted(GGUF_TYPES), default="float32",
                    help="hpcpipe's model.weight_format and the GGUF type llama.cpp runs (f32, bf16, q8_0); "
                         "stored and q8_0 use a bfloat16 checkpoint")
    ap.add_argument("--skip-transformers", action="store_true", help="leave out the transformers rows")
    ap.add_argument("--llama-server", default="", help="llama.cpp's llama-server binary (skipped when absent)")
    ap.add_argument("--converter", default="", help="llama.cpp's convert_hf_to_gguf.py")
    ap.add_argument("--quick", action="store_true", help="fewer clients and requests (a smoke run)")
    ap.add_argument("--clients32-only", action="store_true",
                    help="only the 32 concurrent clients: hpcpipe pp=2 and llama-server 2 threads 32 slots")
    ap.add_argument("--prefill-only", action="store_true",
                    help="only the 512-token prefills: hpcpipe pp=1, pp=2 and pp=2 tuned; llama-server 2 threads")
    ap.add_argument("--hpcpipe-set", action="append", default=[], metavar="KEY=VALUE",
                    help="another --set for hpcpipe's servers (e.g. serve.micro_batches=4); repeatable")
    ap.add_argument("--port", type=int, default=8431)
    ap.add_argument("--out", default=str(HERE / "results" / f"{time.strftime('%Y-%m-%d')}-real-models.json"))
    args = ap.parse_args(argv)
    if args.clients32_only and args.prefill_only:
        ap.error("--clients32-only and --prefill-only measure different things: give one")
    only = "clients32" if args.clients32_only else "prefill" if args.prefill_only else ""
    half = args.weight_format != "float32"
    directory = Path(args.model_dir or "/tmp/hpcpipe-smollm2-shape" + ("-bf16" if half else ""))
    if not (directory / "config.json").exists():
        print(f"writing the random SmolLM2-135M-shaped model to {directory} ...", flush=True)
        write_model(directory, dtype="bfloat16" if half else "float32")
    texts, longs = prompts(directory, 64, PROMPT_TOKENS), prompts(directory, 4, PREFILL)
    res = {"command": " ".join(sys.argv), "weight_format": args.weight_format, "shape": SHAPE,
           "new_tokens": NEW_TOKENS, "prompt_tokens": PROMPT_TOKENS, "machine": machine_rates()}
    print(f"machine: one-core copy {res['machine']['copy_bytes_per_s'] / 1e9:.1f} GB/s, float32 GEMM "
          f"{res['machine']['gemm_flops'] / 1e9:.0f} GFLOP/s (all cores)", flush=True)
    res["load_before"] = os.getloadavg()[0]
    if not (args.skip_transformers or only):
        res["transformers"] = transformers_rates(directory, texts, longs[0], args.quick)
        print("transformers:", json.dumps(res["transformers"]), flush=True)
    res["hpcpipe_settings"] = args.hpcpipe_set
    res["hpcpipe_from"] = importlib.util.find_spec("hpcpipe").origin      # which checkout's code and kernels ran
    res["hpcpipe"] = hpcpipe_rates(directory, texts, longs, args.quick, args.port, args.weight_format,
                                   only, tuple(args.hpcpipe_set))
    print("hpcpipe:", json.dumps(res["hpcpipe"]), flush=True)
    if args.llama_server and args.converter:
        outtype = GGUF_TYPES[args.weight_format]
        gguf = directory / f"model-{outtype}.gguf"
        if not gguf.exists():
            convert_gguf(directory, Path(args.converter), gguf, outtype)
        res["llama_cpp"] = llama_cpp_rates(Path(args.llama_server), gguf, texts, longs, args.quick, args.port,
                                           only)
        print("llama.cpp:", json.dumps(res["llama_cpp"]), flush=True)
    res["load_after"] = os.getloadavg()[0]
    report(res)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


def report(res: dict) -> None:
    """Print the comparison and the three goals."""
    tf, hp, lc = res.get("transformers", {}), res["hpcpipe"], res.get("llama_cpp", {})
    nan = float("nan")
    per_weight = {"float32": 4, "stored": 2, "q8_0": 34 / 32}[res.get("weight_format", "float32")]
    weights = (SHAPE["num_hidden_layers"] * (SHAPE["hidden_size"] * 64 * (9 + 3 + 3 + 9) +
                                             3 * SHAPE["hidden_size"] * SHAPE["intermediate_size"])
               + SHAPE["vocab_size"] * SHAPE["hidden_size"]) * per_weight
    floor = weights / res["machine"]["copy_bytes_per_s"]     # every weight read once per token, at a copy's rate
    print(f"\nweights read per decoded token: {weights / 2**20:.0f} MiB -> at least {floor * 1e3:.1f} ms on one core "
          f"({1 / floor:.0f} tokens/s) at this machine's copy bandwidth")
    rows = [("transformers, batch 1 (2 threads)", tf.get("batch1_tokens_per_s", nan)),
            ("transformers, 32 prompts batched", tf.get("batch32_tokens_per_s", nan)),
            *((f"hpcpipe pp={key[2]}, {'batch 1' if key.endswith('batch1') else '32 clients'}",
               hp[key]["tokens_per_s"]) for key in ("pp1_batch1", "pp2_batch1", "pp1_clients32", "pp2_clients32")
              if key in hp)]
    rows += [(f"llama.cpp, {k}", v["tokens_per_s"]) for k, v in lc.items() if isinstance(v, dict)]
    for name, rate in rows:
        print(f"  {name:<40} {rate:8.1f} tokens/s")
    goals, best_prefill = [], nan
    if "pp1_prefill_512_s" in hp:          # not with --clients32-only
        llama_prefill = f", llama.cpp (2 threads) {lc['threads2_prefill_512_s']:.3f} s" \
            if "threads2_prefill_512_s" in lc else ""
        print(f"  prefill 512: transformers {tf.get('prefill_512_s', nan):.3f} s, "
              f"hpcpipe pp=1 {hp['pp1_prefill_512_s']:.3f} s, "
              f"pp=2 {hp['pp2_prefill_512_s']:.3f} s (tuned: {hp['pp2_tuned_prefill_512_s']:.3f} s){llama_prefill}")
        best_prefill = min(hp["pp1_prefill_512_s"], hp["pp2_prefill_512_s"], hp["pp2_tuned_prefill_512_s"])
    if tf:
        goals += [("batch 1 at pp=1 >= 2x transformers", hp["pp1_batch1"]["tokens_per_s"] / tf["batch1_tokens_per_s"],
                   2.0), ("prefill 512 no slower than transformers (best layout)", tf["prefill_512_s"] / best_prefill,
                          1.0)]
    if "threads2_prefill_512_s" in lc:
        goals.append(("prefill 512 (best layout) no slower than llama.cpp 2 threads",
                      lc["threads2_prefill_512_s"] / best_prefill, 1.0))
    concurrent = [v["tokens_per_s"] for k, v in lc.items() if isinstance(v, dict) and "clients32" in k]
    if concurrent:
        goals.append(("32 clients at pp=2 >= llama.cpp server", hp["pp2_clients32"]["tokens_per_s"] / concurrent[0],
                      1.0))
    for name, ratio, need in goals:
        print(f"  goal: {name}: {ratio:.2f}x ({'met' if ratio >= need else 'NOT met'})")
    res["goals"] = [{"goal": n, "ratio": r, "met": r >= need} for n, r, need in goals]


if __name__ == "__main__":
    sys.exit(main())
