"""Prompt workers (issue 40): what a model's chat template or tokenizer, or a client, makes of a request fails that
request alone, with one line and the right status, while /health and every other client are served.

A real server on 127.0.0.1 with a stand-in engine (no MPI) and a Hugging Face tokenizer trained here whose chat
template misbehaves on cue (the last message's content picks the attack) and whose pre-tokenizer regex backtracks
catastrophically on a run of 'a's.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")

from support.hf import bytelevel_tokenizer  # noqa: E402

from hpcpipe.hf.tokenizer import from_files  # noqa: E402
from hpcpipe.serve.broker import Broker, Event  # noqa: E402
from hpcpipe.serve.http_api import HttpServer, make_app  # noqa: E402
from hpcpipe.serve.metrics import Metrics  # noqa: E402
from hpcpipe.serve.openai_schema import check_limits  # noqa: E402
from hpcpipe.serve.prompt_pool import PromptPool, check_chat_template  # noqa: E402

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "<|im_start|>assistant\n")
HOSTILE = ("{% set c = messages[-1].content %}"
           "{% if c == 'loop' %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
           "{% elif c == 'big' %}{{ 'x' * 10**9 }}"
           "{% elif c == 'json' %}{{ messages | tojson(indent=100000000) }}"
           "{% elif c == 'nothing' %}"
           "{% else %}" + CHATML + "{% endif %}")
BUDGET_S = 3
MAX_CHARS = 1 << 16
HELLO = [{"role": "user", "content": "hello"}]


def _tokenizer_json(backtracking: bool) -> str:
    doc = json.loads(bytelevel_tokenizer(SPECIALS, vocab_size=300).to_str())
    if backtracking:      # (a|aa)+b on 'aaaa...c': onig gives up after its retry limit and tokenizers panics
        doc["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "(a|aa)+b"}, "behavior": "Isolated", "invert": False},
            doc["pre_tokenizer"]]}
    return json.dumps(doc)


def tokenizer(template, backtracking: bool = False):
    """A Hugging Face tokenizer with this chat template (a string, a list of named ones, or None)."""
    config = {"eos_token": "<|im_end|>", **({"chat_template": template} if template is not None else {})}
    return from_files({"tokenizer.json": _tokenizer_json(backtracking).encode(),
                       "tokenizer_config.json": json.dumps(config).encode()}, "test tokenizer")


class EchoEngine:
    """Engine stand-in: each request gets its first prompt id back, max_new times, one per step."""

    def __init__(self, broker: Broker):
        self.broker, self._stop = broker, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        live = {}
        while not self._stop.is_set():
            new, cancelled = self.broker.take()
            live.update({r.id: [r, 0] for r in new})
            for i in cancelled:
                live.pop(i, None)
            events = []
            for rid, st in list(live.items()):
                st[1] += 1
                done = st[1] == st[0].max_new
                events.append(Event(rid, [st[0].prompt[0]], "length" if done else None))
                if done:
                    del live[rid]
            self.broker.deliver(events)
            self.broker.set_running(len(live))
            time.sleep(0.002)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


class Served:
    """A server with the hostile tokenizer and an EchoEngine behind it."""

    def __init__(self, limits: dict):
        self.broker = Broker(64)
        self.engine = EchoEngine(self.broker)
        tok = tokenizer(HOSTILE, backtracking=True)
        full = check_limits(limits)
        # started before serving, as serve does: a test that kills the workers finds them running, not starting
        self.prompts = PromptPool(tok, full["prompt_workers"], full["prompt_seconds"], full["max_chat_chars"])
        self.prompts.start()
        app = make_app(self.broker, Metrics(), tok, "m", 4096, limits, prompts=self.prompts)
        self.server = HttpServer(app, "127.0.0.1", 0)
        _, self.port = self.server.start()

    def close(self) -> None:
        self.server.stop(2.0)
        self.prompts.close()
        self.engine.stop()


@pytest.fixture(scope="module")
def server():
    s = Served({"prompt_seconds": BUDGET_S, "max_chat_chars": MAX_CHARS})
    yield s
    s.close()


def call(port: int, path: str, body=None, raw: bytes | None = None, method: str = "POST", timeout: float = 60):
    """Return (status, parsed body, seconds) of one request."""
    start = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    return resp.status, json.loads(text), time.perf_counter() - start


def chat(s, content, **more):
    return call(s.port, "/v1/chat/completions", {"messages": [{"role": "user", "content": content}],
                                                 "max_tokens": 2, **more})


def served_alone(s) -> None:
    """The server still answers /health and a chat of two tokens."""
    assert call(s.port, "/health", method="GET")[:2] == (200, {"status": "ok"})
    status, body, _ = chat(s, "hello")
    assert status == 200 and body["choices"][0]["finish_reason"] == "length", body


def refused(answer, status: int, *words: str) -> str:
    code, body, _ = answer
    message = body["error"]["message"]
    assert code == status and "\n" not in message, (code, body)
    for word in words:
        assert word in message, (word, message)
    return message


def test_a_chat_that_renders_to_no_tokens_is_a_400_and_holds_no_slot(server):
    """It was accepted, never started, held a queue slot, turned /health 503 and the watchdog aborted the server."""
    refused(chat(server, "nothing"), 400, "no tokens in the messages rendered with the model's chat template",
            "send messages with content")
    assert server.broker.outstanding == 0
    served_alone(server)


def test_an_endless_template_fails_that_request_alone_at_its_time_budget(server):
    """Nested range(100000) froze the HTTP thread: /health and every endpoint timed out for good."""
    answers = []
    looping = threading.Thread(target=lambda: answers.append(chat(server, "loop")))
    looping.start()
    time.sleep(0.3)
    served_alone(server)                      # while the template loops in its worker
    assert looping.is_alive()
    looping.join(60)
    message = refused(answers[0], 400, f"took longer than {BUDGET_S} s", "prompt_seconds", "chat template")
    assert message.startswith("rendering the messages with the model's chat template")
    assert BUDGET_S <= answers[0][2] < BUDGET_S + 30
    served_alone(server)                      # a new worker took the killed one's place


@pytest.mark.parametrize("content, words", [("big", "a product of 1 x 1000000000 items"),
                                            ("json", "tojson(indent=100000000)")])
def test_huge_template_output_fails_that_request_alone(server, content, words):
    """'x' * 10**9 and tojson(indent=100000000) rendered hundreds of MB; tokenizers aborted the server (exit 6)."""
    refused(chat(server, content), 400, f"renders more than {MAX_CHARS} characters", words)
    served_alone(server)


def test_a_tokenizer_regex_that_backtracks_catastrophically_is_answered(server):
    """tokenizers panicked in Rust (a BaseException): the client got no HTTP answer at all."""
    body = {"prompt": "a" * 40 + "c", "max_tokens": 2}
    refused(call(server.port, "/v1/completions", body), 400, "prompt cannot be encoded: the tokenizer failed on it",
            "retry-limit-in-match")
    body = {"prompt": ["hello", "a" * 40 + "c"], "max_tokens": 2}
    refused(call(server.port, "/v1/completions", body), 400, "prompt[1] cannot be encoded")
    served_alone(server)


@pytest.mark.parametrize("raw, words", [
    (b'{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt holds a lone surrogate U+D800 at position 1"),
    (b'{"prompt": ["ok", "\\udc00"], "max_tokens": 2}', "prompt[1] holds a lone surrogate U+DC00 at position 0"),
    (b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content holds a lone surrogate U+D800"),
    (b'{"messages": [{"role": "us\\udc00er", "content": "ab"}]}', "messages[0].role holds a lone surrogate U+DC00"),
    (b'{"messages": [{"role": "user", "content": "a\xffb"}]}', "not UTF-8 text (byte 0xFF at position 44)"),
    (b'{"prompt": "a\xc3", "max_tokens": 2}', "not UTF-8 text (byte 0xC3 at position 13)"),
])
def test_text_that_is_not_unicode_is_a_400_naming_it(server, raw, words):
    """A lone surrogate reached the tokenizer: TypeError 'TextInputSequence must be str', a 500."""
    path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    refused(call(server.port, path, raw=raw), 400, words)


@pytest.mark.parametrize("path, field", [("/v1/chat/completions", '"messages": [{"role": "user", "content": "hi", '
                                                                  '"extra": %s}]'),
                                         ("/v1/completions", '"prompt": "hi", "user": %s')])
def test_a_field_nested_deeply_is_a_400_of_one_line(server, path, field):
    """500 levels parsed, then the message checks recursed past Python's limit: a 500 and 3000 log lines."""
    raw = ("{" + field % ("[" * 500 + "]" * 500) + "}").encode()
    refused(call(server.port, path, raw=raw), 400, "nested too deeply", "at most 128")


def _workers() -> list[int]:
    """The pids of this process's prompt worker children."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (entry / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid() and b"hpcpipe.serve.prompt_worker" in cmd:
            pids.append(int(entry.name))
    return pids


def test_a_worker_that_dies_fails_its_request_alone_with_a_500(server):
    """A Rust abort or the OOM killer ends the worker, never the server; a new worker takes the next request."""
    answers = []
    looping = threading.Thread(target=lambda: answers.append(chat(server, "loop")))
    looping.start()
    deadline = time.monotonic() + 20
    while not _workers() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    killed = _workers()
    for pid in killed:
        os.kill(pid, signal.SIGKILL)
    looping.join(60)
    refused(answers[0], 500, "the process preparing this request's prompt ended (killed by SIGKILL)",
            "the server carries on")
    deadline = time.monotonic() + 60          # its replacement starts at once, before any request asks for it
    while not set(_workers()) - set(killed) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(_workers()) - set(killed), "no new prompt worker started after one died"
    served_alone(server)


@pytest.fixture
def patient():
    s = Served({"prompt_seconds": 600})      # every 1 MB prompt is tokenized, however loaded the machine
    yield s
    s.close()


def test_ten_large_prompts_leave_health_and_a_small_completion_served(patient):
    """Tokenized on the event loop, ten 1 MB prompts made /health take 2.7-4.2 s and 2 tokens 23-31 s."""
    server = patient
    words = "the quick brown fox jumps over lazy dog pipeline stage rank tensor".split()
    text = " ".join(words[i % len(words)] for i in range(200_000))[:1_000_000]
    tok = tokenizer(None)
    start = time.perf_counter()
    tok.encode(text)
    encode_s = time.perf_counter() - start     # what one of them held the event loop for
    big, health, small, done = [], [], [], threading.Event()

    def large():
        big.append(call(server.port, "/v1/completions", {"prompt": text, "max_tokens": 2}, timeout=300))

    def probe():
        while not done.is_set():
            health.append(call(server.port, "/health", method="GET")[2])
            time.sleep(0.05)
    threads = [threading.Thread(target=large) for _ in range(10)]
    prober = threading.Thread(target=probe)
    for t in threads:
        t.start()
    prober.start()
    time.sleep(0.5)
    small.append(call(server.port, "/v1/completions", {"prompt": "hello", "max_tokens": 2}))
    small_done = len(big)                       # large answers in when the small one was answered
    for t in threads:
        t.join(300)
    done.set()
    prober.join(10)
    assert small[0][0] == 200 and small[0][1]["usage"]["completion_tokens"] == 2
    assert small_done < 10, "the 2-token completion waited for every large prompt"
    assert [b[0] for b in big] == [400] * 10
    assert all("leaves no room in the model's context" in b[1]["error"]["message"] for b in big)
    assert max(health) < encode_s / 2, (max(health), encode_s)


def test_the_start_up_check_refuses_a_template_that_cannot_serve():
    """A template that cannot render a one-message chat is refused when the server starts (exit 2), not per request."""
    cases = [("{% for m in messages %}", "the model's chat template is invalid"),
             ([{"name": ["x"], "template": "x"}], r"chat_template\[0\] must be an object with a string name"),
             ("{% for m in messages %}{% endfor %}", "no tokens in the messages rendered"),
             ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
              "took longer than 2 s")]
    for template, words in cases:
        with PromptPool(tokenizer(template), 1, seconds=2) as pool, pytest.raises(ValueError, match=words) as info:
            check_chat_template(pool)
        assert "\n" not in str(info.value)
    for template, serves in ((CHATML, True), (None, False), ([{"name": "tools", "template": CHATML}], False)):
        with PromptPool(tokenizer(template), 1) as pool:
            assert check_chat_template(pool) is serves
