"""What the last stage of a replica does with its logits: sample, mask by a grammar, report log-probabilities.

Roughly, per work item (one forward of a micro-batch group)::

    rows = each segment's last row, then the echo rows, then the rows of each speculating segment but its last
                                                             (logit_rows; None: the last rows only)
    logits = forward over the segments, head applied to rows  (forward_rows)
    for each flagged segment: mask = its grammar's next ids  (Constraint; none: every id)
                              token = its sampler on logits[last row] + mask
                              entry = log-softmax32 of logits[last row] at token, top k   (when asked)
    for each echo block: the prompt tokens' entries from their rows' logits
    for each speculating segment: its sampler draws from its rows in order while the draws equal the
                                  proposals (hpcpipe.serve.speculate): every token drawn is kept

The forward of a decode stage returns the logits of each segment's last row only; a request with ``echo``
and ``logprobs`` needs the rows of its prompt too. ``forward_rows`` asks the stage for exactly those rows:
it hands the stage's own plan of the call the row indices to apply the head to, so no row is computed
twice and a work item without echo costs what it did.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from hpcpipe.nn.core.decode import Segment
from hpcpipe.serve.grammar import Constraint
from hpcpipe.serve.logprobs import entries
from hpcpipe.serve.protocol import Detail, Draft, Echo
from hpcpipe.serve.quiet_log import RateLimitedLog
from hpcpipe.serve.sampling import Sampler, SamplingParams
from hpcpipe.serve.scheduler import FAILED


def logit_rows(segments: list[Segment], echo: list[Echo], drafts: list[Draft] = ()) -> list[int] | None:
    """Rows of a forward call whose logits the last stage needs: each segment's last, then the echo rows in order,
    then each speculating segment's rows but its last (those verify its proposals).

    None when there is neither: the forward's own choice (each segment's last row) is what sampling needs.
    """
    if not echo and not drafts:
        return None
    ends = np.cumsum([s.length for s in segments])
    rows = [int(e) - 1 for e in ends]
    for index, offset, targets in echo:
        first = int(ends[index]) - segments[index].length + offset
        rows.extend(range(first, first + len(targets)))
    for index, proposed in drafts:
        first = int(ends[index]) - segments[index].length
        rows.extend(range(first, first + len(proposed)))
    return rows


def forward_rows(stage: Any, x: Any, segments: list[Segment], rows: list[int] | None) -> Any:
    """``stage.forward(x, segments)``, the head applied to ``rows`` of the call instead of each segment's last."""
    if rows is None:
        return stage.forward(x, segments)
    if hasattr(stage, "forward_rows"):              # a tensor-parallel stage's tp rank 0 (serve.tp_stage)
        return stage.forward_rows(x, segments, rows)
    return stage.forward(x, segments, rows=rows) if stage.has_head else stage.forward(x, segments)


class SamplerTable:
    """One sampler (and grammar, when asked) per KV-cache slot on the last stage, restarted with each new sequence."""

    def __init__(self, to_host: Callable[[Any], np.ndarray], vocab: int | None = None, tokenizer: Any = None):
        self.to_host = to_host
        self.vocab = vocab        # sample only ids the tokenizer can decode (a model may have more)
        self.tokenizer = tokenizer
        self.samplers: dict[int, Sampler] = {}
        self.constraints: dict[int, Constraint | Exception] = {}
        self.log = RateLimitedLog()

    def start(self, new: list[tuple[int, SamplingParams]]) -> None:
        """Give each newly started sequence's slot a fresh sampler (and its grammar's matcher)."""
        for slot, params in new:
            self.samplers[slot] = Sampler(params)
            self.constraints.pop(slot, None)
            if params.grammar:
                try:
                    self.constraints[slot] = Constraint(params.grammar, self.tokenizer, self.vocab)
                except Exception as exc:  # noqa: BLE001 - the library's refusal fails this request alone
                    self.constraints[slot] = exc

    def sample(self, logits: Any, segments: list[Segment], flags: list[bool]) -> list[int]:
        """Return the next token of each flagged segment's sequence from its logits row, -1 for the others."""
        return self.pick(logits, segments, flags)[0]

    def pick(self, logits: Any, segments: list[Segment], flags: list[bool], echo: list[Echo] = (),
             drafts: list[Draft] = ()) -> tuple[list[int], dict[int, Detail], dict[int, list[int]]]:
        """Return (a token per segment: -1 where not sampled, FAILED where that request fails; details by segment).

        ``logits`` holds each segment's last row, then the echo rows (:func:`logit_rows`). A prompt chunk
        that does not reach the end of its prompt is not sampled: its sequence's generator draws nothing,
        so the text never depends on how the prompt was chunked. A sequence whose token cannot be drawn
        (its logits are NaN, its grammar failed) gets FAILED: it alone ends, with an error.
        """
        raw = np.asarray(self.to_host(logits))[:, :self.vocab]
        tokens, details, spec = [], {}, {}
        speculating = {index for index, _ in drafts}
        for i, (seg, flag) in enumerate(zip(segments, flags, strict=True)):
            # a speculating segment draws from its first row first: below, once the echo rows are passed
            token, detail = self._one(seg.slot, raw[i]) if flag and i not in speculating else (-1, None)
            tokens.append(token)
            if detail is not None:
                details[i] = detail
        at = len(segments)
        for index, _, targets in echo:
            block = raw[at:at + len(targets)]
            at += len(targets)
            if tokens[index] == FAILED:
                continue
            sampler = self.samplers.get(segments[index].slot)
            got = entries(block, targets, sampler.params.logprobs) if sampler is not None else None
            if got is None:
                self._fail(segments[index].slot, "its prompt's logits are not finite")
                tokens[index] = FAILED
                details.pop(index, None)
                continue
            _, entry, done = details.get(index, (None, None, False))
            details[index] = (got, entry, done)
        for index, proposed in drafts:
            block = raw[at:at + len(proposed)]
            at += len(proposed)
            kept = self._verify(segments[index].slot, list(block) + [raw[index]], proposed)
            tokens[index] = kept[0] if kept[-1] != FAILED else FAILED
            if tokens[index] != FAILED:
                spec[index] = kept
        return tokens, details, spec

    def _verify(self, slot: int, rows: list[np.ndarray], proposed: list[int]) -> list[int]:
        """Draw from ``rows`` in order while each draw equals the proposal; every draw is kept (FAILED ends it)."""
        kept = []
        for j, row in enumerate(rows):
            token, _ = self._one(slot, row)
            kept.append(token)
            if token == FAILED or j == len(proposed) or token != proposed[j]:
                break
        return kept

    def _one(self, slot: int, raw: np.ndarray) -> tuple[int, Detail | None]:
        try:
            sampler = self.samplers[slot]
            constraint = self.constraints.get(slot)
            if isinstance(constraint, Exception):
                raise constraint
            z = np.asarray(raw, dtype=np.float64)
            if constraint is not None:
                z = np.where(constraint.allowed(), z, -np.inf)     # NaN stays NaN: still refused below
            token = sampler.next_token(z)
            entry = None
            if sampler.params.logprobs >= 0:
                got = entries(raw[None], [token], sampler.params.logprobs)
                if got is None:
                    raise ValueError("its logits are not finite")
                entry = got[0]
            if constraint is None:
                return token, None if entry is None else (None, entry, False)
            constraint.accept(token)
            return token, (None, entry, constraint.done)
        except Exception as exc:  # noqa: BLE001 - whatever went wrong, it went wrong for this sequence only
            self._fail(slot, f"{type(exc).__name__}: {exc}")
            return FAILED, None

    def _fail(self, slot: int, why: str) -> None:
        self.log(f"hpcpipe: warning: slot {slot}: cannot sample the next token ({why}); that request alone ends "
                 f"with an error")
