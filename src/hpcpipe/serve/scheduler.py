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

The KV cache is paged (hpcpipe.serve.kv_ledger): a request is admitted when
a slot is free and the pool can promise every KV block it may write; it
starts after the cached blocks of its prompt's prefix (prefix caching), and
each work item carries the block-table updates every stage applies before
its forward (``WorkItem.pages``), so all stages agree which blocks a sequence
reads and writes.

A sequence whose token could not be sampled (``FAILED``: its logits were not
finite) ends alone with an "error" event. Its KV blocks may hold NaN, which a
masked attention weight of 0 still turns into NaN for a later sequence that
reads past its own length in a batched decode, so they are zeroed before their
next use (``WorkItem.clear``, on every stage) and never reused as a prefix.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hpcpipe.nn.core.decode import Segment
from hpcpipe.nn.core.kv_pages import held_pages
from hpcpipe.serve.broker import Event, Request
from hpcpipe.serve.kv_ledger import KVLedger, TableUpdate
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
    started: bool = False      # its first work item was built (its whole block table went with it)
    blocks: list[int] = field(default_factory=list)    # its KV blocks, in position order
    keys: list[bytes] = field(default_factory=list)    # prefix keys of its first len(keys) blocks
    reserved: int = 0          # KV blocks promised and not taken yet
    limit: int = 0             # positions it may ever write
    dropped: int = 0           # its first blocks, before its window, given back (hpcpipe.serve.kv_ledger.trim)
    retable: bool = False      # dropped blocks whose table entries still name them on the stages


@dataclass(frozen=True)
class WorkItem:
    """One micro-batch through the pipeline: new tokens of some sequences of one group."""

    group: int
    segments: list[Segment]
    tokens: np.ndarray                       # int64 (sum of segment lengths,), in segment order
    new: list[tuple[int, SamplingParams]] = field(default_factory=list)   # slots whose sampler starts now
    sample: list[bool] = field(default_factory=list)   # per segment: it ends the sequence's tokens, sample one
    clear: list[int] = field(default_factory=list)     # KV blocks to zero before the forward (a failed sequence's)
    # (segment index, first row, the prompt ids after those rows): rows whose next token's log-probability is asked
    echo: list[tuple[int, int, list[int]]] = field(default_factory=list)
    pages: list[TableUpdate] = field(default_factory=list)   # block-table updates, applied before the forward
    drafts: list[tuple[int, list[int]]] = field(default_factory=list)   # (segment index, proposals it verifies)


@dataclass(frozen=True)
class Flight:
    """A work item on its way: its sequences, the cached length each reaches, whether any is sampled."""

    members: list[Sequence]
    reach: list[int]
    samples: bool


class ReplicaScheduler:
    """Slots, groups and waiting requests of one replica (runs on its first stage)."""

    def __init__(self, slots: int, groups: int, seq_len: int, kv_cache: bool = True, prefill_tokens: int = 0,
                 stop_ids: tuple[int, ...] = (), depth: int = 1, kv_block: int = 16, kv_blocks: int = 0,
                 prefix_cache: bool = True, proposer: Any = None, speculate_tokens: int = 0, window: int = 0,
                 ring: int = 0, ring_span: int = 0):
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
        self._turn = 0
        # speculative decoding (hpcpipe.serve.speculate): proposals verified k + 1 rows at a time
        self.proposer = proposer if kv_cache and speculate_tokens > 0 else None
        self.speculate_tokens = speculate_tokens
        # the KV blocks (0: every slot's whole context, or under a sliding window on every block (``window``:
        # hpcpipe.nn.core.kv_pages.sequence_window) the blocks a sequence holds at most); prefix caching and
        # giving back the blocks before the window need the cache (kv_cache); ``ring``: the window of windowed
        # blocks beside full ones, whose keys the stages keep in per-slot rings of ``ring_span`` blocks
        # (kv_pages.ring_layout)
        window, ring = (window, ring) if kv_cache else (0, 0)
        ahead = speculate_tokens if self.proposer is not None else 0
        span = held_pages(seq_len, kv_block, window, ahead)
        self.kv = KVLedger(kv_blocks or slots * span, kv_block, seq_len, prefix_cache and kv_cache, window, ahead,
                           ring, ring_span)
        self.spec_steps = self.spec_proposed = self.spec_accepted = 0

    @property
    def running(self) -> int:
        """Sequences holding a slot."""
        return len(self.by_id)

    def stats(self) -> tuple[int, ...]:
        """KV-block, prefix-cache and speculation numbers for /metrics (hpcpipe.serve.engine_stats.STATS order)."""
        return self.kv.numbers() + (self.spec_steps, self.spec_proposed, self.spec_accepted)

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
        self.kv.release(seq)
        self.groups[seq.group].remove(seq)
        del self.by_id[seq.request.id]
        self.free[seq.group].append(seq.slot)

    def _admit(self) -> None:
        while self.waiting:
            group = max(range(len(self.groups)), key=lambda g: len(self.free[g]))   # the least busy group
            if not self.free[group]:
                return
            request = self.waiting[0]
            seq = Sequence(request, self.free[group][-1], group, list(request.prompt))
            if not self.kv.admit(seq):
                return                            # waits (in order) until finished sequences free KV blocks
            self.waiting.popleft()
            self.free[group].pop()
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
        segments, rows, new, sample, reach, clear, echo, pages, wanted = [], [], [], [], [], [], [], [], []
        for seq in self.groups[g]:
            if seq.cancelled:
                continue                          # released once its chunks in flight are back
            start = seq.sent if self.kv_cache else 0
            length = len(seq.tokens) - start
            if length <= 0:
                continue                          # its last chunk is on its way
            room = self.kv.room(seq) - start      # under a sliding window: what its blocks may hold now
            if room < 1:
                continue                          # waits for its items in flight to give blocks back
            length = min(length, room)
            if length > 1 and self.prefill_tokens:
                if budget <= 0:
                    continue                      # its prompt waits for the next step of the group
                length = min(length, budget)
                budget -= length
            ahead = min(self._lookahead(seq, start, length), room - length)
            updates = [self.kv.redirect(seq), self.kv.grow(seq, start + length + ahead)]
            if not seq.started:
                seq.started = True
                new.append((seq.slot, seq.request.params))
                updates = [self.kv.first_table(seq)]     # its whole table: prefix hits and new blocks
            for update in updates:
                if update is None:
                    continue
                pages.append(update)
                cleared = self.kv.to_clear(update)
                clear.extend(cleared)
                if self.proposer is not None:          # a draft model's cache follows the same tables
                    self.proposer.tables([update], cleared)
            if ahead:
                wanted.append((len(segments), seq, ahead))
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
        drafts = self._speculate(wanted, segments, rows, reach, members)
        self.flights[g].append(Flight(members, reach, any(sample)))
        return WorkItem(g, segments, np.asarray(rows, dtype=np.int64), new, sample, clear, echo, pages, drafts)

    def _lookahead(self, seq: Sequence, start: int, length: int) -> int:
        """Tokens to propose after a decode row of ``seq`` (0: plain decoding).

        The verified tokens must stay within its reservation and context, and the kept ones within max_tokens:
        start + k + 1 positions written, up to k + 1 tokens kept (so k <= limit - start - 2). Requests that
        report log-probabilities or follow a grammar decode plainly.
        """
        params = seq.request.params
        if self.proposer is None or length != 1 or start + 1 != len(seq.tokens) or params.logprobs >= 0 \
                or params.grammar or params.prompt_logprobs:
            return 0
        return max(0, min(self.speculate_tokens, seq.limit - start - 2))

    def _speculate(self, wanted: list, segments: list[Segment], rows: list[int], reach: list[int],
                   members: list[Sequence]) -> list[tuple[int, list[int]]]:
        """Ask the proposer, then lengthen each speculating decode segment by its proposals (in place)."""
        if not wanted:
            return []
        proposals = self.proposer.propose([(seq, k) for _, seq, k in wanted])
        drafts, extra = [], {}
        for (index, seq, _), proposed in zip(wanted, proposals, strict=True):
            if proposed:
                drafts.append((index, list(proposed)))
                extra[index] = list(proposed)
                seg = segments[index]
                segments[index] = Segment(seg.slot, seg.start, 1 + len(proposed))
                reach[index] += len(proposed)
                seq.sent += len(proposed)
        if extra:      # rows in segment order: each drafted decode row is followed by its proposals
            rebuilt, at = [], 0
            for index, seg in enumerate(segments):
                length = seg.length - len(extra.get(index, ()))
                rebuilt.extend(rows[at:at + length])
                rebuilt.extend(extra.get(index, ()))
                at += length
            rows[:] = rebuilt
        return drafts

    def complete(self, group: int, tokens: list[int], details: dict | None = None,
                 spec: dict | None = None) -> list[Event]:
        """Take the group's oldest item's tokens (one per segment, -1 where none was sampled); return the events.

        ``details`` (by segment index; hpcpipe.serve.protocol.Detail): the log-probabilities of the prompt rows
        and of the sampled token, and whether the sequence's grammar is complete (it then finishes "stop").
        ``spec`` (by segment index): the tokens a speculating segment kept (its accepted proposals and one more).
        """
        details, spec = details or {}, spec or {}
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
                self.kv.fail(seq)
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
            kept = spec.get(index, [int(token)])
            if index in spec:
                reach = self._verified(seq, reach, kept)
            seq.cached = reach
            self.kv.computed(seq)
            self.kv.trim(seq)
            if reach < len(seq.tokens):
                continue                          # a prompt chunk: nothing sampled yet
            if seq.request.max_new == 0:          # echo alone: the prompt's log-probabilities are the answer
                self._release(seq)
                events.append(self._event(seq, [], "length", None))
                continue
            finish, out = None, []
            for token in kept:
                seq.tokens.append(int(token))
                seq.generated += 1
                out.append(int(token))
                finish = "stop" if int(token) in self.stop_ids or complete else \
                    "length" if seq.generated >= seq.request.max_new or len(seq.tokens) >= self.seq_len else None
                if finish is not None:
                    break
            if finish is not None:
                self._release(seq)
            events.append(self._event(seq, out, finish, None if token_lp is None else [token_lp]))
        return events

    def _verified(self, seq: Sequence, reach: int, kept: list[int]) -> int:
        """Roll a verified segment back to what was kept; return the positions of ``seq`` now cached.

        The segment wrote positions up to ``reach``; those past the last token kept before the new one hold
        rejected proposals: the sequence's length says they are not there (later writes overwrite them).
        """
        proposed = reach - len(seq.tokens)
        accepted = len(kept) - 1
        self.spec_steps += 1
        self.spec_proposed += proposed
        self.spec_accepted += accepted
        cached = len(seq.tokens) + accepted
        seq.sent = cached
        self.proposer.rolled_back(seq, cached)
        return cached

    @staticmethod
    def _event(seq: Sequence, tokens: list[int], finish: str | None, logprobs: list | None) -> Event:
        """The sequence's next event; its first carries the prompt's log-probabilities when they were asked for."""
        prompt = seq.prompt_logprobs if seq.request.params.prompt_logprobs and not seq.reported else None
        seq.reported = True
        return Event(seq.request.id, tokens, finish, logprobs, prompt)
