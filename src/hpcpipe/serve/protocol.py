"""Every message between the ranks of a serving job, one small frozen class each, and every tag they travel on.

A job is dp replicas of pp stages of tp ranks. World rank 0 runs the front end's dispatcher and replica 0's
head; replica d's head is world rank d * pp * tp (its first stage's tp rank 0)::

    world communicator (WorldTag)
      rank 0: Dispatcher --Submit | Cancel | StopReplica-----> replica d's head: Controller   (d = 0 too)
      rank 0: Dispatcher <-------------------------Events----- replica d's head: Controller   (d = 0 too)
      rank 0: Dispatcher <--------------------------Drain----- any rank: SignalRelay (a stop signal came)

    pp communicator of replica d (PipeTag)
      head (stage 0) --Work + x | Idle | Join | StopPipeline--> stage 1 --> ... --> last stage (samples)
      head <-------------------------------------Result------------------- last stage
      stage k --Probe (+ x)--> stage k + 1                                  (once, before serving)

    tp communicator of stage (d, k) (TPTag)
      tp rank 0: TPDriver --Forward + x | SetPages | ClearPages | StopTP--> tp rank r > 0: TPWorker

Replica 0's head is on rank 0 with the dispatcher, and its messages are the same as every replica's, sent
and received the same way: every replica is driven and judged by the same messages (its tokens, or a
heartbeat: empty Events). Only their transport differs: rank 0's mailbox hands a message to its own rank
over in place (hpcpipe.serve.dispatch.Loopback), queued by the sender and polled a step later by the
receiver, so neither ever blocks on the other.

A message is pickled by mpi4py (lower-case isend) as its class and its field values (``__reduce__``: no
field names, no instance dict) and holds only ints, strings, lists and the broker's small dataclasses.
Activations never travel inside one: a class with ``BUFFER`` is followed by its array as a raw buffer on
``TAG + 1`` (hpcpipe.runtime.mailbox.Mailbox), so every tag that carries one leaves the next value free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, ClassVar

from hpcpipe.nn.core.decode import Segment
from hpcpipe.serve.broker import Event, Request
from hpcpipe.serve.logprobs import Logprob
from hpcpipe.serve.sampling import SamplingParams

ANY = None      # any source rank (receive)


class WorldTag(IntEnum):
    """Tags on the world communicator: the dispatcher (rank 0) and the replicas' heads."""

    CONTROL = 31    # Submit | Cancel | StopReplica
    EVENTS = 33     # Events
    DRAIN = 35      # Drain


class PipeTag(IntEnum):
    """Tags on a replica's pp communicator: its stages."""

    WORK = 21       # Work | Idle | Join | StopPipeline (Work's activations on 22)
    RESULT = 23     # Result
    PROBE = 25      # Probe (its activations on 26)


class TPTag(IntEnum):
    """Tags on a stage's tp communicator: its tensor-parallel ranks (values apart from the others' too)."""

    CALL = 41       # Forward | SetPages | ClearPages | StopTP (Forward's input on 42)


TAGS = (WorldTag, PipeTag, TPTag)

Row = tuple[int, int, int]     # a Segment as (slot, start, length): plain ints pickle cheaper than Segments
Echo = tuple[int, int, list[int]]     # (segment index, its first row to report, the prompt ids that follow those rows)
Draft = tuple[int, list[int]]         # (segment index, the proposed tokens its rows after the first verify)
# per segment with something to report: (its prompt tokens' log-probabilities, its sampled token's, grammar complete)
Detail = tuple[list[Logprob] | None, Logprob | None, bool]


def to_rows(segments: list[Segment]) -> list[Row]:
    """The segments as they travel."""
    return [(s.slot, s.start, s.length) for s in segments]


def from_rows(travelled: list[Row]) -> list[Segment]:
    """The segments of travelled rows."""
    return [Segment(slot, start, length) for slot, start, length in travelled]


class Message:
    """Base of every message: its tag, whether an array follows, and the cheap pickled form."""

    __slots__ = ()
    TAG: ClassVar[int]
    BUFFER: ClassVar[bool] = False    # an array follows on TAG + 1

    def __reduce__(self) -> tuple[type, tuple]:
        # (class, values) pickles in about half the time of a frozen slotted dataclass's default form
        return type(self), tuple(getattr(self, name) for name in self.__slots__)


# ---- world: rank 0 <-> each replica's head ----------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Submit(Message):
    """Rank 0's dispatcher -> a replica's head (world, CONTROL): new requests for its scheduler, in arrival order.

    One message per replica and dispatcher step, however many requests arrived: a burst costs one send.
    """

    TAG: ClassVar[int] = WorldTag.CONTROL
    requests: list[Request]


@dataclass(frozen=True, slots=True)
class Cancel(Message):
    """Rank 0's dispatcher -> a replica's head (world, CONTROL): drop these requests (their clients left)."""

    TAG: ClassVar[int] = WorldTag.CONTROL
    request_ids: list[str]


@dataclass(frozen=True, slots=True)
class StopReplica(Message):
    """Rank 0's dispatcher -> every replica's head (world, CONTROL): no more requests; leave once idle."""

    TAG: ClassVar[int] = WorldTag.CONTROL


@dataclass(frozen=True, slots=True)
class Events(Message):
    """A replica's head -> rank 0's dispatcher (world, EVENTS): its requests' new tokens and finishes.

    No events is a heartbeat: the head moved (a prompt chunk) without a token, so the replica is not stalled.
    """

    TAG: ClassVar[int] = WorldTag.EVENTS
    replica: int
    events: list[Event]
    running: int           # sequences holding a slot there now
    stats: tuple[int, ...] = ()   # its KV-block, prefix-cache and speculation numbers (serve.engine_stats.STATS)


@dataclass(frozen=True, slots=True)
class Drain(Message):
    """Any rank -> rank 0's dispatcher (world, DRAIN): a stop signal arrived here; finish what is in flight."""

    TAG: ClassVar[int] = WorldTag.DRAIN
    reason: str            # the signal's name, e.g. "SIGTERM"


# ---- pp: the stages of one replica ------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Work(Message):
    """A replica's head -> stage 1 -> ... -> last stage (pp, WORK), with the group's activations after it.

    One micro-batch group's new tokens; each stage runs its blocks on them and hands the same message on
    with its output, and the last stage samples the flagged segments and answers with a Result.
    """

    TAG: ClassVar[int] = PipeTag.WORK
    BUFFER: ClassVar[bool] = True
    group: int
    rows: list[Row]                              # the segments of the forward
    new: list[tuple[int, SamplingParams]]        # slots whose sequence starts now: a fresh sampler each
    sample: list[bool]                           # per segment: it ends its sequence's known tokens, sample one
    clear: list[int]                             # KV blocks to zero before the forward (a failed sequence's)
    # prompt rows whose tokens' log-probabilities the last stage reports (echo), with the ids that follow them
    echo: list[Echo] = field(default_factory=list)
    # block-table updates every stage applies before the forward: (slot, first block index, KV block ids)
    pages: list[tuple[int, int, list[int]]] = field(default_factory=list)
    # speculating segments: (segment index, the proposed tokens its rows after the first verify)
    drafts: list[Draft] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Idle(Message):
    """A replica's head -> stage 1 -> ... -> last stage (pp, WORK): nothing in flight or waiting any more.

    The following stages' watchdogs rest until the next Work.
    """

    TAG: ClassVar[int] = PipeTag.WORK


@dataclass(frozen=True, slots=True)
class Join(Message):
    """A replica's head -> stage 1 -> ... -> last stage (pp, WORK), expert parallelism: this step an ep peer
    replica has work and this one none; every stage exchanges zero rows of its own (its experts still compute the
    peers' rows), so that the peers' all-to-alls pair up. Nothing comes back."""

    TAG: ClassVar[int] = PipeTag.WORK


@dataclass(frozen=True, slots=True)
class StopPipeline(Message):
    """A replica's head -> stage 1 -> ... -> last stage (pp, WORK): leave the serving loop."""

    TAG: ClassVar[int] = PipeTag.WORK


@dataclass(frozen=True, slots=True)
class Result(Message):
    """The last stage -> its replica's head (pp, RESULT): one token per segment of a group's Work.

    -1 where the segment was not sampled, scheduler.FAILED where sampling failed (that request alone ends);
    ``details`` by segment index, only for segments with log-probabilities to report or a grammar.
    """

    TAG: ClassVar[int] = PipeTag.RESULT
    group: int
    tokens: list[int]
    details: dict[int, Detail] = field(default_factory=dict)
    spec: dict[int, list[int]] = field(default_factory=dict)   # by speculating segment: every token it kept


@dataclass(frozen=True, slots=True)
class Probe(Message):
    """Stage k -> stage k + 1 (pp, PROBE), once before serving: the probe prompt's activations, or a problem.

    The array follows only while no stage found a problem (hpcpipe.serve.probe).
    """

    TAG: ClassVar[int] = PipeTag.PROBE
    BUFFER: ClassVar[bool] = True
    problem: str | None


# ---- tp: the tensor-parallel ranks of one stage -----------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Forward(Message):
    """A stage's tp rank 0 -> each of its other tp ranks (tp, CALL), with the stage's input after it: run it."""

    TAG: ClassVar[int] = TPTag.CALL
    BUFFER: ClassVar[bool] = True
    rows: list[Row]
    logit_rows: list[int] | None = None     # on the head stage: the rows to apply the head to (None: each last)


@dataclass(frozen=True, slots=True)
class ClearPages(Message):
    """A stage's tp rank 0 -> each of its other tp ranks (tp, CALL): zero these KV blocks."""

    TAG: ClassVar[int] = TPTag.CALL
    pages: list[int]


@dataclass(frozen=True, slots=True)
class SetPages(Message):
    """A stage's tp rank 0 -> each of its other tp ranks (tp, CALL): give a slot these KV blocks (its table)."""

    TAG: ClassVar[int] = TPTag.CALL
    slot: int
    first: int              # the slot's first block index they fill
    pages: list[int]


@dataclass(frozen=True, slots=True)
class StopTP(Message):
    """A stage's tp rank 0 -> each of its other tp ranks (tp, CALL): leave the serving loop."""

    TAG: ClassVar[int] = TPTag.CALL


MESSAGES = (Submit, Cancel, StopReplica, Events, Drain, Work, Idle, Join, StopPipeline, Result, Probe, Forward,
            ClearPages, SetPages, StopTP)


def send(box: Any, dest: int, message: Message, array: Any = None) -> None:
    """Start sending message to rank dest of box's communicator on its tag; array (its buffer) follows on tag + 1."""
    if array is not None and not message.BUFFER:
        raise ValueError(f"{type(message).__name__} carries no array (tag {message.TAG}: tag + 1 is another's)")
    box.post(dest, int(message.TAG), (message,), array)


def receive(box: Any, source: int | None, tag: int) -> tuple[Message, Any, int] | None:
    """Return (message, its array or None, sender) of the next message on tag from source (ANY: any rank).

    None when no such message is waiting: it never blocks (a matched probe; hpcpipe.runtime.mailbox.Mailbox).
    """
    got = box.poll(source, int(tag))
    if got is None:
        return None
    (message,), array, sender = got
    return message, array, sender

