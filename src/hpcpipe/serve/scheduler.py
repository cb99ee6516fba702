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

from hpcpipe.nn.decode import Segment
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
    generated: int = 0
    cancelled: bool = False


@dataclass(frozen=True)
class WorkItem:
    """One micro-batch through the pipeline: new tokens of some sequences of one group."""

    group: int
    segments: list[Segment]
    tokens: np.ndarray                       # int64 (sum of segment lengths,), in segment order
    new: list[tuple[int, SamplingParams]] = field(default_factory=list)   # slots whose sampler starts now
    sample: list[bool] = field(default_factory=list)   # per segment: it ends the sequence's tokens, sample one
    clear: list[int] = field(default_factory=list)     # slots to zero before the forward (a failed sequence's)


class ReplicaScheduler:
    """Slots, groups and waiting requests of one replica (runs on its first stage)."""

    def __init__(self, slots: int, groups: int, seq_len: int, kv_cache: bool = True, prefill_tokens: int = 0,
                 stop_ids: tuple[int, ...] = ()):
        if slots < 1 or groups < 1:
            raise ValueError(f"a replica needs at least one slot and one group, got slots={slots} groups={groups}")
        self.seq_len, self.kv_cache = seq_len, kv_cache
        self.stop_ids = frozenset(int(i) for i in stop_ids)    # the model's end-of-sequence ids: finish "stop"
        # prompt tokens one work item may carry (0 = no limit): long prompts are prefilled in chunks over
        # several steps, so one joining request does not stall the decode rows beside it for long
        self.prefill_tokens = prefill_tokens if kv_cache else 0
        # each group owns a contiguous block of slots, so a decode step reads its group's KV cache in
        # place instead of gathering rows spread over the whole cache; pop() hands out the lowest first
        self.free = [list(range((g + 1) * slots // groups - 1, g * slots // groups - 1, -1)) for g in range(groups)]
        self.groups: list[list[Sequence]] = [[] for _ in range(groups)]
        self.in_flight: list[list[Sequence] | None] = [None] * groups
        self.reach: list[list[int]] = [[] for _ in range(groups)]   # cached length each member reaches
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
        return not self.by_id and not self.waiting and all(f is None for f in self.in_flight)

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
        flying = self.in_flight[seq.group]
        if flying is None or seq not in flying:
            self._release(seq)
            return [Event(request_id, [], "cancelled")]
        return []

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
        """Return the next group's work (round robin over idle groups with sequences), or None."""
        self._admit()
        n = len(self.groups)
        for k in range(n):
            g = (self._turn + k) % n
            if self.in_flight[g] is None and self.groups[g]:
                self._turn = (g + 1) % n
                return self._build(g)
        return None

    def _build(self, g: int) -> WorkItem:
        members, budget = [], self.prefill_tokens or self.seq_len
        segments, rows, new, sample, reach, clear = [], [], [], [], [], []
        for seq in self.groups[g]:
            start = seq.cached if self.kv_cache else 0
            length = len(seq.tokens) - start
            if length > 1 and self.prefill_tokens:
                if budget <= 0:
                    continue                      # its prompt waits for the next step of the group
                length = min(length, budget)
                budget -= length
            if seq.cached == 0:
                new.append((seq.slot, seq.request.params))
                if seq.slot in self.dirty:
                    self.dirty.discard(seq.slot)
                    clear.append(seq.slot)
            members.append(seq)
            segments.append(Segment(seq.slot, start, length))
            rows.extend(seq.tokens[start:start + length])
            reach.append(start + length)
            sample.append(start + length == len(seq.tokens))
        self.in_flight[g], self.reach[g] = members, reach
        return WorkItem(g, segments, np.asarray(rows, dtype=np.int64), new, sample, clear)

    def complete(self, group: int, tokens: list[int]) -> list[Event]:
        """Take the group's sampled tokens (one per segment, -1 where none was sampled); return the events."""
        members = self.in_flight[group]
        if members is None or len(members) != len(tokens):
            raise RuntimeError(f"result for group {group} does not match the work in flight "
                               f"({0 if members is None else len(members)} sequences, {len(tokens)} tokens)")
        self.in_flight[group] = None
        events = []
        for seq, token, reach in zip(members, tokens, self.reach[group], strict=True):
            failed = int(token) == FAILED
            if failed:
                self.dirty.add(seq.slot)
            if seq.cancelled or failed:
                self._release(seq)
                events.append(Event(seq.request.id, [], "cancelled" if seq.cancelled else "error"))
                continue
            seq.cached = reach
            if reach < len(seq.tokens):
                continue                          # a prompt chunk: nothing sampled yet
            seq.tokens.append(int(token))
            seq.generated += 1
            finish = "stop" if int(token) in self.stop_ids else \
                "length" if seq.generated >= seq.request.max_new or len(seq.tokens) >= self.seq_len else None
            if finish is not None:
                self._release(seq)
            events.append(Event(seq.request.id, [int(token)], finish))
        return events
