"""Prefix caching and speculative decoding through `python -m hpcpipe.serve` (#39): TTFT and batch-1 tokens/s.

    python bench/bench_prefix.py [--prefix 1000] [--rounds 5] [--out bench/results/YYYY-MM-DD-prefix.json]

One float32 GPT with random weights and the 96-character tokenizer of bench_serve.py (one character = one
token; d_model 512, 8 heads, 4 blocks, seq_len 1280), one rank (pp = 1), KV blocks of 16.

* Prefix caching: per round a fresh random ``--prefix``-token text; a cold request (that prefix plus a
  question, max_tokens 1) then a warm one (the same prefix, another question). TTFT = request sent to the
  first streamed token at the client. Medians over the rounds, once with serve.prefix_cache = true and once
  false (there the second request is cold too). Goal (#39): warm <= 0.2 x cold.
* Speculation: one client (batch 1), greedy, a repetitive prompt (a code-like block repeated, as in an
  edit), max_tokens 200; tokens/s = the tokens after the first / the time from the first to the end (the
  decode rate, the prompt's prefill left out), median over the rounds, with serve.speculate = "ngram" (4 and
  8 tokens), "draft" (4 tokens; the draft: the model's embedding, first block, final norm and head, a
  layer-skip draft of 1 block in 4) and without; the acceptance rate from /metrics. A random model's greedy
  text often repeats itself, so prompt lookup has something to find; on a real model the rate depends on
  the task.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request

import numpy as np
from bench_schedules import dated_out, write_results
from bench_serve import CHARS, Server, write_model

SIZE = {"seq_len": 1280, "d_model": 512, "n_heads": 8, "n_blocks": 4}
CODE = ("def area(shape):\n    if shape.kind == 'circle':\n        return 3.14159 * shape.r * shape.r\n"
        "    return shape.w * shape.h\n")


def write_draft(path: str, size: dict, keep: int = 1, seed: int = 0) -> None:
    """A layer-skip draft of bench_serve.write_model's model: its embedding, first ``keep`` blocks, final norm and
    tied head (the same random draw: same seed), so the draft shares the tokenizer and often the choices."""
    from hpcpipe.nn.core.decoder_model import Decoder
    from hpcpipe.nn.gpt.model import GPTModel
    from hpcpipe.nn.gpt.shape import GPTShape
    from hpcpipe.state.weights import write_weights
    shape = GPTShape(vocab=len(CHARS), seq_len=size["seq_len"], d_model=size["d_model"], n_heads=size["n_heads"],
                     n_blocks=size["n_blocks"], tied=True)
    model = Decoder(GPTModel(shape), np, "float32", seed=seed)
    take = [0, *range(1, keep + 1), shape.n_groups - 1]
    groups = {j: {name: np.array(view) for name, view in model.params[i].items()} for j, i in enumerate(take)}
    config = {"kind": "gpt", "vocab_size": shape.vocab, "seq_len": shape.seq_len, "d_model": shape.d_model,
              "n_heads": shape.n_heads, "n_blocks": keep, "d_ff": 0, "tie_embeddings": True, "dtype": "float32"}
    write_weights(path, groups, n_layers=len(take), model_config=config,
                  attrs={"tokenizer": json.dumps({"kind": "chars", "chars": CHARS})})


def _post(url: str, body: dict) -> tuple[float, float, str]:
    """Stream one completion; (seconds to the first token, seconds to the end, its text)."""
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first, out = None, []
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            text = json.loads(line[6:])["choices"][0]["text"]
            if text and first is None:
                first = time.perf_counter() - t0
            out.append(text)
    return first or 0.0, time.perf_counter() - t0, "".join(out)


def _metric(url: str, name: str) -> float:
    for line in urllib.request.urlopen(url + "/metrics", timeout=10).read().decode().splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def prefix_point(weights: str, tmp: str, cache: bool, prefix: int, rounds: int) -> dict:
    """Median cold and warm TTFT (s) with or without prefix caching."""
    rng = np.random.default_rng(1)
    server = Server(1, weights, ["parallel.pp=1", "serve.kv_block=16", f"serve.prefix_cache={str(cache).lower()}"],
                    os.path.join(tmp, f"prefix-{cache}.log"))
    cold, warm = [], []
    try:
        _post(server.url, {"prompt": "warm up", "max_tokens": 1, "temperature": 0})
        for _ in range(rounds):
            text = "".join(CHARS[i] for i in rng.integers(0, len(CHARS) - 1, prefix))
            cold.append(_post(server.url, {"prompt": text + " first?", "max_tokens": 1, "temperature": 0})[0])
            warm.append(_post(server.url, {"prompt": text + " second?", "max_tokens": 1, "temperature": 0})[0])
        hit_rate = _metric(server.url, "hpcpipe_prefix_cache_hit_rate")
    finally:
        server.stop()
    return {"prefix_cache": cache, "cold_ttft_s": statistics.median(cold), "warm_ttft_s": statistics.median(warm),
            "warm_over_cold": statistics.median(warm) / statistics.median(cold), "hit_rate": hit_rate,
            "cold_all": cold, "warm_all": warm}


def speculation_point(weights: str, tmp: str, speculate: str, rounds: int, k: int = 4, draft: str = "") -> dict:
    """Median batch-1 tokens/s of a greedy request on a repetitive prompt, with or without speculation."""
    sets = ["parallel.pp=1", "serve.kv_block=16"] + ([f"serve.speculate={speculate}", f"serve.speculate_tokens={k}"]
                                                     if speculate else []) + ([f"serve.draft={draft}"] if draft else [])
    server = Server(1, weights, sets, os.path.join(tmp, f"spec-{speculate or 'off'}.log"))
    rates, texts = [], set()
    try:
        _post(server.url, {"prompt": "warm up", "max_tokens": 1, "temperature": 0})
        for _ in range(rounds):
            first, seconds, text = _post(server.url, {"prompt": CODE * 4, "max_tokens": 200, "temperature": 0})
            rates.append((len(text) - 1) / (seconds - first))        # one character = one token
            texts.add(text)
        acceptance = _metric(server.url, "hpcpipe_spec_acceptance_rate")
    finally:
        server.stop()
    return {"speculate": speculate or "off", "k": k if speculate else 0, "tokens_per_s": statistics.median(rates),
            "all": rates, "acceptance_rate": acceptance, "texts": sorted(texts)}


def main(argv: list[str] | None = None) -> int:
    """Write the model, run both benchmarks, print and save the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", type=int, default=1000, help="shared prefix tokens (default 1000)")
    parser.add_argument("--rounds", type=int, default=5, help="requests per point (default 5)")
    parser.add_argument("--out", default=None, help="results JSON (default bench/results/<today>-prefix.json)")
    args = parser.parse_args(argv)
    if not 16 <= args.prefix <= SIZE["seq_len"] - 32 or args.rounds < 1:
        parser.error(f"--prefix must be in 16..{SIZE['seq_len'] - 32} and --rounds >= 1")
    with tempfile.TemporaryDirectory() as tmp:
        weights = os.path.join(tmp, "bench.h5")
        config = write_model(weights, SIZE)
        prefix = [prefix_point(weights, tmp, cache, args.prefix, args.rounds) for cache in (True, False)]
        draft = os.path.join(tmp, "draft.h5")
        write_draft(draft, SIZE)
        spec = [speculation_point(weights, tmp, s, args.rounds, k, draft if s == "draft" else "")
                for s, k in (("", 0), ("ngram", 4), ("ngram", 8), ("draft", 4))]
    for p in prefix:
        print(f"prefix_cache={p['prefix_cache']!s:5}  cold TTFT {p['cold_ttft_s'] * 1e3:8.1f} ms  warm TTFT "
              f"{p['warm_ttft_s'] * 1e3:8.1f} ms  warm/cold {p['warm_over_cold']:.3f}  hit rate {p['hit_rate']:.3f}")
    for s in spec:
        print(f"speculate={s['speculate']:5} k={s['k']}  batch-1 {s['tokens_per_s']:7.1f} tokens/s  acceptance "
              f"{s['acceptance_rate']:.3f}")
    same = all(s["texts"] == spec[0]["texts"] and len(s["texts"]) == 1 for s in spec)
    print(f"every run's text equal to plain decoding's: {same}")
    for s in spec[1:]:
        print(f"{s['speculate']} k={s['k']} over plain: {s['tokens_per_s'] / spec[0]['tokens_per_s']:.2f}x")
    write_results(args.out or dated_out("prefix"), {"model": config, "prefix_tokens": args.prefix,
                                                     "rounds": args.rounds, "prefix": prefix, "speculation": spec})
    return 0


if __name__ == "__main__":
    sys.exit(main())
