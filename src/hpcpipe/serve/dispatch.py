"""The front end's side of the engine on world rank 0, and the control inbox of every other replica's head.

dp replicas are independent pipelines behind one front end. The dispatcher
takes new requests and cancellations from a source (the HTTP broker, or the
one prompt of ``generate``), sends each request to the replica with the
fewest outstanding requests, and passes the replicas' token events back::

    source (HTTP thread) --take--> Dispatcher (rank 0) --("submit"|"cancel"|"stop")--> head of replica d
    source <--deliver-- Dispatcher <--("events", d, [Event], running)-- head of replica d

A replica's head that has moved (a chunk of a long prompt sent or taken back)
without producing tokens tells rank 0 so with an empty "events" message, at
most every ``beat_s``: rank 0's watchdog and /health judge every replica by its
last message, and a prefill that yields no token for a while is not a stall.

Replica 0's head lives on rank 0 itself and is called directly. A stop
signal on any rank reaches rank 0 as ("drain", name): the source stops
accepting, the requests in flight finish, then every replica is stopped.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from hpcpipe.serve.broker import Event, Request
from hpcpipe.serve.scheduler import ReplicaScheduler

ANY = None         # any source rank (Mailbox.poll)
TAG_CTRL = 31      # rank 0 -> replica head
TAG_EVENTS = 33    # replica head -> rank 0
TAG_DRAIN = 35     # any rank -> rank 0: a stop signal arrived here


class Source(Protocol):
    """Where requests come from and events go (thread-safe on the HTTP side)."""

    outstanding: int      # requests given to the engine or about to be, not yet finished
    closed: bool          # no more requests will come

    def take(self) -> tuple[list[Request], list[str]]: ...
    def deliver(self, events: list[Event]) -> None: ...
    def set_running(self, n: int) -> None: ...
    def close(self, reason: str) -> None: ...
    def progressed(self, at: float) -> None: ...


class Dispatcher:
    """Routes requests to replicas and events back to the source (world rank 0 only)."""

    def __init__(self, source: Source, box: Any, dp: int, pp: int, local: ReplicaScheduler, tp: int = 1):
        self.source, self.box, self.dp, self.pp, self.local = source, box, dp, pp, local
        self.head_stride = pp * tp      # world rank of replica r's head (its first stage's tp rank 0): r * pp * tp
        self.owner: dict[str, int] = {}
        self.load = [0] * dp
        self.running = [0] * dp
        self.draining = ""          # why the source was closed ("" while open)
        self.drains = 0             # drain requests received from other ranks
        self.moved = [time.monotonic()] * dp    # per replica: its last tokens, or when it last became busy

    def drain(self, reason: str) -> None:
        """Stop accepting requests; the loop ends once those in flight have finished."""
        if not self.draining:
            self.draining = reason
            self.source.close(reason)

    def step(self) -> bool:
        """Route new requests and cancellations, pass events back; return True if anything happened."""
        new, cancels = self.source.take()
        for request in new:
            replica = min(range(self.dp), key=lambda d: self.load[d])
            if not self.load[replica]:
                self.moved[replica] = time.monotonic()     # its clock starts with its work
            self.load[replica] += 1
            self.owner[request.id] = replica
            if replica == 0:
                self.local.submit(request)
            else:
                self.box.post(replica * self.head_stride, TAG_CTRL, ("submit", request))
        for request_id in cancels:
            replica = self.owner.get(request_id)
            if replica == 0:
                self.deliver(0, self.local.cancel(request_id), self.local.running)
            elif replica is not None:
                self.box.post(replica * self.head_stride, TAG_CTRL, ("cancel", request_id))
        busy = bool(new or cancels)
        while (message := self.box.poll(ANY, TAG_EVENTS)) is not None:
            _, replica, events, running = message[0]
            self.deliver(replica, events, running, moved=True)     # an empty one: its head moved
            busy = True
        while (message := self.box.poll(ANY, TAG_DRAIN)) is not None:
            self.drains += 1
            self.drain(message[0][1])
            busy = True
        return busy

    def collect_drains(self, sent: int) -> None:
        """Receive the drain requests still on their way (``sent`` in all), so none is left unmatched."""
        while self.drains < sent:
            message = self.box.poll(ANY, TAG_DRAIN)
            if message is None:
                time.sleep(self.box.poller.min_s)
                continue
            self.drains += 1

    def deliver(self, replica: int, events: list[Event], running: int, moved: bool = False) -> None:
        """Pass a replica's events to the source and keep the load counts (``moved``: it progressed anyway)."""
        for event in events:
            if event.finish is not None and self.owner.pop(event.request_id, None) is not None:
                self.load[replica] -= 1
        self.running[replica] = running
        if events or moved:
            self.moved[replica] = time.monotonic()
        if events:
            self.source.deliver(events)
        self.source.set_running(sum(self.running))

    @property
    def pending(self) -> bool:
        """Whether any replica holds requests of the source."""
        return any(self.load)

    def moved_at(self, local: float) -> float:
        """When the least recently moving busy replica last moved (replica 0's head here moved at ``local``)."""
        busy = [max(self.moved[d], local) if d == 0 else self.moved[d] for d in range(self.dp) if self.load[d]]
        return min(busy) if busy else time.monotonic()

    @property
    def finished(self) -> bool:
        """True once draining and nothing is outstanding anywhere."""
        return (bool(self.draining) or self.source.closed) and not self.owner and self.source.outstanding == 0

    def stop(self) -> None:
        """Tell every other replica's head to stop (after :attr:`finished`)."""
        for replica in range(1, self.dp):
            self.box.post(replica * self.head_stride, TAG_CTRL, ("stop",))


class Controller:
    """The control inbox of a replica head that is not world rank 0: requests in, events out."""

    def __init__(self, box: Any, scheduler: ReplicaScheduler, replica: int,
                 moved_at: Callable[[], float] | None = None, beat_s: float = 1.0):
        self.box, self.scheduler, self.replica = box, scheduler, replica
        self.moved_at, self.beat_s = moved_at, beat_s      # when the replica's head last moved
        self.pending: list[Event] = []
        self.stopping = False
        self.sent_at = time.monotonic()

    def report(self, events: list[Event]) -> None:
        """Queue events for rank 0 (sent by :meth:`flush`)."""
        self.pending.extend(events)

    def step(self) -> bool:
        """Apply control messages from rank 0; return True if any came."""
        busy = False
        while (message := self.box.poll(0, TAG_CTRL)) is not None:
            header = message[0]
            if header[0] == "submit":
                self.scheduler.submit(header[1])
            elif header[0] == "cancel":
                self.report(self.scheduler.cancel(header[1]))
            else:
                self.stopping = True
            busy = True
        return busy

    def flush(self) -> bool:
        """Send the queued events to rank 0, or an empty message when the head moved unseen; True if events went."""
        now = time.monotonic()
        if not self.pending:
            if self.moved_at is not None and self.moved_at() > self.sent_at and now - self.sent_at >= self.beat_s:
                self.box.post(0, TAG_EVENTS, ("events", self.replica, [], self.scheduler.running))
                self.sent_at = now
            return False             # a heartbeat is not work: the loop's sleeping is unchanged
        self.box.post(0, TAG_EVENTS, ("events", self.replica, self.pending, self.scheduler.running))
        self.pending = []
        self.sent_at = now
        return True

    @property
    def finished(self) -> bool:
        """True once rank 0 said stop and nothing is left here."""
        return self.stopping and self.scheduler.idle
