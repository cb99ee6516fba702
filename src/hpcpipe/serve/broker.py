"""The only channel between the HTTP front end (its own thread and event loop) and the engine (MPI main thread).

Contract for the engine, which polls without blocking between decode steps:

- ``take()`` returns the requests submitted since the last call and the ids cancelled since the last call.
  A cancelled id leaves the outstanding count when ``take()`` hands it over: the engine frees its slot
  before the next step and need not report on it again (events for ids the broker no longer knows are
  dropped, so an event racing the cancel is harmless). A request cancelled before the engine took it is
  simply never handed over. A cancelled id may name a request the engine has just finished (the final
  event and the cancel crossed): the engine ignores ids it does not hold.
- ``deliver(events)`` forwards each event to the sink of its request; the first event whose ``finish``
  is not None ends the request (removes it from the outstanding count). Every request the engine took
  and that was not cancelled must end with exactly one final event.
- ``set_running(n)`` reports how many sequences the engine has admitted (the rest of the outstanding
  requests are waiting: the queue depth shown by /metrics). ``running`` never counts more than the requests
  the engine took that are still outstanding and not cancelled, so it is settled the moment a final event or a
  cancel ends a request, before its response completes (the engine's next report may come a step later).
- ``set_ready()``: every rank has loaded its stage (a broker made with ``ready=False`` answers /health 503
  "starting" until then; the port is bound before the stages load).
- ``progressed(at)`` records when the engine's pending work last moved (time.monotonic(); the engine
  calls it every loop round, with the current time while nothing is pending there). ``stalled_for()``
  is how long ago that was while requests are outstanding (0 when none are): /health turns 503 on it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from hpcpipe.serve.sampling import SamplingParams

FINISH_REASONS = ("stop", "length", "cancelled", "error")


@dataclass
class Request:
    """One sequence to generate: a prompt of token ids and how to sample up to max_new tokens after it."""

    id: str                  # e.g. "cmpl-<hex>-<choice index>"
    prompt: list[int]        # token ids (non-empty)
    max_new: int             # tokens to generate at most (0: only the prompt's log-probabilities, echo)
    params: SamplingParams
    created: float           # time.monotonic() at arrival


@dataclass(slots=True)
class Event:
    """What the engine reports for one request: new token ids and, on the last event, why it finished."""

    request_id: str
    tokens: list[int]        # new token ids (may be empty when only finishing)
    finish: str | None       # None (more to come), "stop" (an end-of-sequence id, or its grammar is complete),
    #                          "length" (max_new or context full), "cancelled", "error"
    # when the request asked for logprobs: one (id, log-probability, top alternatives) per token of ``tokens``
    logprobs: list | None = None
    # with echo and logprobs, once, on the request's first event: the same for the prompt's tokens after the first
    prompt_logprobs: list | None = None

    def __reduce__(self) -> tuple[type, tuple]:
        # every step's events travel to rank 0 (hpcpipe.serve.protocol.Events): pickled as values, a third faster
        return Event, (self.request_id, self.tokens, self.finish, self.logprobs, self.prompt_logprobs)


class QueueFull(Exception):
    """The broker already holds its capacity of outstanding requests (the HTTP answer is 429)."""


class Closed(Exception):
    """The broker no longer accepts requests (the server is draining; the HTTP answer is 503)."""


class _Entry:
    """Bookkeeping of one outstanding request: where its events go and whether the engine has it."""

    __slots__ = ("sink", "loop", "taken")

    def __init__(self, sink: Callable[[Event], None], loop: asyncio.AbstractEventLoop | None):
        self.sink, self.loop = sink, loop
        self.taken = False


class Broker:
    """The only channel between the HTTP thread(s) and the engine's MPI thread; every method is thread-safe."""

    def __init__(self, capacity: int, ready: bool = True):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"broker: capacity must be an integer >= 1, got {capacity!r}")
        self.capacity = capacity
        self._ready = bool(ready)
        # Reentrant: a SIGTERM handler calling close() runs on the main (engine) thread, possibly while
        # that thread is inside take() or deliver() holding the lock.
        self._lock = threading.RLock()
        self._entries: dict[str, _Entry] = {}
        self._new: list[Request] = []
        self._cancelled: list[str] = []
        self._running = 0
        self._stats: tuple[int, ...] = ()
        self._closed: str | None = None
        self._progress_at = time.monotonic()

    # ---- HTTP side -------------------------------------------------------------------------------------

    def submit(self, requests: list[Request], sink: Callable[[Event], None]) -> None:
        """Queue all requests or none: QueueFull beyond capacity, Closed once closed, ValueError on a reused id.

        sink(event) is called for each event of these requests. When submit is called from a thread that
        runs an asyncio event loop (the HTTP handlers), sink runs on that loop via call_soon_threadsafe;
        otherwise it runs directly on the thread that calls deliver().
        """
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        with self._lock:
            if self._closed is not None:
                raise Closed(self._closed)
            ids = [r.id for r in requests]
            if len(set(ids)) != len(ids) or any(i in self._entries for i in ids):
                raise ValueError(f"broker: request ids must be unique, got {ids}")
            empty = [r.id for r in requests if not r.prompt]
            if empty:    # it could never start: it would hold its place until the watchdog aborted the server
                raise ValueError(f"broker: request {empty[0]} has an empty prompt")
            if len(self._entries) + len(requests) > self.capacity:
                raise QueueFull(f"{len(self._entries)} requests outstanding; capacity {self.capacity}")
            for r in requests:
                self._entries[r.id] = _Entry(sink, loop)
            self._new.extend(requests)

    def cancel(self, request_id: str) -> None:
        """Tell the engine to drop a request (client gone, stop string seen); no more events reach its sink."""
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is None or entry.sink is _drop:
                return
            if entry.taken:
                self._cancelled.append(request_id)
                entry.sink = _drop
            else:
                del self._entries[request_id]
                self._new = [r for r in self._new if r.id != request_id]

    # ---- engine side (never blocks on the HTTP side) ----------------------------------------------------

    def take(self) -> tuple[list[Request], list[str]]:
        """Return the requests submitted and the (taken) request ids cancelled since the last call."""
        with self._lock:
            new, self._new = self._new, []
            cancelled, self._cancelled = self._cancelled, []
            for r in new:
                self._entries[r.id].taken = True
            for i in cancelled:
                self._entries.pop(i, None)
            return new, cancelled

    def deliver(self, events: list[Event]) -> None:
        """Forward each event to its request's sink; a final event (finish not None) ends the request."""
        bad = [ev.finish for ev in events if ev.finish is not None and ev.finish not in FINISH_REASONS]
        if bad:
            raise ValueError(f"broker: event finish must be None or one of {FINISH_REASONS}, got {bad[0]!r}")
        direct, by_loop = [], {}
        with self._lock:
            for ev in events:
                entry = self._entries.get(ev.request_id)
                if entry is None or not entry.taken or entry.sink is _drop:
                    continue          # cancelled or already finished: the client no longer listens
                if ev.finish is not None:
                    del self._entries[ev.request_id]
                if entry.loop is None:
                    direct.append((entry.sink, ev))
                else:
                    by_loop.setdefault(entry.loop, []).append((entry.sink, ev))
        # Outside the lock (a sink may call back into the broker); one wake-up per event loop and step.
        for loop, calls in by_loop.items():
            try:
                loop.call_soon_threadsafe(_run_sinks, calls)
            except RuntimeError:      # the loop is closed: the server stopped, nobody listens any more
                pass
        _run_sinks(direct)

    def set_running(self, n: int) -> None:
        """Record the engine's count of admitted sequences (for the queue depth in /metrics)."""
        with self._lock:
            self._running = int(n)

    def set_ready(self) -> None:
        """Record that the engine serves (every rank loaded its stage): /health may answer ok."""
        with self._lock:
            self._ready = True

    def set_engine_stats(self, stats: tuple[int, ...]) -> None:
        """Record the engine's KV-block, prefix-cache and speculation numbers (hpcpipe.serve.engine_stats)."""
        with self._lock:
            self._stats = tuple(stats)

    @property
    def engine_stats(self) -> tuple[int, ...]:
        """The engine's last reported numbers (empty before the first report)."""
        with self._lock:
            return self._stats

    def progressed(self, at: float | None = None) -> None:
        """Record that the engine's pending work last moved at ``at`` (time.monotonic(); default now)."""
        with self._lock:
            self._progress_at = time.monotonic() if at is None else float(at)

    def close(self, reason: str) -> None:
        """Stop accepting: later submits raise Closed(reason); requests already outstanding carry on."""
        with self._lock:
            if self._closed is None:
                self._closed = str(reason)

    # ---- state ------------------------------------------------------------------------------------------

    @property
    def outstanding(self) -> int:
        """Requests submitted and not yet finished or cancelled (running + waiting)."""
        with self._lock:
            return len(self._entries)

    @property
    def running(self) -> int:
        """Sequences the engine decodes: its last report, at most the requests it took that are still outstanding."""
        with self._lock:
            return self._admitted()

    @property
    def queue_depth(self) -> int:
        """Outstanding requests the engine has not admitted yet."""
        with self._lock:
            live = sum(1 for e in self._entries.values() if e.sink is not _drop)
            return max(0, live - self._admitted())

    @property
    def ready(self) -> bool:
        """Whether the engine serves yet (see set_ready)."""
        with self._lock:
            return self._ready

    def _admitted(self) -> int:
        # Settled before a response completes, whenever the engine's next set_running comes: a final event removes
        # its entry before its sink runs, and a cancel (a stop string seen, the client gone) drops its sink before
        # the response ends; the engine's last report still counts a cancelled sequence (it was decoding) until
        # it frees it, so those are taken off it.
        dropped = [e.sink is _drop for e in self._entries.values() if e.taken]
        return max(0, min(self._running - sum(dropped), len(dropped) - sum(dropped)))

    def stalled_for(self) -> float:
        """Seconds since the engine's pending work last moved while requests are outstanding; 0 when none are."""
        with self._lock:
            if not self._entries:
                return 0.0
            return max(0.0, time.monotonic() - self._progress_at)

    @property
    def closed(self) -> str | None:
        """The reason given to close(), or None while accepting."""
        with self._lock:
            return self._closed


def _drop(event: Event) -> None:
    """Sink of a cancelled request: its events go nowhere."""


def _run_sinks(calls: list) -> None:
    """Call each sink with its event, in order."""
    for sink, ev in calls:
        sink(ev)
