"""The engine side of logprobs and echo (no MPI: the pipeline's head at pp = 1 on a real DecodeStage): float32
log-softmax and its top alternatives, the prompt rows of a chunked prefill reported once and in order, max_tokens 0,
the usual rows' logits unchanged when the head is applied to more rows, a sequence whose logits are not finite
failing alone."""

import numpy as np
import pytest

from hpcpipe.evaluate import logits_of
from hpcpipe.nn.core.decode import DecodeStage, Segment
from hpcpipe.nn.core.decoder_model import Decoder
from hpcpipe.nn.gpt.model import GPTModel
from hpcpipe.nn.gpt.shape import GPTShape
from hpcpipe.serve.broker import Request
from hpcpipe.serve.last_stage import SamplerTable, forward_rows, logit_rows
from hpcpipe.serve.logprobs import entries, log_softmax32, top
from hpcpipe.serve.roles import Head
from hpcpipe.serve.sampling import SamplingParams
from hpcpipe.serve.scheduler import FAILED, ReplicaScheduler

SHAPE = GPTShape(vocab=40, seq_len=32, d_model=16, n_heads=2, n_blocks=2, tied=False)


def _model_and_stage(slots: int = 3):
    model = Decoder(GPTModel(SHAPE), dtype="float32", seed=2)
    model.flat[...] += 0.3 * np.random.default_rng(2).standard_normal(model.flat.shape).astype("float32")
    arrays = {i: {n: np.array(v) for n, v in g.items()} for i, g in enumerate(model.params)}
    return model, DecodeStage(GPTModel(SHAPE), range(SHAPE.n_groups), arrays, np, "float32", slots=slots)


def _reference(model, ids: list[int]) -> np.ndarray:
    """float64 log-softmax of the full forward's logits over ids: row t predicts ids[t + 1]."""
    z = logits_of(model, np.asarray([ids]))[0].astype(np.float64)
    return z - z.max(-1, keepdims=True) - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True))


def test_log_softmax32_and_the_top_alternatives():
    z = np.random.default_rng(0).standard_normal((3, 50)).astype(np.float32) * 5
    want = z.astype(np.float64) - np.log(np.exp(z.astype(np.float64)).sum(-1, keepdims=True))
    got = log_softmax32(z)
    assert got.dtype == np.float32 and np.abs(got - want).max() < 1e-5
    row = np.array([-1.0, -3.0, -1.0, -0.5, -3.0], dtype=np.float32)
    assert top(row, 3) == [(3, -0.5), (0, -1.0), (2, -1.0)]          # ties: the lower id first
    assert top(row, 0) == [] and [t for t, _ in top(row, 9)] == [3, 0, 2, 1, 4]
    assert entries(z[:1], [7], 2)[0][:2] == (7, float(got[0, 7]))
    z[1, 3] = np.nan
    assert entries(z[:2], [1, 2], 2) is None                          # a row that is not finite: no report


def test_the_head_applied_to_more_rows_leaves_the_usual_rows_unchanged():
    _, stage = _model_and_stage()
    segments = [Segment(0, 0, 5), Segment(1, 0, 1), Segment(2, 0, 3)]
    x = np.arange(9, dtype=np.int64) % SHAPE.vocab
    plain = stage.forward(x, segments).copy()
    for slot in range(3):
        stage.clear_slot(slot)
    echo = [(0, 1, [9, 9, 9]), (2, 0, [9])]
    rows = logit_rows(segments, echo)
    assert rows == [4, 5, 8, 1, 2, 3, 6]
    more = forward_rows(stage, x, segments, rows)
    assert more.shape == (7, SHAPE.vocab) and np.array_equal(more[:3], plain)
    with pytest.raises(ValueError, match="logit row 9 out of range 0..8"):
        stage.forward(x, segments, rows=[9])


def _serve(requests: list[Request], prefill_tokens: int = 3) -> tuple[dict, dict, dict]:
    """Run the requests through a head at pp = 1; return tokens, finish and events by request id."""
    model, stage = _model_and_stage()
    scheduler = ReplicaScheduler(slots=3, groups=1, seq_len=SHAPE.seq_len, prefill_tokens=prefill_tokens)
    events = []
    head = Head(stage, scheduler, None, 1, np, SamplerTable(lambda x: x, SHAPE.vocab), events.extend)
    for r in requests:
        scheduler.submit(r)
    for _ in range(60):
        head.step()
    by = {}
    for e in events:
        by.setdefault(e.request_id, []).append(e)
    return model, by


def test_echoed_prompt_rows_and_generated_tokens_equal_the_full_forward_log_softmax():
    prompt = [3, 17, 5, 22, 9, 1, 30, 12]
    echo = SamplingParams(temperature=0.0, logprobs=3, prompt_logprobs=True)
    model, by = _serve([Request("e", prompt, 4, echo, 0.0), Request("z", prompt[:5], 0, echo, 0.0),
                        Request("p", prompt[:4], 3, SamplingParams(temperature=0.7, seed=4, logprobs=0), 0.0)])
    e = by["e"]
    # the prompt's rows come once, with the first event, all of them although the prompt was prefilled in 3 chunks
    assert [len(x.prompt_logprobs or []) for x in e] == [len(prompt) - 1, 0, 0, 0]
    assert all(x.prompt_logprobs is None for x in e[1:])
    generated = [t for x in e for t in x.tokens]
    ids = prompt + generated
    ref = _reference(model, ids)
    rows = e[0].prompt_logprobs + [lp for x in e for lp in x.logprobs]
    for t, (token, value, alternatives) in enumerate(rows, start=1):
        assert token == ids[t] and abs(value - ref[t - 1, token]) < 1e-5, t
        assert [a for a, _ in alternatives] == list(np.argsort(-ref[t - 1], kind="stable")[:3])
    # max_tokens 0: the prompt's rows, then "length" with no token
    z = by["z"]
    assert [(x.tokens, x.finish) for x in z] == [([], "length")]
    assert [(t, round(v, 5)) for t, v, _ in z[0].prompt_logprobs] == [(t, round(v, 5)) for t, v, _ in rows[:4]]
    # a sampled token's own log-probability, no alternatives, no prompt rows without echo
    p = by["p"]
    assert all(x.prompt_logprobs is None and len(x.logprobs) == 1 and x.logprobs[0][2] == [] for x in p)
    ref = _reference(model, prompt[:4] + [t for x in p for t in x.tokens])
    assert all(abs(x.logprobs[0][1] - ref[3 + i, x.tokens[0]]) < 1e-5 for i, x in enumerate(p))


@pytest.mark.parametrize("kv_cache", [True, False])
def test_the_prompt_rows_are_reported_once_with_or_without_a_kv_cache(kv_cache):
    s = ReplicaScheduler(slots=2, groups=1, seq_len=16, kv_cache=kv_cache, prefill_tokens=2)
    s.submit(Request("a", [1, 2, 3, 4, 5], 3, SamplingParams(temperature=0.0, logprobs=0, prompt_logprobs=True), 0.0))
    reported, events = [], []
    for _ in range(8):
        item = s.next_item()
        if item is None:
            break
        targets = [t for _, _, part in item.echo for t in part]
        reported.extend(targets)
        events += s.complete(item.group, [7 if flag else -1 for flag in item.sample],
                             {0: ([(t, -1.0, []) for t in targets], (7, -1.0, []) if item.sample[0] else None, False)})
    assert reported == [2, 3, 4, 5]                  # each prompt row once, though the whole prefix is recomputed
    assert [[t for t, _, _ in e.prompt_logprobs or []] for e in events] == [[2, 3, 4, 5], [], []]
    assert [e.tokens for e in events] == [[7]] * 3 and events[-1].finish == "length"


def test_a_prompt_whose_logits_are_not_finite_fails_alone(capfd):
    table = SamplerTable(lambda x: x, 10)
    table.start([(0, SamplingParams(temperature=0.0, logprobs=1, prompt_logprobs=True)),
                 (1, SamplingParams(temperature=0.0, logprobs=1))])
    logits = np.random.default_rng(1).standard_normal((4, 10)).astype(np.float32)
    logits[2, 3] = np.nan                                      # an echo row of slot 0
    segments = [Segment(0, 0, 3), Segment(1, 0, 1)]
    tokens, details, _ = table.pick(logits, segments, [True, True], [(0, 0, [4, 5])])
    assert tokens[0] == FAILED and 0 not in details and tokens[1] == int(np.argmax(logits[1]))
    assert details[1][1][0] == tokens[1] and details[1][0] is None
    assert "slot 0" in capfd.readouterr().err
