"""The KV-block pool, the prefix keys and the n-gram proposals on their own (no MPI, no model)."""

import pytest

from hpcpipe.config import ConfigError, load_config
from hpcpipe.serve.broker import Request
from hpcpipe.serve.kv_blocks import BlockPool
from hpcpipe.serve.kv_ledger import KVLedger
from hpcpipe.serve.prefix_cache import block_key, prefix_keys
from hpcpipe.serve.sampling import SamplingParams
from hpcpipe.serve.scheduler import Sequence
from hpcpipe.serve.speculate import ngram_proposal


def _seq(rid, prompt, max_new=4, slot=0):
    return Sequence(Request(rid, prompt, max_new, SamplingParams(temperature=0.0), 0.0), slot, 0, list(prompt))


def test_keys_chain_the_whole_prefix():
    a, b = prefix_keys([1, 2, 3, 4, 5, 6], 2, 3), prefix_keys([9, 2, 3, 4, 5, 6], 2, 3)
    assert len(a) == 3 and len(set(a)) == 3
    assert all(x != y for x, y in zip(a, b, strict=True))      # same block tokens, another prefix: another key
    assert prefix_keys([1, 2, 3, 4, 5, 6], 2, 3, a[0], 1) == a[1:]
    assert block_key(b"", [1, 2]) == a[0]


def test_the_least_recently_used_cached_block_is_evicted_first():
    pool = BlockPool(3)
    assert pool.reserve(3)
    blocks = [pool.take() for _ in range(3)]
    for i, block in enumerate(blocks):
        pool.register(block, bytes([i]))
    for block in (blocks[1], blocks[0], blocks[2]):               # released in this order: 1 is the oldest
        pool.release(block)
    assert pool.available == 3 and len(pool.cached) == 3
    assert pool.reserve(1) and pool.take() == blocks[1] and pool.evictions == 1
    assert pool.lookup(bytes([1])) is None and pool.lookup(bytes([0])) == blocks[0]


def test_a_reservation_counts_idle_hits_and_refuses_what_does_not_fit():
    pool = BlockPool(4)
    assert pool.reserve(2)
    held = [pool.take(), pool.take()]
    pool.register(held[0], b"k")
    pool.release(held[0])                                          # cached, evictable
    assert pool.available == 3
    assert not pool.reserve(3, [held[0]])                         # 3 new + the idle hit > 3
    assert pool.refs[held[0]] == 0 and pool.reserved == 0         # nothing done
    assert pool.reserve(2, [held[0]]) and pool.refs[held[0]] == 1 and pool.available == 0


def test_the_ledger_shares_a_prefix_and_gives_it_back():
    ledger = KVLedger(8, 4, 16)
    first = _seq("a", list(range(10)), max_new=2)
    assert ledger.admit(first) and first.cached == 0 and first.reserved == 3
    assert ledger.grow(first, 11) == (0, 0, [0, 1, 2])
    first.cached = 11
    ledger.computed(first)
    assert len(first.keys) == 2                                   # blocks 0 and 1 are full and computed
    second = _seq("b", list(range(9)) + [42], max_new=2, slot=1)
    assert ledger.admit(second) and second.blocks == [0, 1] and second.cached == 8 and second.reserved == 1
    assert ledger.pool.shared == 2 and ledger.first_table(second) == (1, 0, [0, 1])
    third = _seq("c", list(range(8)), max_new=1, slot=2)          # hits stop before its last token's block
    assert ledger.admit(third) and third.blocks == [0] and third.cached == 4
    assert not ledger.admit(_seq("d", list(range(100, 114)), max_new=2, slot=3))   # 4 blocks, 3 left
    for seq in (first, second, third):
        ledger.release(seq)
    assert ledger.pool.in_use == 0 and ledger.pool.reserved == 0 and len(ledger.pool.cached) == 2
    assert ledger.numbers()[5:] == (3, 2, 28, 12)                 # queries, hits, queried and cached tokens


def test_a_failed_sequence_leaves_its_blocks_unkeyed_and_dirty():
    ledger = KVLedger(4, 4, 16)
    seq = _seq("a", list(range(9)))
    ledger.admit(seq)
    update = ledger.grow(seq, 9)
    seq.cached = 9
    ledger.computed(seq)
    ledger.fail(seq)
    ledger.release(seq)
    assert not ledger.pool.hash_of and ledger.pool.dirty == set(update[2])
    again = _seq("b", list(range(9)))
    assert ledger.admit(again) and again.cached == 0              # nothing of it is reused
    taken = ledger.grow(again, 9)[2]
    cleared = ledger.to_clear((0, 0, taken))
    assert cleared == [b for b in taken if b in update[2]] and cleared      # zeroed before their next use
    assert ledger.pool.dirty == set(update[2]) - set(cleared)              # the others stay marked until then


@pytest.mark.parametrize("tokens,k,want", [
    ([1, 2, 3, 9, 1, 2, 3], 3, [9, 1, 2]),       # the last 3 tokens occurred before: what followed them
    ([5, 1, 2, 7, 8, 1, 2], 2, [7, 8]),          # 2 tokens
    ([4, 6, 5, 6], 4, [5, 6]),                   # 1 token, fewer than k left
    ([1, 2, 3, 4], 3, []),                       # nothing repeats
    ([7], 3, []),
    ([1, 2, 1, 2, 1, 2], 2, [1, 2]),             # the latest occurrence
    ([3, 1, 2, 8, 1, 2, 9, 1, 2], 3, [9, 1, 2]),   # the latest with k tokens after it (into the suffix)
    ([3, 1, 2, 8, 1, 2, 9, 1, 2], 7, [8, 1, 2, 9, 1, 2]),   # none has 7 after it: the earliest
    ([5] + [7] * 9, 3, [7, 7, 7]),               # a run: not the single token before the suffix
    ([5, 7, 7, 7, 7, 7], 3, [7, 7]),
])
def test_ngram_proposals_follow_the_latest_earlier_occurrence(tokens, k, want):
    assert ngram_proposal(tokens, k) == want


@pytest.mark.parametrize("setting,message", [
    ("serve.kv_block=0", "serve.kv_block must be >= 1"),
    ("serve.kv_blocks=-1", "serve.kv_blocks must be >= 0"),
    ("serve.speculate='eagle'", "serve.speculate must be '', 'ngram' or 'draft'"),
    ("serve.speculate_tokens=17", "serve.speculate_tokens must be in 1..16"),
    ("serve.speculate='draft'", "serve.speculate = 'draft' needs serve.draft"),
    # a draft model with ngram (or no) speculation was ignored without a word
    (("serve.speculate='ngram'", "serve.draft='small'"), "serve.draft 'small' is used only with serve.speculate "
                                                         "= 'draft' \\(it is 'ngram'\\)"),
    ("serve.draft='small'", "serve.draft 'small' is used only with serve.speculate = 'draft' \\(it is ''\\)"),
    # was accepted: 6 of the 8 groups held no slot, and the serving line still said nothing
    (("serve.micro_batches=8", "serve.max_sequences=2"), "serve.micro_batches \\(8\\) must be <= serve.max_sequences "
                                                         "\\(2\\): each group is a block of KV-cache slots, so 6 of"),
])
def test_bad_serve_keys_are_refused_with_one_message(setting, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, list(setting) if isinstance(setting, tuple) else [setting])
