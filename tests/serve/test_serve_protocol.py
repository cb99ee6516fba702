"""The serving wire protocol (hpcpipe.serve.protocol): every message pickles to itself cheaply, tags never
collide, and every replica's head (replica 0's on rank 0 included) is driven and heard through messages.

The dispatcher and the controllers run here over an in-process stand-in of the world's mailboxes, which
delivers a message only when its receiver polls for it, as MPI does (sends to the own rank included).
The last test runs the same over the real Mailbox under MPI, at any rank count (mpiexec -n 8 ... -m mpi).
"""

from __future__ import annotations

import pickle
import time
from collections import defaultdict, deque
from dataclasses import fields

import numpy as np
import pytest

from hpcpipe.serve import protocol
from hpcpipe.serve.broker import Event, Request
from hpcpipe.serve.dispatch import Controller, Dispatcher, Loopback
from hpcpipe.serve.engine_stats import STATS
from hpcpipe.serve.protocol import (
    MESSAGES,
    TAGS,
    Cancel,
    ClearPages,
    Drain,
    Events,
    Forward,
    Idle,
    Join,
    Probe,
    Result,
    SetPages,
    StopPipeline,
    StopReplica,
    StopTP,
    Submit,
    Work,
    WorldTag,
)
from hpcpipe.serve.sampling import SamplingParams
from hpcpipe.serve.scheduler import FAILED, ReplicaScheduler

PARAMS = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=11)
SAMPLES = [
    Submit([Request("cmpl-1-0", [3, 1, 4], 8, PARAMS, 12.5), Request("cmpl-1-1", [3], 1, PARAMS, 12.5)]),
    Cancel(["cmpl-1-0", "cmpl-2-0"]),
    StopReplica(),
    Events(1, [Event("cmpl-1-0", [7], None), Event("cmpl-2-0", [], "cancelled")], 3),
    Events(0, [], 0),
    Events(0, [], 0, (3, 1, 0, 2)),
    Drain("SIGTERM"),
    Work(2, [(0, 0, 3), (1, 5, 1)], [(0, PARAMS)], [True, False], [4], [], [(0, 0, [3, 4])]),
    Idle(),
    Join(),
    StopPipeline(),
    Result(2, [17, -1, FAILED]),
    Probe(None),
    Probe("the model's forward is not finite: stage 1"),
    Forward([(3, 9, 1)]),
    ClearPages([3, 4]),
    SetPages(2, 1, [7, 8]),
    StopTP(),
]


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips_through_pickle_as_class_and_values(message):
    wire = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
    back = pickle.loads(wire)
    assert type(back) is type(message) and back == message
    # the cheap form: the class and the values, no field names (no instance dict, no slot state)
    assert not any(f.name.encode() in wire for f in fields(message) if len(f.name) > 3), wire
    for name in [f.name for f in fields(message)] + ["extra"]:
        # frozen and slotted: nothing changes or rides along unseen (Python 3.11 says TypeError for a new name)
        with pytest.raises((AttributeError, TypeError)):
            setattr(message, name, 1)


def test_every_message_class_has_a_sample_a_docstring_and_a_tag_of_one_communicator():
    assert {type(m) for m in SAMPLES} == set(MESSAGES)
    defined = {v for v in vars(protocol).values() if isinstance(v, type) and issubclass(v, protocol.Message)}
    assert defined - {protocol.Message} == set(MESSAGES)
    for cls in MESSAGES:
        assert cls.__doc__ and "->" in cls.__doc__.splitlines()[0], cls      # who sends it to whom
        assert sum(isinstance(cls.TAG, tags) for tags in TAGS) == 1, cls


def test_tags_are_distinct_and_leave_the_array_tag_free_on_every_communicator():
    every = []
    for tags in TAGS:
        used = [int(t) for t in tags]
        buffers = {cls.TAG + 1 for cls in MESSAGES if cls.BUFFER and isinstance(cls.TAG, tags)}
        assert len(set(used)) == len(used), tags
        assert not buffers & set(used), (tags, buffers)
        every += used + sorted(buffers)
    assert len(set(every)) == len(every), every      # apart across communicators too: no two tags share a value


def test_an_array_only_follows_a_message_that_carries_one():
    class Box:
        def __init__(self):
            self.sent = []

        def post(self, dest, tag, header, array=None):
            self.sent.append((dest, tag, header, array))

    box = Box()
    x = np.ones((2, 3))
    protocol.send(box, 1, Work(0, [(0, 0, 2)], [], [True], []), x)
    assert box.sent == [(1, 21, (Work(0, [(0, 0, 2)], [], [True], []),), x)]
    with pytest.raises(ValueError, match="Result carries no array"):
        protocol.send(box, 0, Result(0, [1]), x)


def test_the_protocol_is_data_only_no_mpi_and_no_runtime():
    import ast
    from pathlib import Path
    tree = ast.parse(Path(protocol.__file__).read_text())
    modules = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names] + \
        [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [m for m in modules if m.startswith(("mpi4py", "hpcpipe.runtime"))], modules


# ---- the dispatcher and the replicas' controllers over in-process mailboxes ---------------------------------

class Net:
    """The world's mailboxes: a message waits in its receiver's queue until polled (non-overtaking per sender)."""

    def __init__(self):
        self.queues: dict[tuple[int, int, int], deque] = defaultdict(deque)     # (dest, source, tag)
        self.log: list[tuple[int, int, object]] = []                              # (source, dest, message)

    def box(self, rank: int) -> NetBox:
        """Rank's mailbox."""
        return NetBox(self, rank)

    def left(self) -> int:
        """Messages sent and never received."""
        return sum(len(q) for q in self.queues.values())


class NetBox:
    """One rank's Mailbox stand-in (post, poll, flush)."""

    poller = None

    def __init__(self, net: Net, rank: int):
        self.net, self.rank = net, rank

    def post(self, dest, tag, header, array=None):
        self.net.queues[dest, self.rank, tag].append((header, array))
        self.net.log.append((self.rank, dest, header[0]))

    def poll(self, source, tag):
        sources = [source] if source is not None else sorted(s for d, s, t in self.net.queues
                                                             if d == self.rank and t == tag)
        for s in sources:
            if self.net.queues[self.rank, s, tag]:
                header, array = self.net.queues[self.rank, s, tag].popleft()
                return header, array, s
        return None

    def flush(self):
        """Sends complete at once here."""


class Source:
    """A front end holding requests until the dispatcher takes them; records what it was delivered."""

    def __init__(self, requests: list[Request]):
        self.new, self.cancels = list(requests), []
        self.outstanding, self.closed = len(requests), False
        self.tokens: dict[str, list[int]] = {r.id: [] for r in requests}
        self.finish: dict[str, str] = {}
        self.running = 0

    def take(self):
        new, self.new = self.new, []
        cancels, self.cancels = self.cancels, []
        self.outstanding -= len(cancels)
        return new, cancels

    def deliver(self, events):
        for e in events:
            self.tokens[e.request_id] += e.tokens
            if e.finish is not None:
                self.finish[e.request_id] = e.finish
                self.outstanding -= e.finish != "cancelled"

    def set_engine_stats(self, stats):
        pass

    def set_running(self, n):
        self.running = n

    def close(self, reason):
        self.closed = True

    def progressed(self, at):
        pass


class FakeHead:
    """A replica's head at pp = 1 without a model: every sampled segment's next token is 5."""

    def __init__(self, scheduler: ReplicaScheduler, report):
        self.scheduler, self.report = scheduler, report
        self.progress_at = time.monotonic()

    def step(self) -> bool:
        item = self.scheduler.next_item()
        if item is None:
            return False
        self.report(self.scheduler.complete(item.group, [5 if s else -1 for s in item.sample]))
        self.progress_at = time.monotonic()
        return True


def _replica(net: Net, rank: int, beat_s: float = 1.0) -> tuple[Controller, FakeHead]:
    scheduler = ReplicaScheduler(4, 1, 32, prefill_tokens=2)
    control = Controller(net.box(rank), scheduler, rank, beat_s=beat_s)
    head = FakeHead(scheduler, control.report)
    control.moved_at = lambda: head.progress_at
    return control, head


def test_every_replica_replica_0_included_is_driven_and_heard_through_messages():
    net = Net()
    requests = [Request(f"r{i}", [1, 2, 3], 3, PARAMS, 0.0) for i in range(6)]
    source = Source(requests)
    dispatcher = Dispatcher(source, net.box(0), dp=2, pp=1)
    replicas = [_replica(net, 0), _replica(net, 1)]
    for _ in range(100):
        if all(control.finished for control, _ in replicas):
            break
        dispatcher.step()
        dispatcher.drain("done")         # all six were taken at the first step: the replicas stop once done
        for control, head in replicas:
            control.step()
            head.step()
            control.flush()
    assert all(control.finished for control, _ in replicas)
    assert source.finish == {r.id: "length" for r in requests} and all(t == [5] * 3 for t in source.tokens.values())
    for replica in (0, 1):     # the same messages each way for both replicas: rank 0 sends to itself
        sent = [type(m).__name__ for s, d, m in net.log if {s, d} == {0, replica}]
        assert {"Submit", "Events", "StopReplica"} <= set(sent), (replica, sent)
    # the six requests arrived together: one Submit per replica carries its three (least loaded first)
    assert [(d, [r.id for r in m.requests]) for _, d, m in net.log if isinstance(m, Submit)] == \
        [(0, ["r0", "r2", "r4"]), (1, ["r1", "r3", "r5"])]
    assert net.left() == 0      # everything sent was received: nothing is left for MPI's finalize


def test_a_cancel_reaches_replica_0_as_a_message_and_its_final_event_comes_back():
    net = Net()
    source = Source([Request("a", list(range(1, 9)), 20, PARAMS, 0.0)])
    dispatcher = Dispatcher(source, net.box(0), dp=1, pp=1)
    control, head = _replica(net, 0)
    dispatcher.step()                  # Submit posted to rank 0 itself
    assert control.step() and head.step() and not control.flush()     # a 2-token prompt chunk: no event yet
    source.cancels.append("a")
    dispatcher.step()
    control.step()                     # the Cancel: the request waits nowhere, its final event is queued
    assert control.flush()
    dispatcher.step()
    assert source.finish == {"a": "cancelled"} and not dispatcher.pending
    assert any(isinstance(m, Cancel) for _, _, m in net.log)


def test_a_head_that_moves_without_tokens_is_seen_moving_through_an_empty_events():
    net = Net()
    source = Source([Request("long", list(range(1, 21)), 2, PARAMS, 0.0)])      # 10 chunks of 2 tokens
    dispatcher = Dispatcher(source, net.box(0), dp=1, pp=1)
    control, head = _replica(net, 0, beat_s=0.01)
    dispatcher.step()
    control.step()
    before = dispatcher.moved_at()
    time.sleep(0.02)
    assert head.step() and not control.flush()        # a chunk moved, no token: a heartbeat, not work
    last = [m for _, _, m in net.log][-1]
    assert (last.replica, last.events, last.running) == (0, [], 1) and len(last.stats) == len(STATS)
    dispatcher.step()
    assert dispatcher.pending and dispatcher.moved_at() > before     # the watchdog of rank 0 sees it move
    # a replica that does not move sends nothing: its time stays, so a stall would be seen
    time.sleep(0.02)
    sent = len(net.log)
    control.flush()
    dispatcher.step()
    assert len(net.log) == sent


def test_a_drain_from_any_rank_closes_the_source_and_stops_every_replica_once_idle():
    net = Net()
    source = Source([])
    dispatcher = Dispatcher(source, net.box(0), dp=3, pp=2, tp=2)
    protocol.send(net.box(5), 0, Drain("SIGTERM"))
    dispatcher.step()
    assert source.closed and dispatcher.draining == "SIGTERM" and dispatcher.drains == 1
    stops = [(d, m) for s, d, m in net.log if isinstance(m, StopReplica)]
    assert stops == [(0, StopReplica()), (4, StopReplica()), (8, StopReplica())]     # each head: d * pp * tp
    dispatcher.step()
    assert len([m for _, _, m in net.log if isinstance(m, StopReplica)]) == 3         # once
    assert WorldTag.CONTROL == StopReplica.TAG


def test_loopback_keeps_messages_to_its_own_rank_in_order_and_passes_the_rest_on():
    net = Net()
    box = Loopback(net.box(0), 0)
    x = np.arange(3.0)
    box.post(0, 33, ("a",), x)
    box.post(0, 33, ("b",))
    box.post(0, 31, ("c",))
    box.post(2, 33, ("to 2",))
    x[:] = 7                                       # the sender reuses its buffer: the message kept its own
    net.box(1).post(0, 33, ("from 1",))
    assert net.queues[2, 0, 33][0] == (("to 2",), None) and not net.queues[0, 0, 33]    # never through MPI
    first = box.poll(None, 33)
    assert first[0] == ("a",) and list(first[1]) == [0.0, 1.0, 2.0] and first[2] == 0
    assert box.poll(0, 33) == (("b",), None, 0)
    assert box.poll(0, 33) is None                 # its own rank's messages are all here: no MPI poll needed
    assert box.poll(None, 33) == (("from 1",), None, 1)
    assert box.poll(0, 31) == (("c",), None, 0) and box.poll(None, 31) is None


# ---- the same over MPI: every rank a replica's head, rank 0 the dispatcher too ------------------------------

@pytest.mark.mpi
def test_over_mpi_every_replica_is_served_through_the_mailbox_and_nothing_is_left_unreceived(world):
    from hpcpipe.runtime.backend import select_backend
    from hpcpipe.runtime.comm import Poller, barrier
    from hpcpipe.runtime.mailbox import Mailbox
    from hpcpipe.serve.engine import loop

    size, rank = world.Get_size(), world.Get_rank()
    poller = Poller(20.0, 1000.0)
    box = Loopback(Mailbox(world, select_backend("numpy"), poller), rank)
    scheduler = ReplicaScheduler(4, 1, 32, prefill_tokens=2)
    control = Controller(box, scheduler, rank, beat_s=0.001)
    head = FakeHead(scheduler, control.report)
    control.moved_at = lambda: head.progress_at
    steps = [control.step, head.step, control.flush]
    if rank == 0:
        requests = [Request(f"r{i}", [1, 2, 3, 4, 5], 3, PARAMS, 0.0) for i in range(3 * size)]
        source = Source(requests)
        dispatcher = Dispatcher(source, box, dp=size, pp=1)
        dispatcher.drain("test")         # the source is closed from the start: the replicas stop once all is done
        steps = [dispatcher.step, *steps]
    loop(steps, lambda: control.finished, poller)       # rank 0's own Submits, Events and stop: through Loopback
    box.flush()
    barrier(world, poller)
    if rank == 0:
        assert source.finish == {r.id: "length" for r in requests}
        assert all(t == [5, 5, 5] for t in source.tokens.values()) and not dispatcher.pending
    for tag in WorldTag:
        assert box.poll(None, tag) is None, tag      # every message, the heartbeats too, was received
    assert not any(box.own.values())

