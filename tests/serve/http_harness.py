"""A real HTTP front end on 127.0.0.1 with a scripted engine thread (no MPI), for the test_serve_http_* files.

The engine here is a stand-in that lives only in the tests: a thread that polls broker.take() and
delivers one token per request per step, the token ids chosen by the test (by default the prompt's
bytes reversed, repeated). The real MPI engine is tested end to end elsewhere.
"""

from __future__ import annotations

import http.client
import json
import threading
import time

import openai
from support.prometheus_text import parse_prometheus

from hpcpipe.serve.broker import Broker, Event, Request
from hpcpipe.serve.http_api import HttpServer, make_app
from hpcpipe.serve.metrics import Metrics
from hpcpipe.state.tokenizer import Tokenizer

MODEL = "tiny-gpt"


class ScriptedEngine:
    """Engine stand-in: one token per live request per step; request i's tokens come from script(prompt)."""

    def __init__(self, broker: Broker, step: float):
        self.broker, self.step = broker, step
        self.scripts: dict[bytes, list] = {}      # prompt bytes -> token ids (an "error" entry fails the request)
        self.taken: dict[str, Request] = {}
        self.cancelled: dict[str, float] = {}     # id -> time.monotonic() when the engine saw the cancel
        self.generated: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _script(self, r: Request) -> list:
        key = bytes(r.prompt)
        return self.scripts.get(key, list(reversed(r.prompt)))

    def _run(self) -> None:
        live: dict[str, list] = {}
        while not self._stop.is_set():
            new, cancelled = self.broker.take()
            for r in new:
                self.taken[r.id] = r
                live[r.id] = [r, self._script(r), 0]
            for i in cancelled:
                self.cancelled[i] = time.monotonic()
                live.pop(i, None)
            events = []
            for rid, st in list(live.items()):
                r, script, k = st
                tok = script[k % len(script)]
                if tok == "error":
                    events.append(Event(rid, [], "error"))
                    del live[rid]
                    continue
                st[2] = k + 1
                self.generated[rid] = k + 1
                fin = "length" if k + 1 == r.max_new else None
                events.append(Event(rid, [tok], fin))
                if fin:
                    del live[rid]
            self.broker.deliver(events)
            self.broker.set_running(len(live))
            time.sleep(self.step)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


class Served:
    """A running server with its broker, metrics and (optional) scripted engine."""

    def __init__(self, capacity=16, step=0.001, seq_len=64, tokenizer=None, engine=True, limits=None, api_key="",
                 stall_timeout=0.0):
        self.broker, self.metrics = Broker(capacity), Metrics()
        self.tokenizer = tokenizer or Tokenizer("bytes")
        self.engine = ScriptedEngine(self.broker, step) if engine else None
        more = {"stall_timeout": stall_timeout} if stall_timeout else {}
        app = make_app(self.broker, self.metrics, self.tokenizer, MODEL, seq_len, limits, api_key=api_key, **more)
        self.server = HttpServer(app, "127.0.0.1", 0)
        self.host, self.port = self.server.start()
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=api_key or "x",
                                    max_retries=0, timeout=10)

    def request(self, method: str, path: str, body=None, raw: bytes | None = None, headers: dict | None = None):
        """Return (status, headers, parsed JSON or text) of one raw HTTP request."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        text = resp.read().decode()
        conn.close()
        try:
            return resp.status, resp.headers, json.loads(text)
        except ValueError:
            return resp.status, resp.headers, text

    def post(self, body=None, raw=None):
        return self.request("POST", "/v1/completions", body, raw)

    def scrape(self) -> dict:
        status, headers, text = self.request("GET", "/metrics")
        assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return parse_prometheus(text)

    def close(self):
        self.server.stop(2.0)
        if self.engine:
            self.engine.stop()
