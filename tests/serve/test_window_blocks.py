"""Under a sliding window on every block a sequence gives back its KV blocks before the window (no MPI, no model):
it holds ``held_pages`` blocks at most however long it runs, a pool of that many blocks serves a context many
times longer, a shared prefix block is only dropped from the sequence's table, and the table entries it drops
name a block it still holds. A model with one full-attention block keeps every block, and its windowed blocks'
rings (hpcpipe.nn.core.kv_pages.ring_layout) cut prompt chunks at their room."""

import pytest

from hpcpipe.config import load_config
from hpcpipe.nn.core.kv_pages import held_pages, joint_window, sequence_window
from hpcpipe.nn.memory import decode_rank_bytes, pool_pages
from hpcpipe.nn.registry import model_def
from hpcpipe.serve.broker import Request
from hpcpipe.serve.kv_ledger import KVLedger
from hpcpipe.serve.sampling import SamplingParams
from hpcpipe.serve.scheduler import ReplicaScheduler, Sequence


def _seq(rid, prompt, max_new, slot=0):
    return Sequence(Request(rid, prompt, max_new, SamplingParams(temperature=0.0), 0.0), slot, 0, list(prompt))


def _run(ledger, seq, table, window, page, step=1):
    """Grow, compute and trim ``seq`` ``step`` positions at a time to its limit, applying the table updates to
    ``table`` and checking after each step that every key a later query sees is in a block the sequence holds;
    return the most blocks it held at once."""
    most = 0
    while seq.cached < seq.limit:
        end = min(seq.limit, seq.cached + step, ledger.room(seq))
        assert end > seq.cached, "the sequence can never move on"
        for update in (ledger.redirect(seq), ledger.grow(seq, end)):
            if update is not None:
                slot, first, blocks = update
                table[first:first + len(blocks)] = blocks
        held = [b for b in seq.blocks[seq.dropped:]]
        most = max(most, len(held), ledger.pool.in_use)
        seq.cached = end
        ledger.computed(seq)
        ledger.trim(seq)
        oldest = max(0, seq.cached - window + 1)          # the oldest key the next query sees
        assert all(table[p // page] in seq.blocks[seq.dropped:] for p in range(oldest, seq.cached)), seq.cached
        assert ledger.pool.reserved == seq.reserved >= 0
    return most


def test_a_windowed_sequence_holds_its_window_not_its_context():
    window, page = 8, 4
    span = held_pages(100, page, window)
    assert span == 4 < 25                                     # 100 positions would be 25 blocks
    ledger = KVLedger(span, page, 100, prefix_cache=False, window=window)       # the pool: one window's blocks
    seq = _seq("a", list(range(10)), max_new=90)
    assert ledger.admit(seq) and seq.limit == 100
    table = [None] * 25
    assert _run(ledger, seq, table, window, page) <= span
    assert seq.dropped == (100 - window + 1) // page
    # the entries it dropped name a block it holds (never one another sequence may fill)
    assert all(b in seq.blocks[seq.dropped:] for b in table[:seq.dropped])
    ledger.release(seq)
    assert ledger.pool.in_use == 0 and ledger.pool.available == span
    # a second one reuses the pool from the start
    again = _seq("b", list(range(3)), max_new=97)
    assert ledger.admit(again) and _run(ledger, again, [None] * 25, window, page, step=5) <= span


def test_a_prompt_chunk_stops_at_the_room_its_window_leaves():
    ledger = KVLedger(4, 4, 64, prefix_cache=False, window=8)
    seq = _seq("a", list(range(40)), max_new=8)
    assert ledger.admit(seq)
    assert ledger.room(seq) == 16                             # 4 blocks from position 0
    assert _run(ledger, seq, [None] * 16, 8, 4, step=40) <= 4     # the 40-token prompt in chunks of the room


def test_a_shared_prefix_block_is_dropped_from_the_table_not_freed():
    window, page = 4, 4
    ledger = KVLedger(12, page, 64, prefix_cache=True, window=window)
    first = _seq("a", list(range(20)), max_new=4)
    assert ledger.admit(first) and ledger.room(first) == 12  # 3 blocks at once
    for end in (12, 20):
        ledger.grow(first, end)
        first.cached = end
        ledger.computed(first)                                # blocks 0..4 keyed, in turn
        if end == 12:
            ledger.trim(first)                                # blocks 0 and 1 given back: keyed, cached
            assert first.dropped == 2 and ledger.room(first) == 20
    second = _seq("b", list(range(20)) + [99], max_new=2, slot=1)
    assert ledger.admit(second)                               # hits: blocks 0..4, the first ones not held
    assert second.cached == 20 and second.dropped == (20 - window + 1) // page == 4
    shared = first.blocks[4]
    assert second.blocks[4] == shared and ledger.pool.refs[shared] == 2
    ledger.trim(first)                                        # first drops blocks 2 and 3: held by no one now
    assert first.dropped == 4 and all(ledger.pool.refs[b] == 0 for b in first.blocks[:4])
    assert all(b in ledger.pool.cached for b in first.blocks[:4])        # still keyed, reusable by a later prefix
    first.cached = 24
    ledger.grow(first, 24)
    ledger.computed(first)
    ledger.trim(first)                                        # first drops block 4, the one second still reads
    assert first.dropped == 5 and ledger.pool.refs[shared] == 1 and shared not in ledger.pool.free
    table = [None] * 16
    _, _, blocks = ledger.first_table(second)
    table[:len(blocks)] = blocks
    assert table[:4] == [shared] * 4 and table[4] == shared   # dropped entries name a block it holds
    ledger.release(first)
    ledger.release(second)
    assert ledger.pool.in_use == 0 and ledger.pool.reserved == 0


def test_the_scheduler_serves_a_long_context_from_a_window_sized_pool():
    sched = ReplicaScheduler(2, 1, 96, kv_block=4, kv_blocks=held_pages(96, 4, 8), window=8, prefill_tokens=0)
    sched.submit(Request("a", list(range(30)), 50, SamplingParams(temperature=0.0), 0.0))
    steps, most = 0, 0
    while not sched.idle and steps < 200:
        item = sched.next_item()
        assert item is not None
        most = max(most, sched.kv.pool.in_use)
        sched.complete(item.group, [7] * len(item.segments))
        steps += 1
    # the prompt in chunks of the room left (positions 0-15, 16-23, 24-29), then one item a token
    assert sched.idle and most <= 4 and steps == 3 + 49


def test_one_full_attention_block_keeps_every_block():
    mistral = {"kind": "llama", "vocab_size": 64, "seq_len": 128, "d_model": 16, "n_heads": 2, "n_blocks": 3,
               "sliding_window": 16}
    chunks = ["serve.prefill_tokens=64"]     # a ring holds a prompt chunk: its size is pinned here
    config = load_config(None, [f"model.{k}={v!r}".replace("'", '"') for k, v in mistral.items()] + chunks)
    assert sequence_window(model_def(config)) == 16
    assert pool_pages(config, model_def(config)) == config.serve.max_sequences * 3     # 128 positions: 8 blocks
    mixed = load_config(None, [f"model.{k}={v!r}".replace("'", '"') for k, v in mistral.items()]
                        + ["model.sliding_layers=[0, 2]", "parallel.pp=1"] + chunks)
    assert sequence_window(model_def(mixed)) == 0
    assert pool_pages(mixed, model_def(mixed)) == mixed.serve.max_sequences * 8
    assert joint_window(16, 0) == 0 and joint_window(16, 8) == 16
    # the memory check counts the pool: 3 blocks a sequence under the window; with a full-attention block, 8 for
    # it and a ring for each windowed block (hpcpipe.nn.core.kv_pages.ring_layout) of 7: the window's 16
    # positions and a prompt chunk's 64 (serve.prefill_tokens), the block the window starts in and a new one
    whole = [range(0, 5)]
    assert decode_rank_bytes(config, whole)[1] * (8 + 2 * 7) == decode_rank_bytes(mixed, whole)[1] * 3 * 3 > 0


@pytest.mark.parametrize("blocks", [1, 2])
def test_a_pool_smaller_than_one_window_is_refused(blocks):
    with pytest.raises(ValueError, match="cannot hold one sequence's 16-token sliding window"):
        KVLedger(blocks, 16, 128, window=16)


def test_a_ring_cuts_prompt_chunks_at_its_room_and_keeps_every_block():
    # a model mixing windowed and full blocks: the windowed blocks' rings hold 4 blocks of 4 (an 8-token window);
    # the full blocks keep the pool, so nothing is given back, and there are no prefix hits
    sched = ReplicaScheduler(2, 1, 96, kv_block=4, ring=8, ring_span=held_pages(96, 4, 8), prefill_tokens=0)
    sched.submit(Request("a", list(range(30)), 50, SamplingParams(temperature=0.0), 0.0))
    lengths, most = [], 0
    while not sched.idle and len(lengths) < 200:
        item = sched.next_item()
        assert item is not None
        lengths.append(item.segments[0].length)
        most = max(most, sched.kv.pool.in_use)
        sched.complete(item.group, [7] * len(item.segments))
    # the prompt in chunks of the ring's room (positions 0-15, 16-23, 24-29), then one item a token
    assert sched.idle and lengths[:3] == [16, 8, 6] and lengths[3:] == [1] * 49
    assert most == 80 // 4 and not sched.kv.prefix_cache
