"""The HTTP front end refuses bad requests with an OpenAI error body: every bad field a 400 naming it, unknown
paths, huge, broken, slow and trickling bodies, a failing handler (500), a full broker (429), draining (503)."""

from __future__ import annotations

import socket
import time

import openai
import pytest
from http_harness import MODEL

from hpcpipe.serve.broker import Request
from hpcpipe.serve.sampling import SamplingParams
from hpcpipe.state.tokenizer import chars_tokenizer

# ---- bad input ------------------------------------------------------------------------------------------

BAD = [
    (None, b"{", "not valid JSON", None),
    (None, b"\xff\xfe", "not valid JSON", None),
    ([1], None, "JSON object", None),
    ({"max_tokens": 3}, None, "prompt is missing", "prompt"),
    ({"prompt": 5}, None, "must be a string or a list of strings", "prompt"),
    ({"prompt": []}, None, "empty list", "prompt"),
    ({"prompt": [1, 2, 256]}, None, "prompt[2] must be a token id in [0, 256)", "prompt"),
    ({"prompt": [[1, 2], [3, -1]]}, None, "prompt[1][1] must be a token id in [0, 256)", "prompt"),
    ({"prompt": [[1, 2], []]}, None, "prompt[1] is empty", "prompt"),
    ({"prompt": [[1, 2], "ab"]}, None, "prompt[1] must be a list of token ids like prompt[0]", "prompt"),
    ({"prompt": [{"a": 1}]}, None, "prompt[0] must be a string, a token id or a list of token ids", "prompt"),
    ({"prompt": [[1]] * 33}, None, "prompt has 33 token-id lists; at most 32 per request", "prompt"),
    ({"prompt": ["a", 3]}, None, "prompt[1] must be a string", "prompt"),
    ({"prompt": ""}, None, "prompt is empty", "prompt"),
    ({"prompt": ["ok", ""]}, None, "prompt[1] is empty", "prompt"),
    ({"prompt": "hi", "max_tokens": 0}, None, "max_tokens must be an integer >= 1, got 0", "max_tokens"),
    ({"prompt": "hi", "max_tokens": -2}, None, "max_tokens must be an integer >= 1", "max_tokens"),
    ({"prompt": "hi", "max_tokens": "5"}, None, "max_tokens must be an integer >= 1", "max_tokens"),
    ({"prompt": "hi", "max_tokens": 1.5}, None, "max_tokens must be an integer >= 1", "max_tokens"),
    ({"prompt": "x" * 60, "max_tokens": 10}, None, "60 + 10 = 70 exceeds the model's context length of 64",
     "max_tokens"),
    ({"prompt": "hi", "temperature": -0.1}, None, "temperature must be a number in [0, 2]", "temperature"),
    ({"prompt": "hi", "temperature": 2.5}, None, "temperature must be a number in [0, 2]", "temperature"),
    ({"prompt": "hi", "temperature": "hot"}, None, "temperature must be a number", "temperature"),
    ({"prompt": "hi", "top_p": 0}, None, "top_p must be a number in (0, 1]", "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, None, "top_p must be a number in (0, 1]", "top_p"),
    ({"prompt": "hi", "top_k": -2}, None, "top_k must be an integer in [0, 256]", "top_k"),   # -1: off
    ({"prompt": "hi", "top_k": 257}, None, "top_k must be an integer in [0, 256]", "top_k"),
    ({"prompt": "hi", "top_k": 2.5}, None, "top_k must be an integer", "top_k"),
    ({"prompt": "hi", "n": 0}, None, "n must be an integer in [1, 32], got 0", "n"),
    ({"prompt": "hi", "n": 33}, None, "n must be an integer in [1, 32], got 33", "n"),
    ({"prompt": ["a", "b", "c"], "n": 11}, None, "n = 11 choices for each of 3 prompts makes 33 sequences", "n"),
    ({"prompt": "hi", "max_tokens": 0, "echo": False}, None, "max_tokens must be an integer >= 1, got 0", "max_tokens"),
    ({"prompt": "hi", "response_format": {"type": "yaml"}}, None, "response_format.type must be", "response_format"),
    ({"prompt": "hi", "response_format": "json"}, None, "response_format must be an object", "response_format"),
    ({"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "strin"}}}}, None, "the JSON schema is refused by llguidance: Invalid type: strin", "response_format"),
    ({"prompt": "hi", "seed": -1}, None, "seed must be an integer", "seed"),
    ({"prompt": "hi", "seed": "abc"}, None, "seed must be an integer", "seed"),
    ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, None, "stop has 5 strings; at most 4", "stop"),
    ({"prompt": "hi", "stop": [""]}, None, "stop strings must not be empty", "stop"),
    ({"prompt": "hi", "stop": 3}, None, "stop must be a string or a list of strings", "stop"),
    ({"prompt": "hi", "stream": "yes"}, None, "stream must be true or false", "stream"),
    ({"prompt": "hi", "echo": "yes"}, None, "echo must be true or false", "echo"),
    ({"prompt": "hi", "logprobs": 2}, None, "its bytes tokenizer has no text per token", "logprobs"),
    ({"prompt": "hi", "logprobs": 21}, None, "logprobs is 21 but at most 20 alternatives per token", "logprobs"),
    ({"prompt": "hi", "logprobs": -1}, None, "logprobs must be an integer in [0, 20], got -1", "logprobs"),
    ({"prompt": "hi", "best_of": 3}, None, "best_of is not supported", "best_of"),
    ({"prompt": ["a"] * 33}, None, "prompt has 33 strings; at most 32 per request", "prompt"),
    ({"prompt": "hi", "stream": True, "stream_options": 1}, None, "stream_options must be an object",
     "stream_options"),
    # as OpenAI's API and vLLM: options of a stream on a request that does not stream (was ignored)
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, None,
     "stream_options is only allowed when stream is true", "stream_options"),
]


def test_every_bad_input_is_a_400_with_an_openai_error_body(served):
    s = served(engine=False)
    for body, raw, words, param in BAD:
        status, _, got = s.post(body, raw)
        assert status == 400, (body, raw, got)
        err = got["error"]
        assert words in err["message"], (body, err)
        assert err["type"] == "invalid_request_error" and err["param"] == param and "code" in err
    assert s.broker.outstanding == 0
    assert s.scrape()[("hpcpipe_requests_total", 'status="400"')] == len(BAD)


def test_openai_client_sees_the_400_message(served):
    s = served(engine=False)
    with pytest.raises(openai.BadRequestError, match="exceeds the model's context length of 64"):
        s.client.completions.create(model=MODEL, prompt="x" * 60, max_tokens=10)


def test_prompt_the_tokenizer_cannot_encode_names_the_character_and_position(served):
    s = served(engine=False, tokenizer=chars_tokenizer("helo "))
    status, _, body = s.post({"prompt": "hello wörld"})
    assert status == 400
    msg = body["error"]["message"]
    assert msg.startswith("prompt cannot be encoded") and "'w'" in msg and "position 6" in msg
    status, _, body = s.post({"prompt": ["hello", "hé"]})
    assert status == 400 and "prompt[1] cannot be encoded" in body["error"]["message"]
    assert "'é'" in body["error"]["message"] and "position 1" in body["error"]["message"]


def test_unknown_path_wrong_method_and_huge_body_answer_json(served):
    s = served(engine=False, limits={"max_body_bytes": 1000})
    status, _, body = s.request("GET", "/v1/nothing")
    assert status == 404 and "no such endpoint: GET /v1/nothing" in body["error"]["message"]
    status, _, body = s.request("GET", "/v1/completions")
    assert status == 405 and "not allowed" in body["error"]["message"]
    status, _, body = s.post({"prompt": "x" * 2000})
    assert status == 413 and "larger than 1000 bytes" in body["error"]["message"]


def test_bodies_that_break_the_parser_or_the_decoder_are_400_not_500(served):
    s = served(engine=False)
    status, _, body = s.post(raw=b'{"prompt": ' + b"[" * 100_000)       # recursion in json, under the size limit
    assert status == 400 and "nested too deeply" in body["error"]["message"]
    status, _, body = s.request("POST", "/v1/completions", raw=b'{"prompt": "hi"}',
                                headers={"Content-Encoding": "gzip"})     # a body that is not what it says
    assert status == 400 and body["error"]["message"].startswith("the request body cannot be read")
    status, _, body = s.post(raw=b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}")
    assert status == 400 and "an integer of more than 4300 digits" in body["error"]["message"]
    assert "sys." not in body["error"]["message"]
    assert s.scrape()[("hpcpipe_requests_total", 'status="400"')] == 3


def test_a_body_that_never_arrives_is_a_408_and_frees_the_connection(served, monkeypatch):
    from hpcpipe.serve import http_api

    monkeypatch.setattr(http_api, "BODY_TIMEOUT_S", 0.5)
    s = served(engine=False)
    with socket.create_connection(("127.0.0.1", s.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\"")          # 10 of the 100 bytes announced
        t0 = time.monotonic()
        answer = sock.recv(65536).decode()
    assert answer.startswith("HTTP/1.1 408") and "did not arrive within 0.5 s" in answer
    assert time.monotonic() - t0 < 5
    assert s.scrape()[("hpcpipe_requests_total", 'status="408"')] == 1


def test_headers_that_trickle_in_past_the_deadline_lose_the_connection(served, monkeypatch):
    """A slowloris: a header line every 0.2 s never ends the headers; the server closes it at the deadline."""
    from hpcpipe.serve import http_api

    monkeypatch.setattr(http_api, "HEADER_TIMEOUT_S", 1.0)
    s = served(engine=False)
    t0 = time.monotonic()
    closed_after = None
    with socket.create_connection(("127.0.0.1", s.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        try:
            for i in range(50):                                 # 10 s of trickle if nobody stops it
                time.sleep(0.2)
                sock.sendall(b"X-Slow-%d: y\r\n" % i)
        except OSError:                                         # reset or broken pipe: closed by the server
            closed_after = time.monotonic() - t0
        if closed_after is None:
            sock.settimeout(5)
            assert sock.recv(65536) == b"", "the trickling connection was still open after 10 s"
            closed_after = time.monotonic() - t0
    assert 0.9 < closed_after < 5, closed_after
    status, _, body = s.request("GET", "/health")               # the server itself carries on
    assert status == 200, body


def test_an_unexpected_failure_is_a_json_500_and_counted(served, monkeypatch, capfd):
    from hpcpipe.serve import http_api

    def broken(*args):
        raise KeyError("a bug")
    monkeypatch.setattr(http_api, "check_completion", broken)
    s = served(engine=False)
    status, _, body = s.post({"prompt": "hi", "max_tokens": 1})
    assert status == 500 and body["error"]["type"] == "server_error" and "KeyError" in body["error"]["message"]
    assert s.scrape()[("hpcpipe_requests_total", 'status="500"')] == 1
    assert "hpcpipe: [http] error: POST /v1/completions failed: KeyError" in capfd.readouterr().err


def test_full_broker_is_429_all_or_none(served):
    s = served(engine=False, capacity=2)
    s.broker.submit([Request("held", [1], 1, SamplingParams(), 0.0)], lambda e: None)
    status, headers, body = s.post({"prompt": ["a", "b"], "max_tokens": 1})
    assert status == 429 and body["error"]["code"] == "rate_limit_exceeded"
    assert "busy" in body["error"]["message"] and "capacity 2" in body["error"]["message"]
    assert headers["Retry-After"] == "1"
    assert s.broker.outstanding == 1                     # nothing of the refused request was queued
    with pytest.raises(openai.RateLimitError):
        s.client.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=1)
    assert s.scrape()[("hpcpipe_requests_total", 'status="429"')] == 2
    status, _, body = s.post({"prompt": ["a", "b", "c"], "max_tokens": 1})     # could never be admitted whole
    assert status == 400 and body["error"]["param"] == "prompt"
    assert "list of 3 prompts but this server holds at most 2 at once" in body["error"]["message"]


def test_closed_broker_is_503_and_health_says_draining(served):
    s = served(engine=False)
    s.broker.close("draining")
    status, _, body = s.post({"prompt": "hi"})
    assert status == 503 and "shutting down" in body["error"]["message"]
    assert s.request("GET", "/health")[::2] == (503, {"status": "draining"})


MALFORMED = [
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999999999999\r\n\r\n{}",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Bad: \x00\x01\r\nContent-Length: 2\r\n\r\n{}",
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 20_000 + b"\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: a\r\n" % i for i in range(200)) + b"\r\n",
    "GET /v1/mod\u00e9ls HTTP/1.1\r\nHost: x\r\n\r\n".encode(),
    # a chunked body that is not the gzip it claims: 400, then aiohttp logged "Unhandled exception" (40 lines)
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"10\r\n" + b"\x78\x9c" + b"z" * 14 + b"\r\n0\r\n\r\n",
]


def test_malformed_http_requests_are_a_400_and_one_log_line_not_a_traceback_each(served, caplog, capfd):
    """A request aiohttp's parser refuses used to log an 11-line traceback per request (any client, at will)."""
    s = served(engine=False)
    for raw in MALFORMED:
        with socket.create_connection(("127.0.0.1", s.port), timeout=10) as sock:
            sock.sendall(raw)
            answer = b""
            while chunk := sock.recv(65536):         # the server answers and closes the connection
                answer += chunk
        assert answer.startswith(b"HTTP/1.") and b" 400 " in answer.split(b"\r\n")[0], (raw[:60], answer[:200])
    status, _, body = s.request("GET", "/health")               # the server itself carries on
    assert status == 200, body
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert not tracebacks, [r.getMessage() for r in tracebacks]
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "malformed HTTP request" in line]
    assert len(lines) == 1, err                                   # the first, then one per 100
    assert lines[0].startswith("hpcpipe: [http] a malformed HTTP request from 127.0.0.1 was refused with 400 ("), lines
