"""The OpenAI-compatible HTTP front end: an aiohttp app served by its own event loop in a daemon thread.

aiohttp because one well-kept dependency gives an asyncio server, streamed responses (server-sent
events) and client-disconnect detection without a separate ASGI server, and it runs happily in one
background thread of rank 0 while every MPI call stays on the main thread. The app talks to the engine
only through the thread-safe Broker. The event loop only checks fields: prompts are rendered and tokenized
by prompt workers (hpcpipe.serve.prompt_pool), so no request's text or template can stall it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import hmac
import json
import numbers
import socket
import sys
import threading
import time
import traceback
import uuid

from aiohttp import web

from hpcpipe.serve.broker import Broker, Closed, QueueFull, Request
from hpcpipe.serve.chat_schema import check_chat
from hpcpipe.serve.completion import Completion
from hpcpipe.serve.grammar_jobs import GrammarCompiler
from hpcpipe.serve.http_log import connection_logger
from hpcpipe.serve.metrics import CONTENT_TYPE, Metrics
from hpcpipe.serve.openai_schema import ApiError, check_completion, check_limits, check_model, constrained, usage
from hpcpipe.serve.prompt_pool import PromptPool
from hpcpipe.serve.quiet_log import RateLimitedLog
from hpcpipe.serve.request_body import ClientGone, read_spec
from hpcpipe.serve.request_options import choice_params
from hpcpipe.serve.responses import ChatShape, TextShape
from hpcpipe.serve.token_text import TokenTexts

BODY_TIMEOUT_S = 30.0      # from the headers' end to the body's
# a connection's request headers must be whole this long after it opened (or after its last answer):
# aiohttp >= 3.14.4 closes an idle connection at its keep-alive timeout, whatever bytes trickle in
HEADER_TIMEOUT_S = 30.0

_STATE = web.AppKey("hpcpipe_state", dict)
_INFLIGHT = web.AppKey("hpcpipe_inflight", set)
API_PREFIX = "/v1/"    # what an API key guards; /health and /metrics stay open to probes and scrapers


def make_app(broker: Broker, metrics: Metrics, tokenizer, model_name: str, seq_len: int,
             limits: dict | None = None, api_key: str = "", stall_timeout: float = 0.0,
             prompts: PromptPool | None = None, sampling: dict | None = None) -> web.Application:
    """Return the aiohttp app: POST /v1/completions and /v1/chat/completions, GET /v1/models (and
    /v1/models/{model}), /health, /metrics.

    With an ``api_key``, every /v1/ request must carry ``Authorization: Bearer <api_key>`` (what the
    OpenAI clients send) or is answered 401. With a ``stall_timeout`` (run.stall_timeout, s), /health
    answers 503 once requests are outstanding and the engine's work has not moved for a quarter of it.
    Prompts are rendered and tokenized by ``prompts`` (made here from ``limits`` when not given, its workers
    started on first use, closed with the app), never on the event loop. ``sampling``: what a request that leaves
    temperature, top_p or top_k out samples with (ServeSetup.sampling_defaults; None: OpenAI's defaults).
    """
    limits = check_limits(limits)
    if isinstance(seq_len, bool) or not isinstance(seq_len, numbers.Integral) or seq_len < 2:
        raise ValueError(f"serve: seq_len must be an integer >= 2, got {seq_len!r}")
    if isinstance(stall_timeout, bool) or not isinstance(stall_timeout, numbers.Real) or not stall_timeout >= 0:
        raise ValueError(f"serve: stall_timeout must be a number of seconds >= 0, got {stall_timeout!r}")
    app = web.Application(client_max_size=int(limits["max_body_bytes"]),
                          middlewares=[_json_errors, _require_api_key])
    if prompts is None:
        prompts = PromptPool(tokenizer, limits["prompt_workers"], limits["prompt_seconds"], limits["max_chat_chars"])
        app.on_cleanup.append(lambda app: asyncio.to_thread(prompts.close))
    app[_STATE] = {"broker": broker, "metrics": metrics, "tokenizer": tokenizer, "model": model_name,
                   "seq_len": int(seq_len), "limits": limits, "started": int(time.time()),
                   "api_key": api_key.encode(), "stall_timeout": float(stall_timeout), "resets": RateLimitedLog(),
                   "texts": TokenTexts(tokenizer), "prompts": prompts, "sampling": dict(sampling or {}),
                   "grammars": GrammarCompiler(tokenizer, limits["grammar_ms"])}
    app[_INFLIGHT] = set()
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/v1/models/{model:.+}", _model)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    return app


def _error(err: ApiError, headers: dict | None = None) -> web.Response:
    return web.json_response(err.body(), status=err.status, headers=headers)


@web.middleware
async def _json_errors(request: web.Request, handler):
    """Answer aiohttp's own errors (unknown path, wrong method) with OpenAI-style JSON bodies."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = {404: f"no such endpoint: {request.method} {request.path}",
                   405: f"method {request.method} is not allowed on {request.path}"}.get(exc.status, exc.reason)
        return _error(ApiError(exc.status, message, code={404: "not_found"}.get(exc.status)))
    except Exception as exc:  # noqa: BLE001 - a bug of ours: the client still gets JSON, the log the traceback
        print(f"hpcpipe: [http] error: {request.method} {request.path} failed: {type(exc).__name__}: {exc}\n"
              f"{traceback.format_exc()}", file=sys.stderr, flush=True)
        request.app[_STATE]["metrics"].count_request(500)
        return _error(ApiError(500, f"the server failed on this request ({type(exc).__name__})", type="server_error"))


@web.middleware
async def _require_api_key(request: web.Request, handler):
    """Answer 401 to a /v1/ request without the server's API key (when it has one)."""
    s = request.app[_STATE]
    if s["api_key"] and request.path.startswith(API_PREFIX):
        header = request.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            # a header that is there names its mistake (never its value: it may be the key itself)
            what = "no API key given" if not header.strip() else "the Authorization header is not 'Bearer <key>'"
            err = ApiError(401, f"{what}: send the header 'Authorization: Bearer <key>' (the openai "
                                "client's api_key) with the key the server was started with (HPCPIPE_API_KEY)",
                           code="invalid_api_key")
        elif not hmac.compare_digest(given.strip().encode("utf-8", "replace"), s["api_key"]):
            err = ApiError(401, "incorrect API key: it is not the one the server was started with (HPCPIPE_API_KEY)",
                           code="invalid_api_key")
        else:
            return await handler(request)
        s["metrics"].count_request(401)
        return _error(err, headers={"WWW-Authenticate": "Bearer"})
    return await handler(request)


def _model_object(s: dict) -> dict:
    return {"id": s["model"], "object": "model", "created": s["started"], "owned_by": "hpcpipe"}


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_model_object(request.app[_STATE])]})


async def _model(request: web.Request) -> web.Response:
    """GET /v1/models/{model} (the openai client's models.retrieve): the served model, else 404 model_not_found."""
    s = request.app[_STATE]
    try:
        check_model({"model": request.match_info["model"]}, s["model"])
    except ApiError as err:
        return _error(err)
    return web.json_response(_model_object(s))


async def _health(request: web.Request) -> web.Response:
    s = request.app[_STATE]
    broker, limit = s["broker"], s["stall_timeout"]
    if broker.closed is not None:
        return web.json_response({"status": "draining"}, status=503)
    if not broker.ready:     # the port is bound before the stages load: requests wait, probes must too
        return web.json_response({"status": "starting"}, status=503)
    stalled = broker.stalled_for()
    if limit > 0 and stalled > limit / 4:     # a probe sees it long before the watchdog aborts the job
        return web.json_response({"status": "stalled", "reason": (
            f"no decode step for {stalled:.1f} s with {broker.outstanding} request(s) pending (run.stall_timeout = "
            f"{limit:g} s: the watchdog aborts the job at {limit:g} s)")}, status=503)
    return web.json_response({"status": "ok"})


async def _metrics(request: web.Request) -> web.Response:
    s = request.app[_STATE]
    broker, metrics = s["broker"], s["metrics"]
    metrics.set_gauges(queue_depth=broker.queue_depth, running=broker.running)
    metrics.set_engine(broker.engine_stats)
    return web.Response(body=metrics.render().encode(), headers={"Content-Type": CONTENT_TYPE})


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, check_completion, TextShape())


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, check_chat, ChatShape())


async def _generate(request: web.Request, parse, shape) -> web.StreamResponse:
    """Validate, submit to the engine, answer whole or streamed in the endpoint's shape."""
    s = request.app[_STATE]
    broker, metrics = s["broker"], s["metrics"]
    arrival = time.monotonic()
    try:
        draft = await read_spec(request, s, parse, BODY_TIMEOUT_S)
        # the grammar compiled and the prompts rendered and tokenized off the event loop, within their budgets
        grammar = await s["grammars"].grammar(draft.response_format)
        spec = constrained(draft.finish(await s["prompts"].prepare(draft.jobs)), grammar)
    except ApiError as err:
        metrics.count_request(err.status)
        # a 429 of the prompt workers or the grammar compilers says when to retry, as the broker's does
        return _error(err, headers={"Retry-After": "1"} if err.status == 429 else None)
    except ClientGone:                          # nobody is left to answer; a client can do this at will
        metrics.count_disconnect()
        metrics.count_request(499)
        s["resets"](f"hpcpipe: [http] a client reset its connection before its body arrived ({request.method} "
                    f"{request.path}): counted as 499")
        return web.Response(status=499)
    if len(spec.prompts) * spec.n > broker.capacity:      # never admitted whole: "retry later" would be a lie
        metrics.count_request(400)
        each = f" with n = {spec.n} choices each" if spec.n > 1 else ""
        return _error(ApiError(400, f"prompt is a list of {len(spec.prompts)} prompts{each} but this server holds at "
                                    f"most {broker.capacity} at once (dp x serve.max_sequences + serve.max_queue): "
                                    f"send fewer per request", param="prompt"))
    cid = f"{shape.prefix}-{uuid.uuid4().hex}"
    # n choices per prompt, choice index = prompt index x n + j, each with its own seed (request_options)
    params = choice_params(spec.params, spec.n)
    requests = [Request(f"{cid}-{p * spec.n + j}", ids, spec.max_tokens, params[j], arrival)
                for p, ids in enumerate(spec.prompts) for j in range(spec.n)]
    echo = None if spec.echo is None else [text for text in spec.echo for _ in range(spec.n)]
    job = Completion(requests, s["tokenizer"], spec.stop, broker, metrics, echo, spec.n, s["texts"])
    try:
        broker.submit(requests, job.on_event)
    except QueueFull as exc:
        metrics.count_request(429)
        return _error(ApiError(429, f"the server is busy: {exc}; retry later", type="requests",
                               code="rate_limit_exceeded"), headers={"Retry-After": "1"})
    except Closed as exc:
        metrics.count_request(503)
        return _error(ApiError(503, f"the server is shutting down ({exc}) and accepts no new requests",
                               type="server_error", code="service_unavailable"))
    metrics.add_prompt_tokens(job.prompt_tokens())
    head = {"cid": cid, "created": int(time.time()), "model": s["model"], "texts": s["texts"],
            "choices": len(requests)}
    task = asyncio.current_task()
    request.app[_INFLIGHT].add(task)
    try:
        if spec.stream:
            return await _stream(request, job, head, spec.include_usage, metrics, shape)
        return await _whole(job, head, metrics, shape)
    except asyncio.CancelledError:
        # The client went away: aiohttp cancels the handler (handler_cancellation=True), whatever it awaits.
        metrics.count_disconnect()
        if not spec.stream:
            metrics.count_request(499)
        raise
    finally:
        job.cancel_unfinished()
        request.app[_INFLIGHT].discard(task)


async def _whole(job: Completion, head: dict, metrics: Metrics, shape) -> web.Response:
    """Wait for every choice, then answer one JSON object in the endpoint's shape."""
    while not job.done and not job.failed:
        await job.items.get()
    if job.failed:
        metrics.count_request(500)
        return _error(ApiError(500, "the engine failed while generating this completion", type="server_error"))
    metrics.count_request(200)
    return web.json_response(shape.whole(head, job.texts(), job.finish_reasons(), job.logprobs(),
                                         usage(job.prompt_tokens(), job.completion_tokens())))


async def _stream(request: web.Request, job: Completion, head: dict, include_usage: bool,
                  metrics: Metrics, shape) -> web.StreamResponse:
    """Send each text delta as a server-sent event as it arrives, then data: [DONE]."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no"})     # proxies: pass each event on at once
    try:
        await resp.prepare(request)
        metrics.count_request(200)
        await _send_events(resp, job, head, include_usage, shape)
    except ConnectionResetError:     # a write found the client gone (the caller cancels its requests)
        metrics.count_disconnect()
    except Exception as exc:  # noqa: BLE001 - a bug of ours mid-stream: this stream ends in an error, no other
        print(f"hpcpipe: [http] error: {request.method} {request.path} failed: {type(exc).__name__}: {exc}\n"
              f"{traceback.format_exc()}", file=sys.stderr, flush=True)
        if resp.prepared:
            err = ApiError(500, f"the server failed on this stream ({type(exc).__name__})", type="server_error")
            with contextlib.suppress(ConnectionResetError):
                await resp.write(f"data: {json.dumps(err.body())}\n\n".encode())
        else:
            raise
    return resp


async def _send_events(resp: web.StreamResponse, job: Completion, head: dict, include_usage: bool, shape) -> None:
    """Write the chunks of job as they come, then the usage chunk if asked and [DONE]."""
    def event(obj) -> bytes:
        return f"data: {json.dumps(obj)}\n\n".encode()

    opening = shape.opening(head, head["choices"])
    if opening:
        await resp.write(b"".join(event(obj) for obj in opening))
    while not job.done:
        batch = [await job.items.get()]
        while not job.items.empty():           # coalesce what arrived together into one write
            batch.append(job.items.get_nowait())
        out = []
        for i, text, finish, rows, offsets in batch:
            if finish == "error":
                out.append(event(ApiError(500, f"the engine failed while generating choice {i}",
                                          type="server_error").body()))
                await resp.write(b"".join(out))
                return                         # no [DONE]: the stream ended in an error
            out.append(event(shape.chunk(head, i, text, finish, rows, offsets)))
        await resp.write(b"".join(out))
    tail = [b"data: [DONE]\n\n"]
    if include_usage:
        tail.insert(0, event(shape.usage_chunk(head, usage(job.prompt_tokens(), job.completion_tokens()))))
    await resp.write(b"".join(tail))
    await resp.write_eof()


class HttpServer:
    """aiohttp app served by its own event loop in a daemon thread."""

    def __init__(self, app: web.Application, host: str, port: int):
        self.app, self.host, self.port = app, host, int(port)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None

    def start(self) -> tuple[str, int]:
        """Bind now (OSError naming host and port if that fails), serve in a daemon thread; return (host, port)."""
        if self._thread is not None:
            raise RuntimeError("HttpServer.start: already started (make a new HttpServer to serve again)")
        sock = _listen(self.host, self.port)
        bound = sock.getsockname()[:2]
        ready: dict = {}
        started = threading.Event()
        self._loop = asyncio.new_event_loop()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            try:
                self._runner = web.AppRunner(self.app, handler_cancellation=True, shutdown_timeout=1.0,
                                             access_log=None, keepalive_timeout=HEADER_TIMEOUT_S,
                                             logger=connection_logger(bound[1]))
                self._loop.run_until_complete(self._runner.setup())
                self._loop.run_until_complete(web.SockSite(self._runner, sock).start())
            except BaseException as exc:       # reported to start() in the caller's thread
                ready["error"] = exc
                self._loop.close()
                started.set()
                return
            started.set()
            try:
                self._loop.run_forever()
            finally:
                self._loop.run_until_complete(self._loop.shutdown_asyncgens())
                self._loop.close()

        self._thread = threading.Thread(target=run, name="hpcpipe-http", daemon=True)
        self._thread.start()
        started.wait()
        if "error" in ready:
            sock.close()
            raise ready["error"]
        return bound[0], bound[1]

    def stop(self, timeout: float = 10.0) -> None:
        """Stop listening, let open responses finish for up to timeout seconds, then close all and end the thread."""
        if self._thread is None or not self._thread.is_alive():
            return
        fut = asyncio.run_coroutine_threadsafe(self._shutdown(timeout), self._loop)
        try:
            fut.result(timeout + 5.0)
        except concurrent.futures.TimeoutError:
            pass                               # shutting down anyway: the loop stops below, the thread is a daemon
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5.0)

    async def _shutdown(self, timeout: float) -> None:
        for site in list(self._runner.sites):
            await site.stop()
        inflight = set(self.app[_INFLIGHT])
        if inflight:
            _, late = await asyncio.wait(inflight, timeout=timeout)
            for task in late:                  # past the grace period: end them now (their requests are
                task.cancel()                  # cancelled at the broker), not after aiohttp's own waits
            if late:
                await asyncio.wait(late, timeout=1.0)
        await self._runner.cleanup()


def _listen(host: str, port: int) -> socket.socket:
    """Return a listening TCP socket on host:port (port 0: any free port); OSError says which address failed."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except OSError as exc:      # a name that does not resolve: the host is wrong, not the port
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: --host {host!r} does not resolve to an address "
                                 f"here ({exc.strerror or exc}); give a local name or address, e.g. 127.0.0.1 "
                                 f"or 0.0.0.0") from None
    try:
        return socket.create_server((host, port), family=family, backlog=128)
    except OSError as exc:
        hint = " (is another server using it? pick another with --port)" if port and exc.errno == errno.EADDRINUSE \
            else ""
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror or exc}{hint}") from None
