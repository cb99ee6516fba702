"""KV-cached decoding of the llama kind (hpcpipe.nn.core.decode with decode_llama) against Llama.forward over the whole
prefix: prefill and decode, mixed segments, slots in any order and reused, split stages, the cache size (n_kv_heads)."""

import numpy as np
import pytest

from hpcpipe.nn.core.decode import DecodeStage, Segment
from hpcpipe.nn.core.decoder_model import Decoder
from hpcpipe.nn.llama.model import LlamaModel
from hpcpipe.nn.llama.shape import LlamaShape
from hpcpipe.serve.reference import reference_generate
from hpcpipe.serve.sampling import SamplingParams

LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}

SHAPES = {
    "gqa_tied_bias": LlamaShape(vocab=37, seq_len=24, d_model=16, n_heads=4, n_blocks=3, d_ff=24, tied=True,
                                n_kv_heads=2, qkv_bias=True, rope_scaling=LLAMA3),
    "mqa_untied": LlamaShape(vocab=29, seq_len=20, d_model=12, n_heads=4, n_blocks=2, d_ff=20, n_kv_heads=1,
                             head_dim=4, rope_theta=500000.0),
    "mha_linear": LlamaShape(vocab=23, seq_len=18, d_model=8, n_heads=2, n_blocks=2, d_ff=12, tied=True,
                             rope_scaling={"type": "linear", "factor": 2.0}),
}
TOL = {"float64": 1e-10, "float32": 1e-5}


def _model(shape, dtype="float64", seed=0):
    """A Llama far from its init (norm weights != 1, biases != 0, sharp attention) so every term counts."""
    model = Decoder(LlamaModel(shape), dtype=dtype, seed=seed)
    rng = np.random.default_rng(seed + 100)
    for group in model.params:
        for view in group.values():
            view += (rng.standard_normal(view.shape) * 0.4).astype(dtype)
    return model


def _arrays(model):
    return {i: {name: np.array(v) for name, v in group.items()} for i, group in enumerate(model.params)}


def _stage(model, groups=None, slots=4, dtype="float64", **kw):
    shape = model.shape
    return DecodeStage(LlamaModel(shape), groups or range(shape.n_groups), _arrays(model), np, dtype, slots, **kw)


def _expected(model, prefix):
    """Logits after the last token of ``prefix`` by the training forward over the whole prefix."""
    return model.forward(np.array([prefix], dtype=np.int64))[0][0, -1].astype(np.float64)


def _assert_rel(got, want, tol):
    err = np.abs(np.asarray(got, dtype=np.float64) - want).max()
    assert err <= tol * np.abs(want).max(), f"max abs error {err:g} vs max |logit| {np.abs(want).max():g}"


def _tokens(shape, n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(0, shape.vocab, n)]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("kind", sorted(SHAPES))
def test_prefill_then_decode_matches_full_forward(kind, dtype):
    shape = SHAPES[kind]
    model = _model(shape, dtype)
    stage = _stage(model, dtype=dtype)
    seq = _tokens(shape, shape.seq_len, 1)
    prompt = 7
    logits = stage.forward(np.array(seq[:prompt]), [Segment(2, 0, prompt)])
    assert logits.shape == (1, shape.vocab) and logits.dtype == np.dtype(dtype)
    _assert_rel(logits[0], _expected(model, seq[:prompt]), TOL[dtype])
    for t in range(prompt, shape.seq_len):
        logits = stage.forward(np.array(seq[t:t + 1]), [Segment(2, t, 1)])
        _assert_rel(logits[0], _expected(model, seq[:t + 1]), TOL[dtype])


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("kind", ["gqa_tied_bias", "mqa_untied"])
def test_mixed_decode_and_prefill_segments_in_one_call(kind, dtype):
    """Several slots, in any order, decode in one call beside a prefill and a chunked prefill (start > 0)."""
    shape = SHAPES[kind]
    model = _model(shape, dtype, seed=2)
    stage = _stage(model, slots=7, dtype=dtype)
    seqs = {slot: _tokens(shape, shape.seq_len, 10 + slot) for slot in range(7)}
    done = dict.fromkeys(seqs, 0)

    def run(plan):
        segments = [Segment(slot, done[slot], n) for slot, n in plan]
        x = np.concatenate([seqs[s.slot][s.start:s.start + s.length] for s in segments])
        logits = stage.forward(x, segments)
        assert logits.shape == (len(segments), shape.vocab)
        for row, seg in zip(logits, segments, strict=True):
            done[seg.slot] += seg.length
            _assert_rel(row, _expected(model, seqs[seg.slot][:done[seg.slot]]), TOL[dtype])

    run([(3, 5), (0, 2)])
    run([(0, 1), (1, 4), (3, 1)])                  # decode, prefill, decode
    run([(3, 1), (1, 1), (0, 1), (4, 1)])          # decodes out of order, a 1-token prompt; queries spread over a span
    run([(1, 3), (4, 1), (3, 1), (2, 6)])          # a chunked prefill of slot 1 (start 5) among decodes
    run([(6, 2), (0, 1), (5, 1)])                  # decode slots 0 and 5: gathered, not read in place
    for _ in range(3):
        run([(0, 1), (1, 1), (2, 1), (3, 1), (4, 1)])   # slots in order: the cache read in place
    run([(6, 1), (0, 1)])                          # two slots far apart: gathered
    run([(4, 1), (2, 1), (1, 2), (3, 1), (0, 1)])


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_a_reused_slot_never_sees_the_previous_sequence(dtype):
    """A slot reused for a shorter sequence decodes beside a longer one: the stale keys past its length are masked."""
    shape = SHAPES["gqa_tied_bias"]
    model = _model(shape, dtype, seed=4)
    stage = _stage(model, slots=2, dtype=dtype)
    old, new, other = (_tokens(shape, 20, s) for s in (5, 6, 7))
    stage.forward(np.array(old), [Segment(0, 0, 20)])
    stage.forward(np.array(other[:12]), [Segment(1, 0, 12)])
    stage.forward(np.array(new[:3]), [Segment(0, 0, 3)])
    for t in range(3, 8):
        logits = stage.forward(np.array([other[t + 9], new[t]]), [Segment(1, t + 9, 1), Segment(0, t, 1)])
        _assert_rel(logits[1], _expected(model, new[:t + 1]), TOL[dtype])
        _assert_rel(logits[0], _expected(model, other[:t + 10]), TOL[dtype])


@pytest.mark.parametrize("kind", ["gqa_tied_bias", "mqa_untied"])
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


@pytest.mark.parametrize("kind", sorted(SHAPES))
def test_cache_bytes_scale_with_kv_heads(kind):
    shape = SHAPES[kind]
    model = _model(shape)
    head = shape.n_blocks + 1
    for groups, blocks in ((range(shape.n_groups), shape.n_blocks), (range(0, 2), 1), (range(head, head + 1), 0)):
        for dtype in ("float32", "float64"):
            stage = _stage(model, groups, slots=3, dtype=dtype, tok_emb=_arrays(model)[0]["tok_emb"])
            item = np.dtype(dtype).itemsize
            positions = -(-shape.seq_len // 16) * 16           # whole KV blocks of 16
            assert stage.cache_bytes == 2 * blocks * 3 * shape.n_kv_heads * positions * shape.head_dim * item


def test_greedy_generation_equals_the_reference():
    shape = SHAPES["gqa_tied_bias"]
    model = _model(shape, seed=6)
    prompts = [_tokens(shape, n, 20 + n) for n in (1, 4, 9)]
    stage = _stage(model, slots=len(prompts))
    outs = [[] for _ in prompts]
    segments = [Segment(i, 0, len(p)) for i, p in enumerate(prompts)]
    x = np.concatenate([np.array(p) for p in prompts])
    for _ in range(6):
        logits = stage.forward(x, segments)
        tokens = [int(np.argmax(row)) for row in logits]
        for seg, token in zip(segments, tokens, strict=True):
            outs[seg.slot].append(token)
        segments = [Segment(s.slot, s.start + s.length, 1) for s in segments]
        x = np.array(tokens)
    greedy = SamplingParams(temperature=0.0)
    assert outs == [reference_generate(model, p, 6, greedy) for p in prompts]


def test_bad_construction_is_refused():
    shape = SHAPES["gqa_tied_bias"]
    arrays = _arrays(_model(shape))
    with pytest.raises(ValueError, match="tied head on a stage without layer group 0 needs tok_emb"):
        DecodeStage(LlamaModel(shape), range(2, shape.n_groups), arrays, np, "float64", 2)
    del arrays[1]["attn/k/bias"]
    with pytest.raises(ValueError, match="layer group 1 has no array 'attn/k/bias'"):
        DecodeStage(LlamaModel(shape), range(0, 2), arrays, np, "float64", 2)
    arrays[2]["attn/k/weight"] = np.zeros((16, 16))
    with pytest.raises(ValueError, match=r"array 'attn/k/weight' has shape \(16, 16\), expected \(16, 8\)"):
        DecodeStage(LlamaModel(shape), range(2, 3), arrays, np, "float64", 2)
    with pytest.raises(ValueError, match="no KV-cached decoding for a model of type dict"):
        DecodeStage({"vocab": 5}, range(0, 1), arrays, np, "float64", 2)
