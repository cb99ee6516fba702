"""The HTTP front end answers completions: the official openai client, raw server-sent events, lists of prompts,
sampling fields, concurrent clients, stop strings, partial UTF-8 and engine errors (scripted engine, no MPI)."""

from __future__ import annotations

import json
import re
import threading
import time

import numpy as np
import openai
import pytest
from http_harness import MODEL

from hpcpipe.serve.broker import Broker
from hpcpipe.serve.http_api import make_app
from hpcpipe.serve.metrics import Metrics
from hpcpipe.serve.sampling import SamplingParams
from hpcpipe.state.tokenizer import Tokenizer

# ---- the official openai client -------------------------------------------------------------------------

def test_openai_client_completes(served):
    s = served()
    r = s.client.completions.create(model=MODEL, prompt="hello", max_tokens=5)
    assert r.choices[0].text == "olleh" and r.choices[0].finish_reason == "length"
    assert r.choices[0].index == 0 and r.object == "text_completion" and r.model == MODEL
    assert r.id.startswith("cmpl-")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 5, 10)
    assert s.broker.outstanding == 0


def test_openai_client_streams(served):
    s = served()
    chunks = list(s.client.completions.create(model=MODEL, prompt="hello", max_tokens=7, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "ollehol"
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_raw_stream_is_server_sent_events_ending_in_done(served):
    s = served()
    status, headers, text = s.post({"prompt": "abc", "max_tokens": 3, "stream": True})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: {") for e in events[:-2])
    assert "".join(c["choices"][0]["text"] for c in chunks) == "cba"
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert {c["object"] for c in chunks} == {"text_completion"} and len({c["id"] for c in chunks}) == 1


def test_list_of_prompts_gives_one_choice_each_in_order(served):
    s = served()
    r = s.client.completions.create(model=MODEL, prompt=["abc", "wxyz"], max_tokens=4)
    assert [(c.index, c.text) for c in r.choices] == [(0, "cbac"), (1, "zyxw")]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (7, 8)
    texts = {0: "", 1: ""}
    stream = s.client.completions.create(model=MODEL, prompt=["abc", "wxyz"], max_tokens=4, stream=True,
                                         stream_options={"include_usage": True})
    usage = None
    for c in stream:
        for ch in c.choices:
            texts[ch.index] += ch.text
        usage = c.usage or usage
    assert texts == {0: "cbac", 1: "zyxw"} and usage.total_tokens == 15


def test_prompt_plus_max_tokens_may_fill_the_context_exactly(served):
    s = served(seq_len=64)
    r = s.client.completions.create(model=MODEL, prompt="x" * 54, max_tokens=10)
    assert r.usage.total_tokens == 64 and r.choices[0].finish_reason == "length"


def test_make_app_takes_a_numpy_seq_len(served):
    make_app(Broker(1), Metrics(), Tokenizer("bytes"), MODEL, np.int64(64))


def test_make_app_refuses_bad_limits_and_seq_len():
    for limits, words in (({"max_prompt": 3}, "unknown limit(s) ['max_prompt']"),
                          ({"max_prompts": 0}, "max_prompts must be an integer >= 1")):
        with pytest.raises(ValueError, match=re.escape(words)):
            make_app(Broker(1), Metrics(), Tokenizer("bytes"), MODEL, 64, limits)
    with pytest.raises(ValueError, match="seq_len must be an integer >= 2"):
        make_app(Broker(1), Metrics(), Tokenizer("bytes"), MODEL, 1)


def test_sampling_fields_reach_the_engine_and_unseeded_requests_differ(served):
    s = served()
    s.client.completions.create(model=MODEL, prompt="ab", max_tokens=1, temperature=0.5, top_p=0.9, seed=7,
                                extra_body={"top_k": 3})
    s.client.completions.create(model=MODEL, prompt="cd", max_tokens=1)
    s.client.completions.create(model=MODEL, prompt="ef", max_tokens=1)
    by_prompt = {bytes(r.prompt): r for r in s.engine.taken.values()}
    assert by_prompt[b"ab"].params == SamplingParams(temperature=0.5, top_k=3, top_p=0.9, seed=7)
    assert by_prompt[b"ab"].max_new == 1
    assert by_prompt[b"cd"].params.temperature == 1.0 and by_prompt[b"cd"].params.top_k == 0
    assert by_prompt[b"cd"].params.seed != by_prompt[b"ef"].params.seed


def test_models_and_health(served):
    s = served()
    assert [m.id for m in s.client.models.list().data] == [MODEL]
    status, _, body = s.request("GET", "/v1/models")
    assert body["data"][0]["owned_by"] == "hpcpipe" and body["object"] == "list"
    assert s.request("GET", "/health")[::2] == (200, {"status": "ok"})


def test_concurrent_clients_get_their_own_answers(served):
    s = served(step=0.002)
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]
    got, errors = {}, []

    def ask(w, stream):
        try:
            if stream:
                text = "".join(c.choices[0].text for c in s.client.completions.create(
                    model=MODEL, prompt=w, max_tokens=len(w), stream=True))
            else:
                text = s.client.completions.create(model=MODEL, prompt=w, max_tokens=len(w)).choices[0].text
            got[(w, stream)] = text
        except Exception as exc:          # noqa: BLE001 - reported below
            errors.append(exc)
    threads = [threading.Thread(target=ask, args=(w, k % 2 == 0)) for k, w in enumerate(words)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert errors == []
    assert got == {(w, k % 2 == 0): w[::-1] for k, w in enumerate(words)}


# ---- text: stop strings and partial UTF-8 ---------------------------------------------------------------

def test_stop_string_across_tokens_cuts_the_text_and_frees_the_engine_slot(served):
    s = served()
    r = s.client.completions.create(model=MODEL, prompt="dlrow olleh", max_tokens=40, stop=["zz", "lo w"])
    assert r.choices[0].text == "hel" and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 7                # "hello w": the token that completed the stop
    rid = r.id + "-0"
    deadline = time.monotonic() + 1.0
    while rid not in s.engine.cancelled and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rid in s.engine.cancelled and s.engine.generated[rid] < 40
    chunks = list(s.client.completions.create(model=MODEL, prompt="dlrow olleh", max_tokens=40, stop="lo w",
                                              stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "hel" and chunks[-1].choices[0].finish_reason == "stop"


def test_partial_utf8_is_never_streamed(served):
    s = served()
    s.engine.scripts[b"u"] = list("aé€😀".encode())
    chunks = list(s.client.completions.create(model=MODEL, prompt="u", max_tokens=10, stream=True))
    deltas = [c.choices[0].text for c in chunks if c.choices[0].text]
    assert deltas == ["a", "é", "€", "😀"]
    r = s.client.completions.create(model=MODEL, prompt="u", max_tokens=6, stop="€")
    assert r.choices[0].text == "aé" and r.choices[0].finish_reason == "stop"


def test_engine_error_is_a_500_or_an_error_event(served):
    s = served()
    s.engine.scripts[b"boom"] = ["error"]
    status, _, body = s.post({"prompt": "boom"})
    assert status == 500 and body["error"]["type"] == "server_error" and "engine failed" in body["error"]["message"]
    with pytest.raises(openai.APIError, match="engine failed"):
        list(s.client.completions.create(model=MODEL, prompt="boom", max_tokens=3, stream=True))
    s.engine.scripts[b"bad id"] = [300]                  # a buggy engine: a token outside the vocabulary
    status, _, body = s.post({"prompt": "bad id"})
    assert status == 500 and body["error"]["type"] == "server_error"
    status, _, body = s.post({"prompt": ["boom", "ab"], "max_tokens": 50})   # the sibling choice is cancelled
    assert status == 500
    sibling = next(i for i, r in list(s.engine.taken.items()) if bytes(r.prompt) == b"ab")
    deadline = time.monotonic() + 1.0
    while sibling not in s.engine.cancelled and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sibling in s.engine.cancelled and s.engine.generated[sibling] < 50
