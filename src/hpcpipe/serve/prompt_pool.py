"""Prompt workers: chat templates rendered and prompts tokenized in child processes, off the HTTP event loop.

Why processes, not threads (measured on the 2-core VM): the ``tokenizers`` package holds the GIL while it encodes
(1 MiB of text: 1.2 s, during which a thread pool left the event loop stalled 0.7 s at a time), a chat template is
arbitrary code from the model (``range(100000)`` nested twice runs for hours and a thread cannot be stopped), and
a huge text makes the Rust side abort the whole process. A child process is killed at its request's deadline,
its memory is capped (RLIMIT_AS) and its crash is its own; a round trip costs about a millisecond.

Roughly::

    submit(jobs) -> Future          (event loop: never blocks; PromptBusy past ``queue`` waiting requests)
       small requests (<= SMALL_BYTES)  ->  the express worker, or a general one that is free
       large requests                   ->  the ``workers`` general workers, oldest first
    a worker's thread: send the jobs, wait for the answer until the deadline (``seconds``)
       answer   -> the Future's result (token ids, texts) or its ApiError (400: what the request holds)
       deadline -> kill the child, ApiError(400) naming the limit; a new child starts at once
       EOF      -> the child died (a Rust abort, the OOM killer): ApiError(500) naming how; a new child at once

The express worker keeps a 2-token completion from waiting behind ten 1 MiB prompts. Children start lazily (the
server starts them all at once with :meth:`PromptPool.start`, before it serves).

hpcpipe's own bytes and chars tokenizers have no template and encode with NumPy in linear time (1 MiB: 0.16 s
and 0.7 s on the loaded VM, nothing to panic), so their workers are the same threads running the jobs in place:
no child to start (about 2 s of imports each under load), the same queue and express lane.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, NoReturn

import hpcpipe
from hpcpipe.hf.json_text import JSONTextError, loads
from hpcpipe.serve.api_error import ApiError
from hpcpipe.serve.prompt_jobs import run_jobs
from hpcpipe.serve.prompt_worker import tokenizer_frame, unpack_results, write_frame

SMALL_BYTES = 64 << 10        # a request whose jobs are at most this much JSON goes to the express worker too
START_SECONDS = 120.0         # a child builds the tokenizer (a 128k vocabulary takes about a second)
MEMORY_BYTES = 1 << 30        # what a child may map beyond what it maps once its tokenizer is built
QUEUE = 64                    # requests waiting for a worker; one more is answered 429


class PromptBusy(Exception):
    """Every prompt worker is busy and the queue is full (the HTTP answer is 429)."""


class _Queue:
    """Requests waiting for a worker: small ones and large ones, each first in, first out."""

    def __init__(self, size: int):
        self.size, self.closed = size, False
        self.small: collections.deque = collections.deque()
        self.large: collections.deque = collections.deque()
        self.cond = threading.Condition()

    def put(self, item: tuple, small: bool) -> None:
        """Queue item; PromptBusy when ``size`` are waiting already."""
        with self.cond:
            if len(self.small) + len(self.large) >= self.size:
                raise PromptBusy(f"{self.size} requests are waiting for a prompt worker")
            (self.small if small else self.large).append(item)
            self.cond.notify_all()

    def get(self, express: bool) -> tuple | None:
        """The next item for a worker (express: small ones only; others: large ones first); None once closed."""
        with self.cond:
            while not self.closed:
                if not express and self.large:
                    return self.large.popleft()
                if self.small:
                    return self.small.popleft()
                self.cond.wait()
            return None

    def close(self) -> list[tuple]:
        """Stop handing out items; return those still waiting."""
        with self.cond:
            self.closed = True
            left = list(self.small) + list(self.large)
            self.small.clear()
            self.large.clear()
            self.cond.notify_all()
            return left


class _Worker:
    """One child process and the thread that feeds it."""

    def __init__(self, pool: PromptPool, express: bool):
        self.pool, self.express = pool, express
        self.proc: subprocess.Popen | None = None
        self.lock = threading.Lock()          # start() from the server and the thread's own lazy start
        self.thread = threading.Thread(target=self._serve, name="hpcpipe-prompts", daemon=True)

    def _serve(self) -> None:
        while (item := self.pool._queue.get(self.express)) is not None:
            future, jobs, payload = item
            if not future.set_running_or_notify_cancel():
                continue                      # its client left while it waited
            try:
                future.set_result(self.run(jobs, payload))
            except BaseException as exc:      # noqa: BLE001 - handed to the request that asked
                future.set_exception(exc)
            if self.pool.processes and self.proc is None:
                try:                          # its child was killed: the next request need not wait for a new one
                    self.start()
                except RuntimeError:
                    pass                      # the next request says why

    def start(self) -> None:
        """Start the child if it is not running: spawn it, send the tokenizer, wait until it says ready."""
        with self.lock:
            if self.proc is not None and self.proc.poll() is None:
                return
            if self.pool._queue.closed:       # checked under the lock stop() takes: no child outlives close()
                raise RuntimeError("the prompt workers are closed")
            env = dict(os.environ, RUST_BACKTRACE="0",      # the child runs this very hpcpipe, whatever its cwd
                       PYTHONPATH=os.pathsep.join([str(Path(hpcpipe.__file__).parents[1]),
                                                   os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
            proc = subprocess.Popen([sys.executable, "-m", "hpcpipe.serve.prompt_worker", str(self.pool.memory)],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                    env=env)
            try:
                write_frame(proc.stdin, *self.pool._tokenizer_frame)
                header, _ = self._read(proc, time.monotonic() + START_SECONDS)
            except (OSError, EOFError, TimeoutError) as exc:
                _kill(proc)
                raise RuntimeError(f"a prompt worker did not start ({_ended(proc, exc)})") from None
            if "error" in header:
                _kill(proc)
                raise RuntimeError(f"a prompt worker cannot build the tokenizer: {header['error'].get('message')}")
            self.proc = proc

    def run(self, jobs: list[dict], payload: bytes | None) -> list:
        """Run one request's jobs in the child within the pool's time budget; ApiError when it cannot."""
        if payload is None:                   # a bytes or chars tokenizer: in this thread (see the module)
            return run_jobs(self.pool.tokenizer, jobs, self.pool.max_chars)
        try:
            self.start()
        except RuntimeError as exc:
            raise ApiError(500, f"cannot prepare this request's prompt: {exc}", type="server_error") from None
        proc = self.proc
        seconds = self.pool.seconds
        try:
            proc.stdin.write(payload)
            proc.stdin.flush()
            header, blob = self._read(proc, time.monotonic() + seconds)
        except TimeoutError:
            _kill(proc)
            self.proc = None
            raise ApiError(400, f"{_what(jobs)} took longer than {seconds:g} s, the limit of one request "
                                f"(prompt_seconds); the request was stopped", _param(jobs)) from None
        except (OSError, EOFError) as exc:
            how = _ended(proc, exc)
            _kill(proc)
            self.proc = None
            raise ApiError(500, f"the process preparing this request's prompt ended ({how}): the request failed, "
                                f"the server carries on", type="server_error") from None
        if "error" in header:
            _raise(header["error"])
        return unpack_results(header, blob)

    @staticmethod
    def _read(proc: subprocess.Popen, deadline: float) -> tuple[dict, bytes]:
        """Read one frame from the child by its deadline: TimeoutError past it, EOFError at its end."""
        fd = proc.stdout.fileno()
        lengths = _read_exact(fd, 8, deadline)
        size, tail = int.from_bytes(lengths[:4], "little"), int.from_bytes(lengths[4:], "little")
        data, blob = _read_exact(fd, size, deadline), _read_exact(fd, tail, deadline)
        try:
            header = loads(data)        # bounded: the child runs the model's template, its words are checked
        except JSONTextError as exc:
            raise EOFError(f"it answered what is not a frame: {exc}") from None
        if not isinstance(header, dict):
            raise EOFError("it answered what is not a frame")
        return header, blob

    def stop(self) -> None:
        """Kill the child (the thread ends once the queue is closed)."""
        with self.lock:
            if self.proc is not None:
                _kill(self.proc)
                self.proc = None


class PromptPool:
    """Child processes that render chat templates and tokenize prompts for the HTTP front end (see the module)."""

    def __init__(self, tokenizer: Any, workers: int = 2, seconds: float = 10.0, max_chars: int = 4 << 20,
                 memory: int = MEMORY_BYTES, queue: int = QUEUE):
        if workers < 1:      # the express worker takes small requests only: someone must take the large ones
            raise ValueError(f"prompt pool: workers must be >= 1, got {workers}")
        self.tokenizer, self.seconds, self.max_chars, self.memory = tokenizer, float(seconds), int(max_chars), memory
        self.processes = hasattr(tokenizer, "files")      # a Hugging Face tokenizer (and its chat template)
        self._tokenizer_frame = tokenizer_frame(tokenizer) if self.processes else None
        self._queue = _Queue(queue)
        self._workers = [_Worker(self, express=True)] + [_Worker(self, express=False) for _ in range(workers)]
        self._started = threading.Lock()

    def _threads(self) -> None:
        """Start the workers' threads once (a pool that is never used starts none)."""
        with self._started:
            for w in self._workers:
                if w.thread.ident is None:
                    w.thread.start()

    def start(self) -> None:
        """Start every child now (in parallel); RuntimeError naming why one cannot start."""
        self._threads()
        if not self.processes:
            return
        with concurrent.futures.ThreadPoolExecutor(len(self._workers)) as ex:
            for f in [ex.submit(w.start) for w in self._workers]:
                f.result()

    def submit(self, jobs: list[dict]) -> concurrent.futures.Future:
        """Queue one request's jobs; the Future's result is their results in order (or an ApiError).

        Raises PromptBusy when the queue is full, RuntimeError once the pool is closed.
        """
        if self._queue.closed:
            raise RuntimeError("the prompt workers are closed")
        self._threads()
        if self.processes:
            payload = _frame({"jobs": jobs, "max_chars": self.max_chars})
            size = len(payload)
        else:
            payload, size = None, sum(len(j.get("text", j.get("decode", ()))) for j in jobs)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((future, jobs, payload), small=size <= SMALL_BYTES)
        return future

    async def prepare(self, jobs: list[dict]) -> list:
        """The results of jobs, awaited on an event loop (cancelled with the request when its client leaves)."""
        if not jobs:
            return []
        try:
            future = self.submit(jobs)
        except PromptBusy as exc:
            raise ApiError(429, f"the server is busy: {exc}; retry later", type="requests",
                           code="rate_limit_exceeded") from None
        return await asyncio.wrap_future(future)

    def run(self, jobs: list[dict]) -> list:
        """The results of jobs, waited for here (start-up probes, ``generate --chat``)."""
        return self.submit(jobs).result() if jobs else []

    def close(self) -> None:
        """Fail the requests still waiting, kill every child, end the threads."""
        for future, _, _ in self._queue.close():
            if future.set_running_or_notify_cancel():
                future.set_exception(ApiError(503, "the server is shutting down", type="server_error",
                                              code="service_unavailable"))
        for w in self._workers:
            w.stop()
        for w in self._workers:
            if w.thread.ident is not None:
                w.thread.join(timeout=5.0)

    def __enter__(self) -> PromptPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


PROBE = [{"role": "user", "content": "Hello"}]


def check_chat_template(pool: PromptPool) -> bool:
    """Render a one-message conversation with the model's chat template in a worker, as a request is rendered;
    return whether the model has a template to serve. ValueError (one line) when it has one that cannot serve: a
    template list entry whose name is no string, a syntax error, a render that fails, passes the budget or
    writes no tokens (every request would fail; the server refuses to start instead)."""
    from hpcpipe.hf.chat import ChatError, NoChatTemplate, chat_template
    files = getattr(pool.tokenizer, "files", None)
    try:
        if files is None or chat_template(files) is None:
            return False
    except NoChatTemplate:                 # several templates, none named default: chat requests say so (400)
        return False
    except ChatError as exc:
        raise ValueError(str(exc)) from None
    try:
        pool.run([{"chat": PROBE}])
    except ApiError as exc:
        raise ValueError(f"the model's chat template cannot serve the conversation {PROBE}: {exc.message}") from None
    return True


def _frame(header: dict) -> bytes:
    from io import BytesIO
    buf = BytesIO()
    write_frame(buf, header)
    return buf.getvalue()


def _read_exact(fd: int, n: int, deadline: float) -> bytes:
    """Read n bytes from a pipe by the deadline: TimeoutError past it, EOFError when the writer is gone."""
    chunks, got = [], 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise TimeoutError
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            raise EOFError("its output closed")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _kill(proc: subprocess.Popen) -> None:
    """Kill a child and reap it (closing our ends of its pipes)."""
    if proc.poll() is None:
        proc.kill()
    try:
        proc.wait(5.0)
    except subprocess.TimeoutExpired:
        pass
    for pipe in (proc.stdin, proc.stdout):
        try:
            pipe.close()
        except OSError:
            pass


def _ended(proc: subprocess.Popen, exc: BaseException) -> str:
    """How a child ended, in words: its signal or exit status, else the error that showed it."""
    try:
        code = proc.wait(2.0)
    except subprocess.TimeoutExpired:
        return f"{type(exc).__name__}: {exc}"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def _what(jobs: list[dict]) -> str:
    if any("chat" in j for j in jobs):
        return "rendering the messages with the model's chat template and tokenizing them"
    return "tokenizing the prompt" if len(jobs) == 1 else f"tokenizing the {len(jobs)} prompts"


def _param(jobs: list[dict]) -> str:
    return "messages" if any("chat" in j for j in jobs) else "prompt"


def _raise(error: Any) -> NoReturn:
    """Raise the ApiError a child reported (its words checked: status 400 or 500, one line of text)."""
    if not isinstance(error, dict):
        raise ApiError(500, "a prompt worker answered an error without a message", type="server_error")
    status = error.get("status") if error.get("status") in (400, 500) else 500
    message = " ".join(str(error.get("message", "")).split())[:2000]
    param = error.get("param") if isinstance(error.get("param"), str) else None
    if status == 500:
        trace = str(error.get("traceback", ""))[:20000]
        print(f"hpcpipe: [http] error: a prompt worker failed: {message}\n{trace}", file=sys.stderr, flush=True)
        raise ApiError(500, f"the server failed preparing this request's prompt ({message.split(':')[0]})",
                       type="server_error")
    raise ApiError(400, message, param)

