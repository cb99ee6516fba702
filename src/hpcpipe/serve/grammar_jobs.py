"""Compiling a request's response_format off the HTTP event loop, within a time limit, two at a time.

llguidance compiles a schema in time that grows with its size, faster than linearly: 1,000 optional properties
take about 0.2 s, 3,000 about 2 s, 6,000 from 6 to 20 s on the 2-core VM (patternProperties cost more: 200 of them
about 2 s). Compiled on the event loop, one such request stalled every client for that long, and the last stage
compiled it again for each choice while every sequence waited. Here a compile runs in a daemon thread (the library
lets other threads run meanwhile); past ``limits["grammar_ms"]`` the request is a 400 naming the limit, so a schema
the last stage compiles (once: hpcpipe.serve.grammar keeps the last few compiled) is one that compiled within it
here. A thread cannot be stopped: one past its limit runs on, and at most two run at once, so such requests cost
at most two cores; while two run, a new schema waits for one within its own limit (then 429: retry later).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from hpcpipe.serve.api_error import ApiError
from hpcpipe.serve.request_options import compile_checked

COMPILERS = 2            # compiles running at once (one that ran past its limit still counts until it ends)


class GrammarCompiler:
    """Compile response_formats in daemon threads, at most ``COMPILERS`` at once, each within ``limit_ms``."""

    def __init__(self, tokenizer: Any, limit_ms: int):
        self.tokenizer, self.limit_s = tokenizer, limit_ms / 1000
        self._slots: asyncio.Semaphore | None = None     # made on the event loop, released from the threads

    async def grammar(self, response_format: Any) -> str:
        """Return the grammar of response_format ("" for None); ApiError 400 (refused, or not compiled within the
        limit) or 429 (both compilers busy for the whole limit)."""
        if response_format is None:
            return ""
        loop = asyncio.get_running_loop()
        if self._slots is None:
            self._slots = asyncio.Semaphore(COMPILERS)
        deadline = loop.time() + self.limit_s
        try:
            await asyncio.wait_for(self._slots.acquire(), self.limit_s)
        except TimeoutError:
            raise ApiError(429, f"the server is compiling {COMPILERS} other response_format schemas; retry "
                                f"later", type="requests", code="rate_limit_exceeded") from None
        done: asyncio.Future = loop.create_future()
        try:
            threading.Thread(target=self._run, args=(response_format, loop, done), name="hpcpipe-grammar",
                             daemon=True).start()
        except BaseException:
            self._slots.release()
            raise
        try:
            return await asyncio.wait_for(done, max(0.0, deadline - loop.time()))
        except TimeoutError:
            raise ApiError(400, f"response_format: the schema did not compile within {self.limit_s:g} s (compiling "
                                f"grows faster than the schema: thousands of properties take seconds); send a "
                                f"smaller schema", "response_format") from None

    def _run(self, response_format: Any, loop: asyncio.AbstractEventLoop, done: asyncio.Future) -> None:
        try:
            result, error = compile_checked(response_format, self.tokenizer), None
        except BaseException as exc:  # noqa: BLE001 - handed to the request (an ApiError, or a bug of ours: its 500)
            result, error = None, exc
        try:                     # the slot is free once the compile ends, whether anyone still waits for it
            loop.call_soon_threadsafe(_settle, self._slots, done, result, error)
        except RuntimeError:     # the event loop is closed: the server stopped, nobody waits for this
            pass


def _settle(slots: asyncio.Semaphore, done: asyncio.Future, result: Any, error: BaseException | None) -> None:
    slots.release()
    if done.done():              # the request gave up (its limit passed, or its client left)
        return
    if error is not None:
        done.set_exception(error)
    else:
        done.set_result(result)
