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

from hpcpipe.nn.core.decode import DecodeStage
from hpcpipe.runtime.faults import step_sleep
from hpcpipe.serve.broker import Event
from hpcpipe.serve.last_stage import SamplerTable, forward_rows, logit_rows
from hpcpipe.serve.protocol import Idle, Join, PipeTag, Result, StopPipeline, Work, from_rows, receive, send, to_rows
from hpcpipe.serve.scheduler import ReplicaScheduler

__all__ = ["Follower", "Head", "SamplerTable"]


def apply_tables(stage: Any, pages: list, clear: list[int]) -> None:
    """Apply a work item's block-table updates and zero the KV blocks a failed sequence left, before its forward."""
    for slot, first, blocks in pages:
        stage.set_pages(slot, first, blocks)
    if clear:
        stage.clear_pages(clear)


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
                 samplers: SamplerTable, report: Callable[[list[Event]], None], lockstep: Any = None):
        self.stage, self.scheduler, self.link, self.pp, self.xp = stage, scheduler, link, pp, xp
        self.lockstep = lockstep     # expert parallelism: the ep group's heads step together (serve.ep_lockstep)
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
                self._finish(result.group, result.tokens, result.details, result.spec)
                busy = True
        item = self.scheduler.next_item()
        if self.lockstep is not None and self.lockstep.agree(item is not None) and item is None:
            self._join()
            return True
        if item is None:
            if busy:
                self.progress_at = time.monotonic()
            if self.announced and self.scheduler.idle:
                send(self.link, 1, Idle())     # the following stages' watchdogs rest
                self.announced = False
            return busy
        _count(self)
        apply_tables(self.stage, item.pages, item.clear)
        if self.pp == 1:
            # host ids: the stage checks them before copying
            out = forward_rows(self.stage, item.tokens, item.segments,
                               logit_rows(item.segments, item.echo, item.drafts))
            self.samplers.start(item.new)
            self._finish(item.group, *self.samplers.pick(out, item.segments, item.sample, item.echo, item.drafts))
        else:
            out = self.stage.forward(item.tokens, item.segments)
            send(self.link, 1, Work(item.group, to_rows(item.segments), item.new, item.sample, item.clear, item.echo,
                                    item.pages, item.drafts), out)
            self.announced = True
        self.progress_at = time.monotonic()
        return True

    def _join(self) -> None:
        """An ep peer launches work and this replica has none: exchange zero rows, and have every stage do so."""
        self.stage.join()
        if self.pp > 1:
            send(self.link, 1, Join())
        self.lockstep.joins += 1

    @property
    def pending(self) -> bool:
        """Whether sequences run, wait or are in flight here."""
        return not self.scheduler.idle

    def _finish(self, group: int, tokens: list[int], details: dict | None = None, spec: dict | None = None) -> None:
        spec = spec or {}
        self.tokens_out += sum(len(spec[i]) if i in spec else t >= 0 for i, t in enumerate(tokens))
        self.report(self.scheduler.complete(group, tokens, details, spec))

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
        if isinstance(message, Join):              # expert parallelism: an ep peer's step, no rows of this replica
            self.stage.join()
            if not self.last:
                send(self.link, self.k + 1, message)
            return True
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
        apply_tables(self.stage, message.pages, message.clear)
        if self.last:
            out = forward_rows(self.stage, x, work, logit_rows(work, message.echo, message.drafts))
            self.samplers.start(message.new)
            send(self.link, 0, Result(message.group, *self.samplers.pick(out, work, message.sample, message.echo,
                                                                         message.drafts)))
        else:
            out = self.stage.forward(x, work)
            send(self.link, self.k + 1, message, out)
        return True
