"""KV-cached decoding (hpcpipe.nn.core.decode) against the training forward of the whole prefix, and greedy / seeded
generation through DecodeStage against the sequential no-cache reference (hpcpipe.serve.reference)."""

import numpy as np
import pytest

from hpcpipe.nn.core.decode import DecodeStage, Segment
from hpcpipe.nn.core.decoder_model import Decoder
from hpcpipe.nn.gpt.model import GPTModel
from hpcpipe.nn.gpt.shape import GPTShape
from hpcpipe.serve.reference import reference_generate
from hpcpipe.serve.sampling import Sampler, SamplingParams

SHAPES = {
    "tied": GPTShape(vocab=37, seq_len=24, d_model=16, n_heads=4, n_blocks=3, tied=True),
    "untied": GPTShape(vocab=29, seq_len=20, d_model=12, n_heads=3, n_blocks=2, d_ff=20, tied=False),
}


def _model(shape, dtype="float64", seed=0):
    """A GPT far from its init (LayerNorm weights != 1, biases != 0, sharp attention) so every term counts."""
    model = Decoder(GPTModel(shape), dtype=dtype, seed=seed)
    rng = np.random.default_rng(seed + 100)
    for group in model.params:
        for view in group.values():
            view += (rng.standard_normal(view.shape) * 0.4).astype(dtype)
    return model


def _arrays(model):
    return {i: {name: np.array(v) for name, v in group.items()} for i, group in enumerate(model.params)}


def _stage(model, groups=None, slots=4, dtype="float64", **kw):
    shape = model.shape
    return DecodeStage(GPTModel(shape), groups or range(shape.n_groups), _arrays(model), np, dtype, slots, **kw)


def _expected(model, prefix):
    """Logits after the last token of ``prefix`` by the training forward over the whole prefix."""
    return model.forward(np.array([prefix], dtype=np.int64))[0][0, -1]


def _assert_rel(got, want, tol):
    err = np.abs(np.asarray(got, dtype=np.float64) - want).max()
    assert err <= tol * np.abs(want).max(), f"max abs error {err:g} vs max |logit| {np.abs(want).max():g}"


def _tokens(shape, n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(0, shape.vocab, n)]


@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_prefill_then_decode_matches_full_forward(kind):
    shape = SHAPES[kind]
    model = _model(shape)
    stage = _stage(model)
    seq = _tokens(shape, shape.seq_len, 1)
    prompt = 7
    logits = stage.forward(np.array(seq[:prompt]), [Segment(2, 0, prompt)])
    assert logits.shape == (1, shape.vocab)
    _assert_rel(logits[0], _expected(model, seq[:prompt]), 1e-12)
    for t in range(prompt, shape.seq_len):
        logits = stage.forward(np.array(seq[t:t + 1]), [Segment(2, t, 1)])
        _assert_rel(logits[0], _expected(model, seq[:t + 1]), 1e-12)


@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_mixed_decode_and_prefill_segments_in_one_call(kind):
    """Several slots with different lengths decode in one call beside a prefill and a chunked prefill (start > 0)."""
    shape = SHAPES[kind]
    model = _model(shape, seed=2)
    stage = _stage(model, slots=7)
    seqs = {slot: _tokens(shape, shape.seq_len, 10 + slot) for slot in range(7)}
    done = dict.fromkeys(seqs, 0)

    def run(plan):
        segments = [Segment(slot, done[slot], n) for slot, n in plan]
        x = np.concatenate([seqs[s.slot][s.start:s.start + s.length] for s in segments])
        logits = stage.forward(x, segments)
        assert logits.shape == (len(segments), shape.vocab)
        for row, seg in zip(logits, segments, strict=True):
            done[seg.slot] += seg.length
            _assert_rel(row, _expected(model, seqs[seg.slot][:done[seg.slot]]), 1e-12)

    run([(3, 5), (0, 2)])
    run([(0, 1), (1, 4), (3, 1)])                  # decode, prefill, decode
    run([(3, 1), (1, 1), (0, 1), (4, 1)])          # four decodes at lengths 7, 5, 4, 1 (a 1-token prompt), slot 2
    #                                                unused: queries spread over the span of slots 0..4
    run([(1, 3), (4, 1), (3, 1), (2, 6)])          # a chunked prefill of slot 1 (start 5) among decodes
    run([(6, 2), (0, 1), (5, 1)])                  # decode slots 0 and 5: gathered, not read in place
    for _ in range(3):
        run([(0, 1), (1, 1), (2, 1), (3, 1), (4, 1)])   # slots in order: the cache read in place
    run([(6, 1), (0, 1)])                          # two slots far apart: gathered


def test_a_reused_slot_never_sees_the_previous_sequence():
    """A slot reused for a shorter sequence decodes beside a longer one: the stale keys past its length are masked."""
    shape = SHAPES["tied"]
    model = _model(shape, seed=4)
    stage = _stage(model, slots=2)
    old, new, other = (_tokens(shape, 20, s) for s in (5, 6, 7))
    stage.forward(np.array(old), [Segment(0, 0, 20)])
    stage.forward(np.array(other[:12]), [Segment(1, 0, 12)])
    stage.forward(np.array(new[:3]), [Segment(0, 0, 3)])
    for t in range(3, 8):
        logits = stage.forward(np.array([new[t], other[t + 9]]), [Segment(0, t, 1), Segment(1, t + 9, 1)])
        _assert_rel(logits[0], _expected(model, new[:t + 1]), 1e-12)
        _assert_rel(logits[1], _expected(model, other[:t + 10]), 1e-12)


@pytest.mark.parametrize("kind", ["tied", "untied"])
@pytest.mark.parametrize("cuts", [(2,), (1, 3)])
def test_split_stages_chained_equal_one_stage(kind, cuts):
    shape = SHAPES[kind]
    model = _model(shape, seed=3)
    bounds = (0, *cuts, shape.n_groups)
    tok_emb = _arrays(model)[0]["tok_emb"] if shape.tied else None
    stages = [_stage(model, range(a, b), tok_emb=tok_emb) for a, b in zip(bounds, bounds[1:], strict=False)]
    whole = _stage(model)
    a, b = _tokens(shape, 10, 8), _tokens(shape, 10, 9)
    calls = [([Segment(0, 0, 6), Segment(1, 0, 4)], a[:6] + b[:4]),
             ([Segment(1, 4, 1), Segment(0, 6, 1)], [b[4], a[6]]),
             ([Segment(0, 7, 1), Segment(1, 5, 3)], [a[7]] + b[5:8])]
    for segments, tokens in calls:
        x = np.array(tokens)
        for stage in stages:
            x = stage.forward(x, segments)
            if stage is not stages[-1]:
                assert x.shape == (len(tokens), shape.d_model) and x.flags.c_contiguous
        _assert_rel(x, whole.forward(np.array(tokens), segments), 1e-13)


@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_float32_matches_the_float32_forward(kind):
    shape = SHAPES[kind]
    model = _model(shape, dtype="float32", seed=5)
    stage = _stage(model, dtype="float32")
    seq = _tokens(shape, 12, 11)
    logits = stage.forward(np.array(seq[:6]), [Segment(1, 0, 6)])
    assert logits.dtype == np.float32
    _assert_rel(logits[0], _expected(model, seq[:6]).astype(np.float64), 1e-5)
    for t in range(6, 12):
        logits = stage.forward(np.array(seq[t:t + 1]), [Segment(1, t, 1)])
        _assert_rel(logits[0], _expected(model, seq[:t + 1]).astype(np.float64), 1e-5)


def test_cache_bytes_formula():
    shape = SHAPES["untied"]
    model = _model(shape)
    for groups, blocks in ((range(shape.n_groups), shape.n_blocks), (range(0, 2), 1), (range(3, 4), 0)):
        for dtype in ("float32", "float64"):
            stage = _stage(model, groups, slots=3, dtype=dtype)
            item = np.dtype(dtype).itemsize
            assert stage.cache_bytes == 2 * blocks * 3 * -(-shape.seq_len // 16) * 16 * shape.d_model * item


def test_segment_past_seq_len_is_refused():
    shape = SHAPES["tied"]
    stage = _stage(_model(shape))
    with pytest.raises(ValueError, match=r"start 20 \+ length 5 = 25 exceeds seq_len 24"):
        stage.forward(np.zeros(5, dtype=np.int64), [Segment(0, 20, 5)])
    with pytest.raises(ValueError, match=r"start 24 \+ length 1 = 25 exceeds seq_len 24"):
        stage.forward(np.zeros(2, dtype=np.int64), [Segment(1, 3, 1), Segment(0, 24, 1)])
    stage.forward(np.zeros(4, dtype=np.int64), [Segment(0, 20, 4)])     # exactly full is fine


@pytest.mark.parametrize("segments, tokens, message", [
    ([Segment(4, 0, 1)], 1, "slot 4 out of range 0..3"),
    ([Segment(0, -1, 1)], 1, "start -1 must be >= 0"),
    ([Segment(0, 0, 0)], 0, "length 0 >= 1"),
    ([Segment(1, 0, 2), Segment(1, 2, 1)], 3, "slot 1 appears in two segments"),
    ([Segment(0, 0, 3)], 2, "expected 3 integer token ids"),
    ([], 0, "at least one segment"),
    ([Segment(0, 0, 1)], [37], r"token id 37 out of range 0..36"),
    ([Segment(0, 0, 2)], [3, -1], r"token id -1 out of range 0..36"),
])
def test_bad_segments_are_refused(segments, tokens, message):
    stage = _stage(_model(SHAPES["tied"]))
    with pytest.raises(ValueError, match=message):
        x = np.array(tokens) if isinstance(tokens, list) else np.zeros(tokens, dtype=np.int64)
        stage.forward(x, segments)


def test_bad_construction_is_refused():
    shape = SHAPES["tied"]
    model = _model(shape)
    arrays = _arrays(model)
    with pytest.raises(ValueError, match="tied head on a stage without layer group 0 needs tok_emb"):
        DecodeStage(GPTModel(shape), range(2, shape.n_groups), arrays, np, "float64", 2)
    del arrays[1]["attn/qkv/bias"]
    with pytest.raises(ValueError, match="layer group 1 has no array 'attn/qkv/bias'"):
        DecodeStage(GPTModel(shape), range(0, 2), arrays, np, "float64", 2)
    with pytest.raises(ValueError, match="groups"):
        DecodeStage(GPTModel(shape), range(0, shape.n_groups + 1), arrays, np, "float64", 2)
    stage = DecodeStage(GPTModel(shape), range(2, 4), _arrays(model), np, "float64", 2)
    with pytest.raises(ValueError, match=r"activations of shape \(3, 16\)"):
        stage.forward(np.zeros((3, 8)), [Segment(0, 0, 3)])


def _generate_batched(stage, prompts, max_new, params):
    """Generate for several prompts at once through one DecodeStage: one prefill call, then one decode call per token.

    Sequence i lives in slot i; a sequence stops at max_new tokens or when it fills seq_len.
    """
    seq_len = stage.shape.seq_len
    samplers = [Sampler(params) for _ in prompts]
    outs = [[] for _ in prompts]
    segments = [Segment(i, 0, len(p)) for i, p in enumerate(prompts)]
    x = np.concatenate([np.array(p, dtype=np.int64) for p in prompts])
    while segments:
        logits = stage.forward(x, segments)
        nxt, tokens = [], []
        for row, seg in zip(logits, segments, strict=True):
            end = seg.start + seg.length
            if len(outs[seg.slot]) < max_new and end < seq_len:
                token = samplers[seg.slot].next_token(row)
                outs[seg.slot].append(token)
                if len(outs[seg.slot]) < max_new and end + 1 < seq_len:
                    nxt.append(Segment(seg.slot, end, 1))
                    tokens.append(token)
        segments, x = nxt, np.array(tokens, dtype=np.int64)
    return outs


@pytest.mark.parametrize("kind", ["tied", "untied"])
@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0),
                                    SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=7)])
def test_batched_generation_equals_the_reference(kind, params):
    shape = SHAPES[kind]
    model = _model(shape, seed=6)
    prompts = [_tokens(shape, n, 20 + n) for n in (1, 4, 9, shape.seq_len - 3)]
    stage = _stage(model, slots=len(prompts))
    got = _generate_batched(stage, prompts, 8, params)
    want = [reference_generate(model, p, 8, params) for p in prompts]
    assert got == want
    assert [len(w) for w in want] == [8, 8, 8, 3]       # the last one stops at the context length


def test_reference_stops_at_the_context_and_checks_its_input():
    shape = SHAPES["untied"]
    model = _model(shape)
    greedy = SamplingParams(temperature=0)
    assert len(reference_generate(model, [1] * 5, 100, greedy)) == shape.seq_len - 5
    assert reference_generate(model, [1] * shape.seq_len, 3, greedy) == []
    assert reference_generate(model, [1, 2], 0, greedy) == []
    with pytest.raises(ValueError, match=r"prompt must have 1..20 tokens, got 0"):
        reference_generate(model, [], 3, greedy)
    with pytest.raises(ValueError, match=r"prompt must have 1..20 tokens, got 21"):
        reference_generate(model, [1] * 21, 3, greedy)
    with pytest.raises(ValueError, match=r"prompt token 29 out of range 0..28"):
        reference_generate(model, [1, 29], 3, greedy)
