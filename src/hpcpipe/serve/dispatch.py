"""The front end's side of the engine on world rank 0, and the control inbox of every replica's head.

dp replicas are independent pipelines behind one front end. The dispatcher
takes new requests and cancellations from a source (the HTTP broker, or the
one prompt of ``generate``), sends each request to the replica with the
fewest outstanding requests, and passes the replicas' token events back
(the messages are those of hpcpipe.serve.protocol, on the world communicator)::

    source (HTTP thread) --take--> Dispatcher (rank 0) --Submit | Cancel | StopReplica--> Controller of replica d
    source <--deliver-- Dispatcher <-------------------Events(d, [Event], running)-------- Controller of replica d

Every replica, replica 0 included, is driven and heard the same way: replica
0's head lives on rank 0 with the dispatcher, and their messages to each other
go through rank 0's mailbox too, which hands them over in place (``Loopback``:
queued by the sender, polled a step later by the receiver, never blocking
either; pickled and sent through MPI to itself, they cost about 30 us more per
step, a fifth more of rank 0's CPU time with a small test model). A head that
has moved (a chunk of a long prompt sent or taken back) without producing
tokens says so with an empty Events, at most every ``beat_s``: rank 0's
watchdog and /health judge every replica by its last message, and a prefill
that yields no token for a while is not a stall.

A stop signal on any other rank reaches rank 0 as a Drain: the source stops
accepting, the requests in flight finish, then every replica is stopped.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any, Protocol

from hpcpipe.serve.broker import Event, Request
from hpcpipe.serve.engine_stats import total
from hpcpipe.serve.protocol import ANY, Cancel, Events, StopReplica, Submit, WorldTag, receive, send
from hpcpipe.serve.scheduler import ReplicaScheduler


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

    def __init__(self, source: Source, box: Any, dp: int, pp: int, tp: int = 1):
        self.source, self.box, self.dp, self.pp = source, box, dp, pp
        self.head_stride = pp * tp      # world rank of replica r's head (its first stage's tp rank 0): r * pp * tp
        self.owner: dict[str, int] = {}
        self.load = [0] * dp
        self.running = [0] * dp
        self.stats: list[tuple[int, ...]] = [()] * dp    # each replica's latest engine numbers (serve.engine_stats)
        self.draining = ""          # why the source was closed ("" while open)
        self.drains = 0             # drain requests received from other ranks
        self.stopped = False        # every replica was told to stop
        self.moved = [time.monotonic()] * dp    # per replica: its last message, or when it last became busy

    def drain(self, reason: str) -> None:
        """Stop accepting requests; the replicas are stopped once those in flight have finished."""
        if not self.draining:
            self.draining = reason
            self.source.close(reason)

    def step(self) -> bool:
        """Route new requests and cancellations, pass events back, stop the replicas once finished.

        Returns True if anything happened.
        """
        new, cancels = self.source.take()
        routed: dict[int, list[Request]] = {}
        for request in new:
            replica = min(range(self.dp), key=lambda d: self.load[d])
            if not self.load[replica]:
                self.moved[replica] = time.monotonic()     # its clock starts with its work
            self.load[replica] += 1
            self.owner[request.id] = replica
            routed.setdefault(replica, []).append(request)
        for replica, requests in routed.items():
            send(self.box, replica * self.head_stride, Submit(requests))
        dropped: dict[int, list[str]] = {}
        for request_id in cancels:
            replica = self.owner.get(request_id)
            if replica is not None:
                dropped.setdefault(replica, []).append(request_id)
        for replica, request_ids in dropped.items():
            send(self.box, replica * self.head_stride, Cancel(request_ids))
        busy = bool(new or cancels)
        while (got := receive(self.box, ANY, WorldTag.EVENTS)) is not None:
            self.deliver(got[0])
            busy = True
        while (got := receive(self.box, ANY, WorldTag.DRAIN)) is not None:
            self.drains += 1
            self.drain(got[0].reason)
            busy = True
        if self.finished and not self.stopped:
            for replica in range(self.dp):      # replica 0's head (on this rank) included: it leaves the same way
                send(self.box, replica * self.head_stride, StopReplica())
            self.stopped = True
        return busy

    def collect_drains(self, sent: int) -> None:
        """Receive the drain requests still on their way (``sent`` in all), so none is left unmatched."""
        while self.drains < sent:
            if receive(self.box, ANY, WorldTag.DRAIN) is None:
                time.sleep(self.box.poller.min_s)
                continue
            self.drains += 1

    def deliver(self, message: Events) -> None:
        """Pass a replica's events to the source and keep its load count; any message means it moved."""
        replica = message.replica
        for event in message.events:
            if event.finish is not None and self.owner.pop(event.request_id, None) is not None:
                self.load[replica] -= 1
        self.running[replica] = message.running
        if message.stats:
            self.stats[replica] = message.stats
            self.source.set_engine_stats(total(self.stats))
        self.moved[replica] = time.monotonic()        # no events: a heartbeat, its head moved anyway
        if message.events:
            self.source.deliver(message.events)
        self.source.set_running(sum(self.running))

    @property
    def pending(self) -> bool:
        """Whether any replica holds requests of the source."""
        return any(self.load)

    def moved_at(self) -> float:
        """When the least recently moving busy replica last moved (by its messages); now when none is busy."""
        busy = [self.moved[d] for d in range(self.dp) if self.load[d]]
        return min(busy) if busy else time.monotonic()

    @property
    def finished(self) -> bool:
        """True once draining and nothing is outstanding anywhere."""
        return (bool(self.draining) or self.source.closed) and not self.owner and self.source.outstanding == 0


class Controller:
    """The control inbox of a replica's head (replica 0's on world rank 0 too): requests in, events out."""

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
        while (got := receive(self.box, 0, WorldTag.CONTROL)) is not None:
            match got[0]:
                case Submit(requests=requests):
                    for request in requests:
                        self.scheduler.submit(request)
                case Cancel(request_ids=request_ids):
                    for request_id in request_ids:
                        self.report(self.scheduler.cancel(request_id))
                case StopReplica():
                    self.stopping = True
            busy = True
        return busy

    def flush(self) -> bool:
        """Send the queued events to rank 0, or an empty Events when the head moved unseen; True if events went."""
        now = time.monotonic()
        if not self.pending:
            # no heartbeat once stopped: rank 0 no longer listens, and it would be left unreceived
            if (not self.stopping and self.moved_at is not None and self.moved_at() > self.sent_at
                    and now - self.sent_at >= self.beat_s):
                send(self.box, 0, Events(self.replica, [], self.scheduler.running, self.scheduler.stats()))
                self.sent_at = now
            return False             # a heartbeat is not work: the loop's sleeping is unchanged
        send(self.box, 0, Events(self.replica, self.pending, self.scheduler.running, self.scheduler.stats()))
        self.pending = []
        self.sent_at = now
        return True

    @property
    def finished(self) -> bool:
        """True once rank 0 said stop and nothing is left here (no sequence, no event to send)."""
        return self.stopping and self.scheduler.idle and not self.pending


class Loopback:
    """A rank's mailbox (hpcpipe.runtime.mailbox.Mailbox) whose messages to its own rank stay in this process.

    World rank 0 is the dispatcher and replica 0's head: their messages to each other are the same messages,
    sent and received the same way as every other replica's, but handed over in place (no pickling, no MPI),
    in order per tag as MPI keeps them. Every other destination and source goes through ``box``.
    """

    def __init__(self, box: Any, rank: int):
        self.box, self.rank, self.poller = box, rank, box.poller
        self.own: dict[int, deque] = defaultdict(deque)      # tag -> (header, array) sent to this rank

    def post(self, dest: int, tag: int, header: tuple, array: Any = None) -> None:
        """Send like Mailbox.post; to this rank itself, queue it here (an array is copied: the sender may reuse it)."""
        if dest != self.rank:
            self.box.post(dest, tag, header, array)
        else:
            self.own[tag].append((header, None if array is None else array.copy()))

    def poll(self, source: int | None, tag: int) -> tuple[tuple, Any, int] | None:
        """Poll like Mailbox.poll; this rank's own messages first (a source of ANY takes them too)."""
        if source in (None, self.rank) and self.own[tag]:
            header, array = self.own[tag].popleft()
            return header, array, self.rank
        return None if source == self.rank else self.box.poll(source, tag)

    def flush(self) -> None:
        """Complete every outstanding send of the underlying mailbox."""
        self.box.flush()
