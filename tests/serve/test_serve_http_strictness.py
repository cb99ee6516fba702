"""The HTTP front end misreads no request and no request ends the server (issue 32): unknown fields, models and
encodings, logprobs, resets mid-body, failures mid-stream, /health when stalled or starting."""

from __future__ import annotations

import http.client
import json
import socket
import time

import openai
import pytest
from http_harness import MODEL, Served

from hpcpipe.serve.broker import Broker, Request
from hpcpipe.serve.http_api import HttpServer, make_app
from hpcpipe.serve.metrics import Metrics
from hpcpipe.serve.sampling import SamplingParams
from hpcpipe.state.tokenizer import Tokenizer

# ---- issue 32: no request is silently misread, none ends the server -------------------------------------

def _chat(s: Served, body: dict):
    return s.request("POST", "/v1/chat/completions", body)


def test_an_unknown_field_is_a_400_naming_it_on_both_endpoints(served):
    s = served()
    status, _, body = s.post({"prompt": "hi", "max_token": 3})          # was: ignored, 16 tokens generated
    assert status == 400 and body["error"]["param"] == "max_token", body
    assert body["error"]["message"].startswith("unknown field 'max_token': did you mean 'max_tokens'?"), body
    status, _, chat = _chat(s, {"messages": [{"role": "user", "content": "hi"}], "max_token": 3})
    assert status == 400 and chat["error"]["param"] == "max_token", chat
    assert chat["error"]["message"].startswith("unknown field 'max_token': did you mean 'max_tokens'?"), chat
    status, _, body = s.post({"prompt": "hi", "frobnicate": True})
    assert status == 400 and "unknown field 'frobnicate'" in body["error"]["message"]
    assert s.engine.taken == {} and s.broker.outstanding == 0


def test_what_the_openai_client_sends_on_its_own_is_accepted(served):
    s = served()
    done = s.client.completions.create(model=MODEL, prompt="ab", max_tokens=2, n=1, echo=False, best_of=1,
                                       presence_penalty=0, frequency_penalty=0, logit_bias={}, suffix="",
                                       user="u-1", seed=3, stop=["zz"], extra_body={"top_k": 3})
    assert done.choices[0].text == "ba"
    chunks = list(s.client.completions.create(model=MODEL, prompt="ab", max_tokens=2, stream=True,
                                              stream_options={"include_usage": True}))
    assert chunks[-1].usage.total_tokens == 4
    for stream in (False, True):       # past the field checks: this bytes model has no chat template
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            s.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=2, temperature=0, top_p=1, seed=1, user="u-1",
                                             stream=stream, extra_body={"top_k": 3})


def test_a_model_the_server_does_not_serve_is_a_404_model_not_found(served):
    s = served()
    with pytest.raises(openai.NotFoundError, match="gpt-4o"):
        s.client.completions.create(model="gpt-4o", prompt="ab", max_tokens=1)   # was: answered by tiny-gpt
    for status, _, body in (s.post({"prompt": "ab", "model": "gpt-4o"}),
                            _chat(s, {"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4o"})):
        assert status == 404, body
        assert body["error"]["code"] == "model_not_found" and body["error"]["type"] == "invalid_request_error"
        assert "`gpt-4o` does not exist" in body["error"]["message"] and f"`{MODEL}`" in body["error"]["message"]
    status, _, body = s.post({"prompt": "ab", "model": 5})
    assert status == 400 and body["error"]["param"] == "model"
    assert s.post({"prompt": "ab", "max_tokens": 1, "model": MODEL})[0] == 200          # the served name
    assert s.post({"prompt": "ab", "max_tokens": 1})[0] == 200                          # or none (curl)
    assert s.engine.taken and all(bytes(r.prompt) == b"ab" for r in s.engine.taken.values())
    assert s.scrape()[("hpcpipe_requests_total", 'status="404"')] == 3


@pytest.mark.parametrize("value", [0, 1, 5, True])
def test_logprobs_are_refused_for_a_bytes_tokenizer_which_has_no_text_per_token(served, value):
    s = served(engine=False)
    status, _, body = s.post({"prompt": "hi", "logprobs": value})     # 0 was accepted and answered null
    assert status == 400 and body["error"]["param"] == "logprobs"
    want = "logprobs must be an integer in [0, 20], got True" if value is True else \
        "its bytes tokenizer has no text per token"
    assert want in body["error"]["message"], body


def test_a_body_in_an_unknown_content_encoding_is_a_400_naming_it(served):
    import gzip

    s = served()
    status, _, body = s.request("POST", "/v1/completions", raw=b'{"prompt": "hi", "max_tokens": 1}',
                                headers={"Content-Encoding": "bogus"})       # was: read as plain JSON, 200
    assert status == 400 and "Content-Encoding 'bogus'" in body["error"]["message"], body
    assert s.engine.taken == {}
    status, _, body = s.request("POST", "/v1/completions", raw=gzip.compress(b'{"prompt": "hi", "max_tokens": 1}'),
                                headers={"Content-Encoding": "gzip"})
    assert status == 200 and body["choices"][0]["text"] == "i"
    status, _, body = s.request("POST", "/v1/completions", raw=b'{"prompt": "hi", "max_tokens": 1}',
                                headers={"Content-Encoding": "identity"})
    assert status == 200


def test_a_client_that_resets_mid_body_is_a_499_and_one_quiet_line(served, capfd):
    import struct

    s = served(engine=False)
    for _ in range(6):
        sock = socket.create_connection(("127.0.0.1", s.port), timeout=5)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"prompt\"")
        time.sleep(0.05)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))    # close with a RST
        sock.close()
    deadline = time.monotonic() + 5
    while s.scrape().get(("hpcpipe_requests_total", 'status="499"'), 0) < 6 and time.monotonic() < deadline:
        time.sleep(0.05)
    m = s.scrape()
    assert m.get(("hpcpipe_requests_total", 'status="499"')) == 6, m      # was: 500
    assert ("hpcpipe_requests_total", 'status="500"') not in m
    err = capfd.readouterr().err
    assert "Traceback" not in err, err                                    # was: ~2 KB of traceback each
    assert len([line for line in err.splitlines() if line.strip()]) <= 1, err


def test_an_unforeseen_failure_mid_stream_ends_that_stream_with_an_error_event(served, monkeypatch, capfd):
    from hpcpipe.serve import responses

    real = responses.TextShape.chunk

    def chunk(self, head, index, text, finish, *rest):
        if "!" in text:
            raise KeyError("a bug")
        return real(self, head, index, text, finish, *rest)
    monkeypatch.setattr(responses.TextShape, "chunk", chunk)
    s = served()
    s.engine.scripts[b"bang"] = list(b"ab!cd")
    status, _, text = s.post({"prompt": "bang", "max_tokens": 5, "stream": True})
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
    assert status == 200 and "[DONE]" not in events, text
    last = json.loads(events[-1])
    assert last["error"]["type"] == "server_error" and "KeyError" in last["error"]["message"], last
    assert s.client.completions.create(model=MODEL, prompt="hello", max_tokens=5).choices[0].text == "olleh"
    assert "hpcpipe: [http] error: POST /v1/completions failed" in capfd.readouterr().err


def test_health_is_503_when_pending_work_has_not_moved_for_a_quarter_of_the_stall_timeout(served):
    s = served(engine=False, stall_timeout=2.0)
    assert s.request("GET", "/health")[::2] == (200, {"status": "ok"})
    time.sleep(0.7)                                     # idle for longer than a quarter: still healthy
    assert s.request("GET", "/health")[::2] == (200, {"status": "ok"})
    s.broker.progressed()
    s.broker.submit([Request("held", [1], 1, SamplingParams(), time.monotonic())], lambda e: None)
    t0 = time.monotonic()
    assert s.request("GET", "/health")[0] == 200        # pending, but not for long yet
    status, body = 200, None
    while status == 200 and time.monotonic() - t0 < 3:
        status, _, body = s.request("GET", "/health")
        time.sleep(0.02)
    assert status == 503 and 0.45 < time.monotonic() - t0 < 1.5, (status, body)
    assert body["status"] == "stalled" and "1 request(s) pending" in body["reason"], body
    assert "run.stall_timeout = 2 s" in body["reason"], body
    s.broker.progressed()                               # the engine stepped again
    assert s.request("GET", "/health")[::2] == (200, {"status": "ok"})


def test_health_says_starting_until_the_engine_serves():
    """/health said ok before the "serving" line: the port is bound before the stages load."""
    broker = Broker(4, ready=False)
    server = HttpServer(make_app(broker, Metrics(), Tokenizer("bytes"), MODEL, 64), "127.0.0.1", 0)
    port = server.start()[1]

    def health():
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/health")
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    try:
        assert health() == (503, {"status": "starting"})
        broker.set_ready()
        assert health() == (200, {"status": "ok"})
    finally:
        server.stop(2.0)
