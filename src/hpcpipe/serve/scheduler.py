"""Continuous batching for one pipeline replica: KV-cache slots, micro-batch groups, the next work item.

No MPI and no compute here: the replica's first stage asks :meth:`next_item`
for work, runs it through the pipeline and hands the sampled tokens back to
:meth:`complete`. Sequences in flight are spread over ``groups`` micro-batch
groups (at least pp), so that while stage k works on one group, stage k + 1
works on another and no stage waits for a whole token round trip::

    time ->     t0    t1    t2    t3    t4
    stage 0     g0    g1    g0'   g1'   g0''      g0' = group 0's next token
    stage 1           g0    g1    g0'   g1'

Requests join and leave between steps: a waiting request takes a free slot
of the least busy group (each group owns a contiguous block of slots; its
prompt is prefilled the next time that group runs, beside the others' decode
rows); a finished or cancelled
sequence frees its slot when its group comes back. Which tokens a sequence
gets never depends on its group or neighbours: sampling is per sequence.

A long prompt is prefilled in chunks of ``prefill_tokens``. While every item
a group has in flight carries only prompt chunks that sample nothing, the
group's next chunks go out at once (up to ``depth`` items, the replica's
stages): each stage runs a slot's chunks in the order they were sent, so a
chunk's keys and values are cached before the next chunk reads them, and the
chunks of one prompt flow through the stages like micro-batches instead of
each waiting for the last stage (time to first token at pp > 1).

A sequence whose token could not be sampled (``FAILED``: its logits were not
finite) ends alone with an "error" event. Its slot's cache may hold NaN, which
a masked attention weight of 0 still turns into NaN for a later sequence that
reads past its own length in a batched decode, so the next sequence to take
that slot has it cleared first (``WorkItem.clear``, on every stage).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from hpcpipe.nn.core.decode import Segment
from hpcpipe.serve.broker import Event, Request
from hpcpipe.serve.sampling import SamplingParams

FAILED = -2        # the last stage's token for a sequence it could not sample (-1: nothing sampled, a prompt chunk)


@dataclass(eq=False)      # identity: a sequence is one object wherever it is listed
class Sequence:
    """A request holding a KV-cache slot."""

    request: Request
    slot: int
    group: int
    tokens: list[int]
    cached: int = 0            # tokens whose keys and values are in the slot's cache
    sent: int = 0              # tokens sent into the pipeline (cached once their items come back)
    generated: int = 0
    cancelled: bool = False
    echoed: int = 0            # prompt positions whose next token's log-probability was asked for (echo)
    prompt_logprobs: list = field(default_factory=list)   # what came back for them, sent with the first event
    reported: bool = False     # an event of this sequence was sent


@dataclass(frozen=True)
class WorkItem:
    """One micro-batch through the pipeline: new tokens of some sequences of one group."""

    group: int
    segments: list[Segment]
    tokens: np.ndarray                       # int64 (sum of segment lengths,), in segment order
    new: list[tuple[int, SamplingParams]] = field(default_factory=list)   # slots whose sampler starts now
    sample: list[bool] = field(default_factory=list)   # per segment: it ends the sequence's tokens, sample one
    clear: list[int] = field(default_factory=list)     # slots to zero before the forward (a failed sequence's)
    # (segment index, first row, the prompt ids after those rows): rows whose next token's log-probability is asked
    echo: list[tuple[int, int, list[int]]] = field(default_factory=list)


@dataclass(frozen=True)
class Flight:
    """A work item on its way: its sequences, the cached length each reaches, whether any is sampled."""

    members: list[Sequence]
    reach: list[int]
    samples: bool


class ReplicaScheduler:
    """Slots, groups and waiting requests of one replica (runs on its first stage)."""

    def __init__(self, slots: int, groups: int, seq_len: int, kv_cache: bool = True, prefill_tokens: int = 0,
                 stop_ids: tuple[int, ...] = (), depth: int = 1):
        if slots < 1 or groups < 1 or depth < 1:
            raise ValueError(f"a replica needs at least one slot, group and stage, got slots={slots} groups={groups} "
                             f"depth={depth}")
        self.seq_len, self.kv_cache = seq_len, kv_cache
        self.stop_ids = frozenset(int(i) for i in stop_ids)    # the model's end-of-sequence ids: finish "stop"
        # prompt tokens one work item may carry (0 = no limit): long prompts are prefilled in chunks over
        # several steps, so one joining request does not stall the decode rows beside it for long
        self.prefill_tokens = prefill_tokens if kv_cache else 0
        self.depth = depth          # prompt-only items a group may have in flight (the replica's stages)
        # each group owns a contiguous block of slots, so a decode step reads its group's KV cache in
        # place instead of gathering rows spread over the whole cache; pop() hands out the lowest first
        self.free = [list(range((g + 1) * slots // groups - 1, g * slots // groups - 1, -1)) for g in range(groups)]
        self.groups: list[list[Sequence]] = [[] for _ in range(groups)]
        self.flights: list[deque[Flight]] = [deque() for _ in range(groups)]   # oldest first: results come in order
        self.waiting: deque[Request] = deque()
        self.by_id: dict[str, Sequence] = {}
        self.dirty: set[int] = set()    # slots a failed sequence left, cleared when the next sequence starts there
        self._turn = 0

    @property
    def running(self) -> int:
        """Sequences holding a slot."""
        return len(self.by_id)

    @property
    def idle(self) -> bool:
        """True when nothing runs, waits or is in flight."""
        return not self.by_id and not self.waiting and not any(self.flights)

    def submit(self, request: Request) -> None:
        """Queue a request; it starts when a slot is free."""
        self.waiting.append(request)

    def cancel(self, request_id: str) -> list[Event]:
        """Drop a request; return its final event now unless its group is in flight (then at :meth:`complete`)."""
        for i, request in enumerate(self.waiting):
            if request.id == request_id:
                del self.waiting[i]
                return [Event(request_id, [], "cancelled")]
        seq = self.by_id.get(request_id)
        if seq is None or seq.cancelled:
            return []
        seq.cancelled = True
        if not self._flying(seq):
            self._release(seq)
            return [Event(request_id, [], "cancelled")]
        return []

    def _flying(self, seq: Sequence) -> bool:
        return any(seq in flight.members for flight in self.flights[seq.group])

    def _release(self, seq: Sequence) -> None:
        self.groups[seq.group].remove(seq)
        del self.by_id[seq.request.id]
        self.free[seq.group].append(seq.slot)

    def _admit(self) -> None:
        while self.waiting:
            group = max(range(len(self.groups)), key=lambda g: len(self.free[g]))   # the least busy group
            if not self.free[group]:
                return
            request = self.waiting.popleft()
            seq = Sequence(request, self.free[group].pop(), group, list(request.prompt))
            self.groups[group].append(seq)
            self.by_id[request.id] = seq

    def next_item(self) -> WorkItem | None:
        """Return the next group's work (round robin over groups that may send), or None."""
        self._admit()
        n = len(self.groups)
        for k in range(n):
            g = (self._turn + k) % n
            if self.groups[g] and self._may_send(g):
                item = self._build(g)
                if item is not None:
                    self._turn = (g + 1) % n
                    return item
        return None

    def _may_send(self, g: int) -> bool:
        """A group sends when nothing of it is in flight, or only prompt chunks (fewer than depth of them)."""
        flights = self.flights[g]
        return not flights or (len(flights) < self.depth and not any(f.samples for f in flights))

    def _build(self, g: int) -> WorkItem | None:
        members, budget = [], self.prefill_tokens or self.seq_len
        segments, rows, new, sample, reach, clear, echo = [], [], [], [], [], [], []
        for seq in self.groups[g]:
            if seq.cancelled:
                continue                          # released once its chunks in flight are back
            start = seq.sent if self.kv_cache else 0
            length = len(seq.tokens) - start
            if length <= 0:
                continue                          # its last chunk is on its way
            if length > 1 and self.prefill_tokens:
                if budget <= 0:
                    continue                      # its prompt waits for the next step of the group
                length = min(length, budget)
                budget -= length
            if seq.sent == 0:
                new.append((seq.slot, seq.request.params))
                if seq.slot in self.dirty:
                    self.dirty.discard(seq.slot)
                    clear.append(seq.slot)
            if seq.request.params.prompt_logprobs:
                first, end = max(start, seq.echoed), min(start + length, len(seq.request.prompt) - 1)
                if first < end:
                    echo.append((len(segments), first - start, seq.tokens[first + 1:end + 1]))
                    seq.echoed = end
            members.append(seq)
            segments.append(Segment(seq.slot, start, length))
            rows.extend(seq.tokens[start:start + length])
            reach.append(start + length)
            # max_new 0 (echo): the prompt's log-probabilities only, nothing sampled after it
            sample.append(start + length == len(seq.tokens) and seq.request.max_new > 0)
            seq.sent = start + length
        if not members:
            return None
        self.flights[g].append(Flight(members, reach, any(sample)))
        return WorkItem(g, segments, np.asarray(rows, dtype=np.int64), new, sample, clear, echo)

    def complete(self, group: int, tokens: list[int], details: dict | None = None) -> list[Event]:
        """Take the group's oldest item's tokens (one per segment, -1 where none was sampled); return the events.

        ``details`` (by segment index; hpcpipe.serve.protocol.Detail): the log-probabilities of the prompt rows
        and of the sampled token, and whether the sequence's grammar is complete (it then finishes "stop").
        """
        details = details or {}
        flights = self.flights[group]
        if not flights or len(flights[0].members) != len(tokens):
            raise RuntimeError(f"result for group {group} does not match the work in flight "
                               f"({len(flights[0].members) if flights else 0} sequences, {len(tokens)} tokens)")
        flight = flights.popleft()
        events = []
        for index, (seq, token, reach) in enumerate(zip(flight.members, tokens, flight.reach, strict=True)):
            if self.by_id.get(seq.request.id) is not seq:
                continue                          # ended with an earlier chunk's result
            failed = int(token) == FAILED
            if failed:
                self.dirty.add(seq.slot)
            if failed or (seq.cancelled and not self._flying(seq)):
                # a cancelled sequence keeps its slot until its last chunk is back: the slot's next
                # sequence must not be sent while chunks of this one still run
                self._release(seq)
                events.append(Event(seq.request.id, [], "cancelled" if seq.cancelled else "error"))
                continue
            if seq.cancelled:
                continue
            prompt_lp, token_lp, complete = details.get(index, (None, None, False))
            seq.prompt_logprobs.extend(prompt_lp or ())
            seq.cached = reach
            if reach < len(seq.tokens):
                continue                          # a prompt chunk: nothing sampled yet
            if seq.request.max_new == 0:          # echo alone: the prompt's log-probabilities are the answer
                self._release(seq)
                events.append(self._event(seq, [], "length", None))
                continue
            seq.tokens.append(int(token))
            seq.generated += 1
            finish = "stop" if int(token) in self.stop_ids or complete else \
                "length" if seq.generated >= seq.request.max_new or len(seq.tokens) >= self.seq_len else None
            if finish is not None:
                self._release(seq)
            events.append(self._event(seq, [int(token)], finish, None if token_lp is None else [token_lp]))
        return events

    @staticmethod
    def _event(seq: Sequence, tokens: list[int], finish: str | None, logprobs: list | None) -> Event:
        """The sequence's next event; its first carries the prompt's log-probabilities when they were asked for."""
        prompt = seq.prompt_logprobs if seq.request.params.prompt_logprobs and not seq.reported else None
        seq.reported = True
        return Event(seq.request.id, tokens, finish, logprobs, prompt)
