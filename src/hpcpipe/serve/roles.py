"""What each rank does while serving: the first stage of a replica (``Head``) and the stages after it (``Follower``).

A replica is a ring: the head embeds the new tokens of one micro-batch group
and runs its blocks, each follower runs its blocks, the last stage samples
one token per sequence and sends the tokens back to the head, which hands
them to its scheduler and reports them to the front end. Every ``step`` is
non-blocking (it returns whether it did anything), so one loop per rank can
serve MPI, the scheduler and, on world rank 0, the front end on one thread.
The messages (``Work`` + activations, ``Idle``, ``StopPipeline`` down the ring,
``Result`` back to the head) are those of hpcpipe.serve.protocol.

Each role notes when it last made progress (``progress_at``) and whether work
is pending: the head knows from its scheduler, a following stage from the
head's messages (pending from a Work until an Idle). The watchdog of
serve and generate (hpcpipe.serve.stall) fires on a rank whose pending work
has not moved for run.stall_timeout seconds, never on an idle one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from hpcpipe.nn.core.decode import DecodeStage, Segment
from hpcpipe.runtime.faults import step_sleep
from hpcpipe.serve.broker import Event
from hpcpipe.serve.protocol import Idle, PipeTag, Result, StopPipeline, Work, from_rows, receive, send, to_rows
from hpcpipe.serve.quiet_log import RateLimitedLog
from hpcpipe.serve.sampling import Sampler, SamplingParams
from hpcpipe.serve.scheduler import FAILED, ReplicaScheduler


class SamplerTable:
    """One sampler per KV-cache slot on the last stage, restarted when a new sequence takes the slot."""

    def __init__(self, to_host: Callable[[Any], np.ndarray], vocab: int | None = None):
        self.to_host = to_host
        self.vocab = vocab        # sample only ids the tokenizer can decode (a model may have more)
        self.samplers: dict[int, Sampler] = {}
        self.log = RateLimitedLog()

    def start(self, new: list[tuple[int, SamplingParams]]) -> None:
        """Give each newly started sequence's slot a fresh sampler."""
        for slot, params in new:
            self.samplers[slot] = Sampler(params)

    def sample(self, logits: Any, segments: list[Segment], flags: list[bool]) -> list[int]:
        """Return the next token of each flagged segment's sequence from its logits row, -1 for the others.

        A prompt chunk that does not reach the end of its prompt is not sampled: its sequence's
        generator draws nothing, so the text never depends on how the prompt was chunked. A sequence
        whose token cannot be drawn (its logits are NaN) gets FAILED: it alone ends, with an error.
        """
        host = np.asarray(self.to_host(logits), dtype=np.float64)[:, :self.vocab]
        return [self._one(seg.slot, host[i]) if flag else -1
                for i, (seg, flag) in enumerate(zip(segments, flags, strict=True))]

    def _one(self, slot: int, logits: np.ndarray) -> int:
        try:
            return self.samplers[slot].next_token(logits)
        except Exception as exc:  # noqa: BLE001 - whatever went wrong, it went wrong for this sequence only
            self.log(f"hpcpipe: warning: slot {slot}: cannot sample the next token ({type(exc).__name__}: {exc}); "
                     f"that request alone ends with an error")
            return FAILED


def _count(role: Head | Follower) -> None:
    """Count a work item; raise the injected fault (HPCPIPE_FAULT) when this is the one it names.

    Under HPCPIPE_STEP_SLEEP the head sleeps before each item (tests keep requests in flight).
    """
    if isinstance(role, Head):
        step_sleep()
    if role.items == role.fault_at:
        raise RuntimeError(f"injected fault (HPCPIPE_FAULT) before work item {role.items}")
    role.items += 1


class Head:
    """First stage of a replica: its scheduler, its layers and, at pp = 1, the sampling too."""

    def __init__(self, stage: DecodeStage, scheduler: ReplicaScheduler, link: Any, pp: int, xp: Any,
                 samplers: SamplerTable, report: Callable[[list[Event]], None]):
        self.stage, self.scheduler, self.link, self.pp, self.xp = stage, scheduler, link, pp, xp
        self.samplers, self.report = samplers, report
        self.tokens_out = 0
        self.items = 0
        self.fault_at = -1       # test hook (HPCPIPE_FAULT): raise before this work item
        self.progress_at = time.monotonic()    # the last work item launched or result taken
        self.announced = False   # the following stages were sent Work since the last Idle

    def step(self) -> bool:
        """Take returned tokens, then launch the next group's work; return True if anything happened."""
        busy = False
        if self.pp > 1:
            while (got := receive(self.link, self.pp - 1, PipeTag.RESULT)) is not None:
                result = got[0]
                self._finish(result.group, result.tokens)
                busy = True
        item = self.scheduler.next_item()
        if item is None:
            if busy:
                self.progress_at = time.monotonic()
            if self.announced and self.scheduler.idle:
                send(self.link, 1, Idle())     # the following stages' watchdogs rest
                self.announced = False
            return busy
        _count(self)
        for slot in item.clear:
            self.stage.clear_slot(slot)
        out = self.stage.forward(item.tokens, item.segments)     # host ids: the stage checks them before copying
        if self.pp == 1:
            self.samplers.start(item.new)
            self._finish(item.group, self.samplers.sample(out, item.segments, item.sample))
        else:
            send(self.link, 1, Work(item.group, to_rows(item.segments), item.new, item.sample, item.clear), out)
            self.announced = True
        self.progress_at = time.monotonic()
        return True

    @property
    def pending(self) -> bool:
        """Whether sequences run, wait or are in flight here."""
        return not self.scheduler.idle

    def _finish(self, group: int, tokens: list[int]) -> None:
        self.tokens_out += sum(t >= 0 for t in tokens)
        self.report(self.scheduler.complete(group, tokens))

    def stop(self) -> None:
        """Tell the following stages to leave their loops; complete every send."""
        if self.pp > 1:
            send(self.link, 1, StopPipeline())
        self.link.flush()


class Follower:
    """Stage k >= 1 of a replica: run its layers on each arriving group; the last stage samples."""

    def __init__(self, stage: DecodeStage, link: Any, pp_rank: int, pp: int, samplers: SamplerTable):
        self.stage, self.link, self.k, self.pp, self.samplers = stage, link, pp_rank, pp, samplers
        self.done = False
        self.items = 0
        self.fault_at = -1       # test hook (HPCPIPE_FAULT): raise before this work item
        self.pending = False     # the head has work in flight or waiting (from a Work until an Idle)
        self.progress_at = time.monotonic()    # the last message handled

    @property
    def last(self) -> bool:
        """True on the replica's last stage."""
        return self.k == self.pp - 1

    def step(self) -> bool:
        """Process one arriving message, if any; return True if one came."""
        got = receive(self.link, self.k - 1, PipeTag.WORK)
        if got is None:
            return False
        message, x, _ = got
        self.progress_at = time.monotonic()
        if not isinstance(message, Work):          # Idle or StopPipeline: hand it on, rest
            if not self.last:
                send(self.link, self.k + 1, message)
            self.pending = False
            if isinstance(message, StopPipeline):
                self.link.flush()
                self.done = True
            return True
        self.pending = True
        _count(self)
        work = from_rows(message.rows)
        for slot in message.clear:
            self.stage.clear_slot(slot)
        out = self.stage.forward(x, work)
        if self.last:
            self.samplers.start(message.new)
            send(self.link, 0, Result(message.group, self.samplers.sample(out, work, message.sample)))
        else:
            send(self.link, self.k + 1, message, out)
        return True
