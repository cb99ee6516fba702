"""One POST /v1/completions in flight: the engine's events of its requests -> text deltas, log-probabilities,
finish reasons, usage and latency metrics. Runs on the HTTP event loop (the broker calls on_event there).

Each item handed to the response is ``(choice index, new text, finish reason or None, rows, offsets)``: the
log-probability rows of the tokens that event brought (hpcpipe.serve.token_text; None when the request asked
for none) and where each of those tokens starts in the choice's text. A token's row comes with the event
that brought it, even while its text is held back (part of a character, a possible stop string), as
OpenAI's and vLLM's streams do. With ``echo`` a choice's first item carries its prompt's text (and rows)
before the first new text.
"""

from __future__ import annotations

import asyncio
import time

from hpcpipe.serve.broker import Broker, Event, Request
from hpcpipe.serve.metrics import Metrics
from hpcpipe.serve.textstream import TextStream
from hpcpipe.serve.token_text import Offsets, TokenTexts, rows_of


class _Choice:
    """Progress of one request (one prompt of the list, one of its n choices)."""

    __slots__ = ("request", "stream", "tokens", "last_arrival", "finish", "echo", "echoed", "rows", "offsets",
                 "offset")

    def __init__(self, request: Request, stream: TextStream, echo: str | None):
        self.request, self.stream, self.echo = request, stream, echo
        self.echoed = echo is None         # the prompt's text was sent (or is not asked for)
        self.tokens = 0
        self.last_arrival: float | None = None
        self.finish: str | None = None
        self.rows: list | None = [] if request.params.logprobs >= 0 else None    # every row so far
        self.offsets: list[int] = []      # where each row's token starts in the text
        self.offset: Offsets | None = None


class Completion:
    """The choices of one HTTP request; on_event turns engine events into (index, text, finish, rows, offset) items.

    ``echo``: per choice, the prompt text to put before its text (None: no echo); ``n``: choices per prompt
    (the requests are n per prompt in order); ``texts``: token texts for the log-probabilities.
    """

    def __init__(self, requests: list[Request], tokenizer, stop: list[str], broker: Broker, metrics: Metrics,
                 echo: list[str] | None = None, n: int = 1, texts: TokenTexts | None = None):
        self._broker, self._metrics, self._n, self._texts = broker, metrics, n, texts
        echo = echo or [None] * len(requests)
        self._choices = [_Choice(r, TextStream(tokenizer, stop), e) for r, e in zip(requests, echo, strict=True)]
        self._index = {r.id: i for i, r in enumerate(requests)}
        self.items: asyncio.Queue = asyncio.Queue()
        self.failed = False

    def on_event(self, ev: Event) -> None:
        """Sink for the broker (called on the event loop): decode, check stop strings, record latencies."""
        i = self._index.get(ev.request_id)
        if i is None or self._choices[i].finish is not None:
            return
        ch = self._choices[i]
        rows, offsets = None, None
        try:
            text, finish = self._advance(ch, ev)
            rows, offsets = self._rows(ch, ev)
        except Exception:           # noqa: BLE001 - e.g. a token id outside the vocabulary: fail this
            # completion with a 500 instead of leaving its client waiting for an event that never comes.
            text, finish = "", "error"
            self._broker.cancel(ch.request.id)
        if not ch.echoed and finish != "error":
            text, ch.echoed = ch.echo + text, True      # the prompt's text first, once
        if finish == "error":
            self.failed = True
        ch.finish = finish
        if text or finish is not None or rows:
            self.items.put_nowait((i, text, finish, rows, offsets))

    def _rows(self, ch: _Choice, ev: Event) -> tuple[list | None, list[int] | None]:
        """The log-probability rows this event brings (the prompt's first, with echo) and their text offsets;
        (None, None) if none were asked for."""
        if ch.rows is None:
            return None, None
        prompt = ch.request.prompt if ev.prompt_logprobs is not None else None
        if len(ev.logprobs or ()) != len(ev.tokens):
            raise ValueError(f"event of {ev.request_id}: {len(ev.tokens)} tokens but log-probabilities for "
                             f"{len(ev.logprobs or ())}")
        rows = rows_of(ev.prompt_logprobs, prompt) + rows_of(ev.logprobs)
        if ch.offset is None:
            ch.offset = Offsets(self._texts)
        offsets = ch.offset.of(rows)
        ch.rows.extend(rows)
        ch.offsets.extend(offsets)
        return rows, offsets

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
        """Return the whole text of each choice (after its prompt's, with echo)."""
        return [(ch.echo or "") + ch.stream.text for ch in self._choices]

    def logprobs(self) -> list[tuple[list, list[int]] | None]:
        """Return each choice's log-probability rows and their text offsets (None where none were asked for)."""
        return [None if ch.rows is None else (ch.rows, ch.offsets) for ch in self._choices]

    def finish_reasons(self) -> list[str | None]:
        """Return each choice's finish reason ("stop", "length", "error")."""
        return [ch.finish for ch in self._choices]

    def prompt_tokens(self) -> int:
        """Total prompt tokens over the prompts (each counted once, whatever its n)."""
        return sum(len(ch.request.prompt) for ch in self._choices[::self._n])

    def completion_tokens(self) -> int:
        """Total tokens the engine generated for the choices (up to the one that completed a stop string)."""
        return sum(ch.tokens for ch in self._choices)
