"""Stall detection of serve and generate: each rank tells its watchdog whether work is pending and when it last moved.

A server is idle most of the time, and an idle rank must never be aborted,
however long it waits (or stays stopped). So every rank's loop runs a
``Heartbeat`` step that reports one of two states to the rank's watchdog
(hpcpipe.runtime.watchdog): nothing pending (the clock does not run), or
work pending that last progressed at some time; the watchdog fires when that
time is run.stall_timeout seconds old (stacks dumped, exit 76). A pending
stretch starts the clock afresh: progress made long before the work arrived
does not count against it.

What "pending" and "progress" mean per role (hpcpipe.serve.roles):

    head of a replica     its scheduler holds sequences      a work item launched or a result taken
    following stage       the head sent Work, not Idle       a message handled
    world rank 0          any replica holds requests         that replica's messages arriving: tokens, or
                                                              a heartbeat when its head moved without any
                                                              (the oldest such time over the busy replicas)

World rank 0 also publishes its time to the broker, from which the HTTP
thread's /health answers 503 once pending work has not moved for a quarter of
run.stall_timeout (hpcpipe.serve.broker.Broker.stalled_for).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


class Heartbeat:
    """A loop step that tells the watchdog whether work is pending here and when it last progressed."""

    def __init__(self, watchdog: Any, pending: Callable[[], bool], last: Callable[[], float], phase: str,
                 publish: Callable[[float], None] | None = None):
        self.watchdog, self.pending, self.last, self.phase, self.publish = watchdog, pending, last, phase, publish
        self.resting = f"{phase}: idle (nothing pending)"
        self.since: float | None = None      # when the current pending stretch began

    def __call__(self) -> bool:
        """Report the state; never counts as work (the loop's sleeping is unchanged)."""
        if not self.pending():
            self.since = None
            self.watchdog.idle(self.resting)
            if self.publish is not None:
                self.publish(time.monotonic())
            return False
        if self.since is None:
            self.since = time.monotonic()
        at = max(self.last(), self.since)
        self.watchdog.progressed(self.phase, at)
        if self.publish is not None:
            self.publish(at)
        return False
