"""One POST /v1/completions in flight: the engine's events of its requests -> text deltas, finish reasons,
usage and latency metrics. Runs on the HTTP event loop (the broker calls on_event there)."""

from __future__ import annotations

import asyncio
import time

from hpcpipe.serve.broker import Broker, Event, Request
from hpcpipe.serve.metrics import Metrics
from hpcpipe.serve.textstream import TextStream


class _Choice:
    """Progress of one request (one prompt of the list)."""

    __slots__ = ("request", "stream", "tokens", "last_arrival", "finish")

    def __init__(self, request: Request, stream: TextStream):
        self.request, self.stream = request, stream
        self.tokens = 0
        self.last_arrival: float | None = None
        self.finish: str | None = None


class Completion:
    """The choices of one HTTP request; on_event turns engine events into (index, text, finish) items."""

    def __init__(self, requests: list[Request], tokenizer, stop: list[str], broker: Broker, metrics: Metrics):
        self._broker, self._metrics = broker, metrics
        self._choices = [_Choice(r, TextStream(tokenizer, stop)) for r in requests]
        self._index = {r.id: i for i, r in enumerate(requests)}
        self.items: asyncio.Queue = asyncio.Queue()
        self.failed = False

    def on_event(self, ev: Event) -> None:
        """Sink for the broker (called on the event loop): decode, check stop strings, record latencies."""
        i = self._index.get(ev.request_id)
        if i is None or self._choices[i].finish is not None:
            return
        try:
            text, finish = self._advance(self._choices[i], ev)
        except Exception:           # noqa: BLE001 - e.g. a token id outside the vocabulary: fail this
            # completion with a 500 instead of leaving its client waiting for an event that never comes.
            text, finish = "", "error"
            self._broker.cancel(self._choices[i].request.id)
        ch = self._choices[i]
        if finish == "error":
            self.failed = True
        ch.finish = finish
        if text or finish is not None:
            self.items.put_nowait((i, text, finish))

    def _advance(self, ch: _Choice, ev: Event) -> tuple[str, str | None]:
        """Return (new text, finish reason or None) after one event of this choice."""
        text, finish = "", None
        if ev.tokens:
            self._record_arrival(ch, len(ev.tokens))
            ch.tokens += len(ev.tokens)
            text = ch.stream.feed(ev.tokens)
            if ch.stream.stopped:
                finish = "stop"
                self._broker.cancel(ch.request.id)      # free the engine's slot now, not at max_tokens
        if finish is None and ev.finish in ("length", "stop"):    # "stop": the model's end-of-sequence token
            text += ch.stream.finish()
            finish = ev.finish
        elif finish is None and ev.finish is not None:   # "error", or a cancel this front end did not ask for
            finish = "error"
        return text, finish

    def _record_arrival(self, ch: _Choice, k: int) -> None:
        """TTFT for the first token; per token after it, the gap since the previous arrival.

        An event carrying k tokens counts as k arrivals at the same instant: one gap (or the TTFT),
        then k - 1 gaps of 0, which is what a streaming client sees.
        """
        now = time.monotonic()
        m = self._metrics
        m.add_generated_tokens(k)
        if ch.last_arrival is None:
            m.observe_ttft(now - ch.request.created)
        else:
            m.observe_inter_token(now - ch.last_arrival)
        for _ in range(k - 1):
            m.observe_inter_token(0.0)
        ch.last_arrival = now

    @property
    def done(self) -> bool:
        """Whether every choice has finished."""
        return all(ch.finish is not None for ch in self._choices)

    def cancel_unfinished(self) -> int:
        """Cancel every request whose choice has not finished (the client left); return how many."""
        left = [ch for ch in self._choices if ch.finish is None]
        for ch in left:
            ch.finish = "cancelled"
            self._broker.cancel(ch.request.id)
        return len(left)

    def texts(self) -> list[str]:
        """Return the whole text of each choice."""
        return [ch.stream.text for ch in self._choices]

    def finish_reasons(self) -> list[str | None]:
        """Return each choice's finish reason ("stop", "length", "error")."""
        return [ch.finish for ch in self._choices]

    def prompt_tokens(self) -> int:
        """Total prompt tokens over the choices."""
        return sum(len(ch.request.prompt) for ch in self._choices)

    def completion_tokens(self) -> int:
        """Total tokens the engine generated for the choices (up to the one that completed a stop string)."""
        return sum(ch.tokens for ch in self._choices)
