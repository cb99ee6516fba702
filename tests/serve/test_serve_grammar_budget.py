"""A response_format whose grammar takes long to compile (llguidance's time grows faster than the schema) is refused
within limits["grammar_ms"] and never stalls the HTTP event loop (the real front end; its engine is the test
harness's scripted one: the refusal happens before a request reaches any engine)."""

from __future__ import annotations

import threading
import time

from hpcpipe.serve.grammar import _base_matcher, compile_format
from hpcpipe.state.tokenizer import Tokenizer

# 4,000 optional properties: about 3 s to compile on the 2-core VM (1,000: 0.2 s), never near 0.3 s
BIG = {"type": "json_schema", "json_schema": {"name": "big", "schema": {
    "type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(4000)}}}}
SMALL = {"type": "json_schema", "json_schema": {"name": "small", "schema": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}


def test_a_schema_that_compiles_too_long_is_a_400_and_the_loop_keeps_answering(served):
    s = served(limits={"grammar_ms": 300}, seq_len=512)
    health: list[float] = []
    stop = threading.Event()

    def probe():
        while not stop.is_set():
            started = time.monotonic()
            assert s.request("GET", "/health")[0] == 200
            health.append(time.monotonic() - started)
            time.sleep(0.02)
    prober = threading.Thread(target=probe)
    prober.start()
    try:
        status, _, body = s.post({"prompt": "x", "max_tokens": 8, "response_format": BIG})
    finally:
        stop.set()
        prober.join(30)
    # was: compiled on the event loop (twice), every client waiting seconds, then again on the last stage
    assert status == 400 and body["error"]["param"] == "response_format", body
    assert body["error"]["message"].startswith("response_format: the schema did not compile within 0.3 s"), body
    assert health, "the event loop answered no /health while the schema compiled"
    status, _, body = s.post({"prompt": "x", "max_tokens": 8, "response_format": SMALL})
    assert status == 200, body
    assert s.engine.taken and all(r.params.grammar for r in s.engine.taken.values())


def test_the_last_stage_compiles_a_grammar_once_for_every_sequence_that_follows_it():
    tok = Tokenizer("bytes")
    grammar = compile_format(SMALL, tok)
    assert _base_matcher(grammar, tok) is _base_matcher(grammar, tok)     # n choices, or requests with one schema


def test_a_schema_waiting_for_busy_compilers_past_its_limit_is_a_429_with_retry_after(served):
    s = served(limits={"grammar_ms": 300}, seq_len=512)
    busy = [threading.Thread(target=s.post, args=({"prompt": "x", "max_tokens": 8, "response_format": BIG},))
            for _ in range(2)]
    for t in busy:
        t.start()
    deadline = time.monotonic() + 30             # both compilers now run a 4,000-property schema for seconds
    while sum(t.name == "hpcpipe-grammar" for t in threading.enumerate()) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    status, headers, body = s.post({"prompt": "x", "max_tokens": 8, "response_format": SMALL})
    for t in busy:
        t.join(30)
    assert status == 429 and body["error"]["code"] == "rate_limit_exceeded", body
    assert headers["Retry-After"] == "1"         # was: a 429 without it (the prompt workers' 429 too)
