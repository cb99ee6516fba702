"""Does tokenizing large prompts stall the HTTP front end? /health latency and a 2-token completion beside ten 1 MB
prompts.

    python bench/bench_prompt_load.py [--prompts 10] [--chars 1000000] [--out FILE.json]

A real server (hpcpipe.serve.http_api on 127.0.0.1) with a stand-in engine (one token per request per step, no
MPI) and a byte-level BPE of 300 tokens trained here (nothing downloaded). ``--prompts`` clients each send one
completion whose prompt is ``--chars`` characters of words (the model's context is 4096 tokens: each is answered
400 once tokenized); /health is polled every 50 ms from their start to their end, and 0.5 s after them a
2-token completion is sent. Prints and writes (--out) the /health latencies (median, p90, max), the 2-token
completion's latency and how many large answers had come before it, and the large batch's duration. Runs
against whatever hpcpipe is importable (compare the code before and after issue 40 with PYTHONPATH).
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import threading
import time

WORDS = "the quick brown fox jumps over lazy dog pipeline stage rank tensor shard model token stream".split()


def tokenizer():
    """A byte-level BPE (GPT-2 style) of 300 tokens as a Hugging Face tokenizer hpcpipe reads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from hpcpipe.hf.tokenizer import from_files
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))] * 20, trainer)
    config = {"eos_token": "<|endoftext|>"}
    return from_files({"tokenizer.json": tok.to_str().encode(), "tokenizer_config.json": json.dumps(config).encode()})


class Engine:
    """One token (the prompt's first id) per live request per 2 ms step."""

    def __init__(self, broker):
        from hpcpipe.serve.broker import Event
        self.broker, self.Event, self.stop = broker, Event, threading.Event()
        threading.Thread(target=self.run, daemon=True).start()

    def run(self) -> None:
        """Step until stopped."""
        live = {}
        while not self.stop.is_set():
            new, cancelled = self.broker.take()
            live.update({r.id: [r, 0] for r in new})
            for i in cancelled:
                live.pop(i, None)
            events = []
            for rid, st in list(live.items()):
                st[1] += 1
                done = st[1] == st[0].max_new
                events.append(self.Event(rid, [st[0].prompt[0]], "length" if done else None))
                if done:
                    del live[rid]
            self.broker.deliver(events)
            self.broker.set_running(len(live))
            time.sleep(0.002)


def call(port: int, method: str, path: str, body=None, timeout: float = 600) -> tuple[int, float]:
    """(status, seconds) of one request."""
    start = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request(method, path, body=None if body is None else json.dumps(body).encode(),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    resp.read()
    conn.close()
    return resp.status, time.perf_counter() - start


def measure(prompts: int, chars: int) -> dict:
    """Run the load once; return the numbers."""
    from hpcpipe.serve.broker import Broker
    from hpcpipe.serve.http_api import HttpServer, make_app
    from hpcpipe.serve.metrics import Metrics
    broker = Broker(64)
    engine = Engine(broker)
    tok = tokenizer()
    try:       # after issue 40: the workers started as serve starts them, a budget no request here passes
        from hpcpipe.serve.prompt_pool import PromptPool
        pool = PromptPool(tok, seconds=600)
        pool.start()
        app = make_app(broker, Metrics(), tok, "bench", 4096, prompts=pool)
    except ImportError:                      # before issue 40: tokenized on the event loop
        pool, app = None, make_app(broker, Metrics(), tok, "bench", 4096)
    server = HttpServer(app, "127.0.0.1", 0)
    port = server.start()[1]
    text = " ".join(WORDS[i % len(WORDS)] for i in range(chars // 4))[:chars]
    start = time.perf_counter()
    tok.encode(text)
    encode_s = time.perf_counter() - start
    large, health, small, done = [], [], [], threading.Event()

    def send() -> None:
        large.append(call(port, "POST", "/v1/completions", {"prompt": text, "max_tokens": 2}))

    def probe() -> None:
        while not done.is_set():
            health.append(call(port, "GET", "/health")[1])
            time.sleep(0.05)
    threads = [threading.Thread(target=send) for _ in range(prompts)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    prober = threading.Thread(target=probe)
    prober.start()
    time.sleep(0.5)
    status, seconds = call(port, "POST", "/v1/completions", {"prompt": "hello", "max_tokens": 2})
    small.append((status, seconds, len(large)))
    for t in threads:
        t.join()
    batch_s = time.perf_counter() - t0
    done.set()
    prober.join()
    server.stop(2.0)
    if pool is not None:
        pool.close()
    engine.stop.set()
    health.sort()
    return {"prompts": prompts, "chars": chars, "encode_one_s": round(encode_s, 3),
            "health_s": {"n": len(health), "median": round(statistics.median(health), 4),
                         "p90": round(health[int(0.9 * (len(health) - 1))], 4), "max": round(health[-1], 4)},
            "small_completion": {"status": small[0][0], "seconds": round(small[0][1], 3),
                                 "large_answered_before": small[0][2]},
            "large_statuses": sorted({s for s, _ in large}), "large_batch_s": round(batch_s, 2)}


def main() -> None:
    """Parse the arguments, measure, print and write the result."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--chars", type=int, default=1_000_000)
    parser.add_argument("--out", help="write the result as JSON")
    args = parser.parse_args()
    result = measure(args.prompts, args.chars)
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
