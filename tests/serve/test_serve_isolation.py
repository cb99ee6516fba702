"""One request's failure stays its own (issue 32): the temperature floor, logits that overflow when divided by
the temperature, non-finite logits failing one sequence only, and that sequence's KV-cache slot cleared before
the next sequence uses it (no MPI: the pipeline's head at pp = 1 on a real DecodeStage)."""

import numpy as np
import pytest

from hpcpipe.nn.core.decode import DecodeStage, Segment
from hpcpipe.nn.core.decoder_model import Decoder
from hpcpipe.nn.gpt.model import GPTModel
from hpcpipe.nn.gpt.shape import GPTShape
from hpcpipe.serve.broker import Request
from hpcpipe.serve.reference import reference_generate
from hpcpipe.serve.roles import Head, SamplerTable
from hpcpipe.serve.sampling import TEMPERATURE_FLOOR, Sampler, SamplingParams
from hpcpipe.serve.scheduler import FAILED, ReplicaScheduler

GREEDY = SamplingParams(temperature=0.0)


@pytest.mark.parametrize("temperature", [5e-324, 1e-308, 1e-300, 1e-6, TEMPERATURE_FLOOR / 2])
def test_a_temperature_below_the_floor_is_greedy_and_draws_nothing(temperature):
    logits = np.random.default_rng(0).standard_normal(40) * 30
    sampler = Sampler(SamplingParams(temperature=temperature, seed=3))
    assert sampler.next_token(logits) == int(np.argmax(logits))          # was: ValueError at 1e-308
    assert sampler.rng.random() == np.random.Generator(np.random.PCG64(3)).random()


def test_at_the_floor_a_token_is_still_sampled():
    sampler = Sampler(SamplingParams(temperature=TEMPERATURE_FLOOR, seed=3))
    assert sampler.next_token(np.zeros(8)) in range(8)
    fresh = np.random.Generator(np.random.PCG64(3))
    fresh.random()
    assert sampler.rng.random() == fresh.random()                         # one draw was taken


def test_logits_that_overflow_when_divided_by_the_temperature_are_greedy():
    z = np.array([1e306, -1e306, 1.5e306, 1e305])           # / 1e-3: inf, -inf, inf, 1e308
    assert Sampler(SamplingParams(temperature=1e-3, seed=1)).next_token(z) == 2     # was: ValueError
    assert Sampler(SamplingParams(temperature=1e-3, top_k=2, seed=1)).next_token(z) == 2


@pytest.mark.parametrize("temperature", [0.0, 1e-9, 0.7])
def test_nan_logits_are_an_error_at_every_temperature(temperature):
    z = np.array([0.5, np.nan, 1.0])
    with pytest.raises(ValueError, match="finite logits: 1 of 3 are NaN"):
        Sampler(SamplingParams(temperature=temperature)).next_token(z)


def test_a_sampling_failure_fails_that_segment_only(capfd):
    table = SamplerTable(lambda x: x)
    table.start([(slot, SamplingParams(temperature=0.8, seed=slot)) for slot in range(3)])
    logits = np.random.default_rng(1).standard_normal((3, 10))
    logits[1, 4] = np.nan
    segments = [Segment(slot, 0, 1) for slot in range(3)]
    tokens = table.sample(logits, segments, [True, True, True])          # was: ValueError for all three
    assert tokens[1] == FAILED and all(0 <= t < 10 for t in (tokens[0], tokens[2]))
    lines = [line for line in capfd.readouterr().err.splitlines() if line]
    assert len(lines) == 1 and "slot 1" in lines[0] and "Traceback" not in lines[0], lines


def test_a_failed_sequence_ends_in_an_error_event_and_its_slot_is_cleared_for_the_next():
    s = ReplicaScheduler(slots=2, groups=1, seq_len=16)
    s.submit(Request("a", [1, 2], 4, GREEDY, 0.0))
    s.submit(Request("b", [3], 4, GREEDY, 0.0))
    item = s.next_item()
    assert item.clear == []
    slot_a = item.segments[0].slot
    events = s.complete(item.group, [FAILED, 7])
    assert [(e.request_id, e.tokens, e.finish) for e in events] == [("a", [], "error"), ("b", [7], None)]
    s.submit(Request("c", [4, 5], 4, GREEDY, 0.0))
    item = s.next_item()
    assert [seg.slot for seg in item.segments if seg.start == 0] == [slot_a] and item.clear == [slot_a]
    s.complete(item.group, [8, 9])
    assert s.next_item().clear == []


def test_a_poisoned_sequence_does_not_leak_into_the_next_sequence_of_its_slot():
    """A's logits are NaN (its token's embedding overflows); B reuses A's slot and decodes beside the longer C."""
    shape = GPTShape(vocab=32, seq_len=32, d_model=16, n_heads=2, n_blocks=2, tied=False)
    model = Decoder(GPTModel(shape), dtype="float32", seed=4)
    model.params[0]["tok_emb"][5] = 3e38
    arrays = {i: {n: np.array(v) for n, v in g.items()} for i, g in enumerate(model.params)}
    stage = DecodeStage(GPTModel(shape), range(shape.n_groups), arrays, np, "float32", slots=2)
    scheduler = ReplicaScheduler(slots=2, groups=1, seq_len=shape.seq_len)
    events = []
    head = Head(stage, scheduler, None, 1, np, SamplerTable(lambda x: x), events.extend)
    a, b, c = [5] * 10, [7, 8], list(range(10, 22))
    scheduler.submit(Request("a", a, 6, GREEDY, 0.0))
    scheduler.submit(Request("c", c, 12, GREEDY, 0.0))
    with np.errstate(all="ignore"):
        head.step()
        scheduler.submit(Request("b", b, 6, GREEDY, 0.0))
        for _ in range(40):
            head.step()
    got = {}
    finish = {}
    for e in events:
        got.setdefault(e.request_id, []).extend(e.tokens)
        if e.finish:
            finish[e.request_id] = e.finish
    assert finish == {"a": "error", "b": "length", "c": "length"}, finish
    assert got["b"] == reference_generate(model, b, 6, GREEDY)
    assert got["c"] == reference_generate(model, c, 12, GREEDY)
