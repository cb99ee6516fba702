"""Continuous batching of one replica: slots, groups, admission, cancellation, finishing (no MPI, no compute)."""

import numpy as np
import pytest

from hpcpipe.config import ServeConfig
from hpcpipe.serve.broker import Request
from hpcpipe.serve.sampling import SamplingParams
from hpcpipe.serve.scheduler import ReplicaScheduler


def request(i, prompt=(1, 2, 3), max_new=4):
    return Request(f"r{i}", list(prompt), max_new, SamplingParams(temperature=0.0), 0.0)


def run_item(s, token=7):
    item = s.next_item()
    return item, s.complete(item.group, [token] * len(item.segments))


def test_requests_spread_over_groups_and_prefill_then_decode():
    s = ReplicaScheduler(slots=4, groups=2, seq_len=16)
    for i in range(3):
        s.submit(request(i))
    item = s.next_item()
    # three requests over two groups: 2 + 1, every stage gets its own group to work on
    assert sorted(len(g) for g in s.groups) == [1, 2]
    assert [seg.start for seg in item.segments] == [0] * len(item.segments)
    assert all(seg.length == 3 for seg in item.segments)
    assert item.tokens.tolist() == [1, 2, 3] * len(item.segments)
    assert [slot for slot, _ in item.new] == [seg.slot for seg in item.segments]
    other = s.next_item()                     # the other group, while the first is in flight
    assert other.group != item.group
    assert s.next_item() is None              # both groups in flight
    events = s.complete(item.group, [9] * len(item.segments))
    assert all(e.tokens == [9] and e.finish is None for e in events)
    again = s.next_item()
    assert again.group == item.group
    assert [(seg.start, seg.length) for seg in again.segments] == [(3, 1)] * len(item.segments)
    assert again.tokens.tolist() == [9] * len(item.segments)
    assert again.new == []


def test_no_kv_cache_sends_the_whole_sequence_every_step():
    s = ReplicaScheduler(slots=1, groups=1, seq_len=16, kv_cache=False)
    s.submit(request(0))
    run_item(s, 5)
    item = s.next_item()
    assert [(seg.start, seg.length) for seg in item.segments] == [(0, 4)]
    assert item.tokens.tolist() == [1, 2, 3, 5]


def test_max_new_and_context_end_a_sequence_and_free_its_slot():
    s = ReplicaScheduler(slots=1, groups=1, seq_len=5)
    s.submit(request(0, max_new=3))
    s.submit(request(1, prompt=(4,), max_new=10))
    finishes = []
    while not s.idle:
        _, events = run_item(s)
        finishes += [(e.request_id, e.finish) for e in events if e.finish]
    # r0: 3 tokens (max_new); r1 waits for the one slot, then stops when its 5-token context is full
    assert finishes == [("r0", "length"), ("r1", "length")]
    assert s.free == [[0]]


def test_each_group_decodes_a_contiguous_block_of_slots():
    s = ReplicaScheduler(slots=8, groups=2, seq_len=32)
    for i in range(6):
        s.submit(request(i))
    items = [s.next_item(), s.next_item()]
    assert sorted(sorted(seg.slot for seg in item.segments) for item in items) == [[0, 1, 2], [4, 5, 6]]


def test_waiting_requests_start_only_when_a_slot_is_free():
    s = ReplicaScheduler(slots=2, groups=2, seq_len=32)
    for i in range(5):
        s.submit(request(i, max_new=1))
    s.next_item()
    assert s.running == 2 and len(s.waiting) == 3


def test_cancel_waiting_idle_and_in_flight():
    s = ReplicaScheduler(slots=2, groups=1, seq_len=32)
    for i in range(3):
        s.submit(request(i))
    item = s.next_item()                       # r0, r1 in flight; r2 waits
    assert [e.finish for e in s.cancel("r2")] == ["cancelled"]
    assert s.cancel("r1") == []                # in flight: reported when the group comes back
    events = s.complete(item.group, [1, 1])
    assert [(e.request_id, e.finish) for e in events] == [("r0", None), ("r1", "cancelled")]
    assert s.running == 1 and sum(map(len, s.free)) == 1
    assert [e.finish for e in s.cancel("r0")] == ["cancelled"]   # idle group: freed at once
    assert s.idle and s.cancel("nope") == []


def test_a_request_joining_a_group_in_flight_prefills_next_time():
    s = ReplicaScheduler(slots=4, groups=1, seq_len=32)
    s.submit(request(0))
    first = s.next_item()
    s.submit(request(1, prompt=(8, 9)))
    assert s.next_item() is None               # the only group is in flight
    s.complete(first.group, [5])
    item = s.next_item()
    assert [(seg.start, seg.length) for seg in item.segments] == [(3, 1), (0, 2)]
    assert item.tokens.tolist() == [5, 8, 9]
    assert s.cancel("r1") == []               # joined this flight: reported when it returns
    events = s.complete(item.group, [1, 2])
    assert [e.finish for e in events] == [None, "cancelled"]


def test_a_result_for_work_not_in_flight_is_an_error():
    s = ReplicaScheduler(slots=1, groups=1, seq_len=8)
    with pytest.raises(RuntimeError, match="does not match"):
        s.complete(0, [1])
    with pytest.raises(ValueError, match="slots"):
        ReplicaScheduler(0, 1, 8)


def test_tokens_are_int64_rows():
    s = ReplicaScheduler(slots=1, groups=1, seq_len=8)
    s.submit(request(0))
    assert s.next_item().tokens.dtype == np.int64


def test_long_prompts_are_prefilled_in_chunks_within_the_budget():
    s = ReplicaScheduler(slots=3, groups=1, seq_len=64, prefill_tokens=4)
    s.submit(request(0, prompt=range(1, 11)))           # 10 prompt tokens
    s.submit(request(1, prompt=(5, 6)))
    item = s.next_item()
    # r0 takes the whole budget (4 of its 10 tokens), r1 waits: nothing sampled yet
    assert [(seg.start, seg.length) for seg in item.segments] == [(0, 4)]
    assert item.sample == [False] and item.tokens.tolist() == [1, 2, 3, 4]
    assert s.complete(item.group, [-1]) == []
    item = s.next_item()
    assert [(seg.start, seg.length) for seg in item.segments] == [(4, 4)]
    assert item.new == []                                # r0's sampler started with its first chunk
    s.complete(item.group, [-1])
    item = s.next_item()
    # r0's last 2 tokens end its prompt (sampled), r1's 2 tokens fit in the rest of the budget
    assert [(seg.start, seg.length) for seg in item.segments] == [(8, 2), (0, 2)]
    assert item.sample == [True, True]
    events = s.complete(item.group, [7, 8])
    assert [(e.request_id, e.tokens) for e in events] == [("r0", [7]), ("r1", [8])]
    item = s.next_item()
    assert [(seg.start, seg.length) for seg in item.segments] == [(10, 1), (2, 1)]


def test_decode_rows_never_wait_for_the_prefill_budget():
    s = ReplicaScheduler(slots=2, groups=1, seq_len=64, prefill_tokens=2)
    s.submit(request(0, prompt=(1,)))
    run_item(s)                                          # r0 decodes from now on
    s.submit(request(1, prompt=range(1, 9)))
    item = s.next_item()
    assert [(seg.start, seg.length) for seg in item.segments] == [(1, 1), (0, 2)]
    assert item.sample == [True, False]


def test_a_long_prompt_sends_its_next_chunk_while_the_last_is_in_flight():
    # at pp = 2 the head sends chunk 2 while stage 1 runs chunk 1: up to depth prompt-only items per group
    s = ReplicaScheduler(slots=2, groups=1, seq_len=64, prefill_tokens=4, depth=2)
    s.submit(request(0, prompt=range(1, 11)))           # 10 prompt tokens: chunks (0,4) (4,4) (8,2)
    first, second = s.next_item(), s.next_item()
    assert [(seg.start, seg.length) for seg in first.segments + second.segments] == [(0, 4), (4, 4)]
    assert second.tokens.tolist() == [5, 6, 7, 8] and second.new == [] and second.sample == [False]
    assert s.next_item() is None                         # depth items in flight
    assert s.complete(0, [-1]) == [] and s.by_id["r0"].cached == 4
    last = s.next_item()
    assert [(seg.start, seg.length) for seg in last.segments] == [(8, 2)] and last.sample == [True]
    assert s.next_item() is None                         # a sampled item in flight: the group waits for its token
    s.complete(0, [-1])
    assert [(e.request_id, e.tokens) for e in s.complete(0, [9])] == [("r0", [9])]
    item = s.next_item()
    assert [(seg.start, seg.length) for seg in item.segments] == [(10, 1)] and item.tokens.tolist() == [9]


def test_decode_rows_in_flight_hold_the_group_back():
    s = ReplicaScheduler(slots=2, groups=1, seq_len=64, prefill_tokens=2, depth=4)
    s.submit(request(0, prompt=(1,)))
    run_item(s)                                          # r0 decodes from now on
    s.submit(request(1, prompt=range(1, 9)))
    s.next_item()                                        # r0's token and r1's first chunk
    assert s.next_item() is None                         # r0's token must come back first


def test_a_request_cancelled_between_its_chunks_keeps_its_slot_until_the_last_is_back():
    s = ReplicaScheduler(slots=1, groups=1, seq_len=64, prefill_tokens=2, depth=3)
    s.submit(request(0, prompt=range(1, 9)))
    s.next_item(), s.next_item()
    assert s.cancel("r0") == []                          # chunks in flight: reported when the last returns
    s.submit(request(1, prompt=(4, 5)))
    assert s.next_item() is None                         # r0 sends no more chunks; r1 waits for the slot
    assert s.complete(0, [-1]) == []
    assert [(e.request_id, e.finish) for e in s.complete(0, [-1])] == [("r0", "cancelled")]
    item = s.next_item()                                 # the slot is free only now
    assert item.segments[0].start == 0 and item.tokens.tolist() == [4, 5]
    assert s.running == 1 and not s.waiting


def test_depth_one_waits_for_each_chunk():
    s = ReplicaScheduler(slots=1, groups=1, seq_len=64, prefill_tokens=2)
    s.submit(request(0, prompt=range(1, 9)))
    s.next_item()
    assert s.next_item() is None
    with pytest.raises(ValueError, match="depth=0"):
        ReplicaScheduler(1, 1, 8, depth=0)


def test_the_default_config_prefills_a_long_prompt_in_chunks_of_128():
    # 128, not 64, since a 522-token prompt reached its first token sooner at pp = 2 (docs/kernels.md "Prefill")
    s = ReplicaScheduler(slots=2, groups=1, seq_len=512, prefill_tokens=ServeConfig().prefill_tokens, depth=2)
    s.submit(request(0, prompt=range(1, 301)))
    chunks = []
    while (item := s.next_item()) is not None:
        chunks += [(seg.start, seg.length) for seg in item.segments]
    assert chunks == [(0, 128), (128, 128)]          # depth 2: two chunks in flight, the third waits
