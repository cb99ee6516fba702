"""Decode steps replayed from captured graphs (hpcpipe.nn.core.decode_graphs) equal the stage's own steps.

On NumPy a capture keeps the step and a replay runs it again over the capture's buffers and plan object, so a
step that read anything but its buffers at replay (a shape, a block table, a position baked in when captured)
would compute the captured call's answer again and fail here. Every model kind of the fused-stage tests, whole
and split stages, the weights widened and (where the compiled products are built) kept as stored or q8_0; sequences
joining and leaving, positions crossing KV blocks, and prompts beside decode steps on the same cache."""

import numpy as np
import pytest
from test_fused_stage import MODELS, _stages

from hpcpipe.kernels import cpu
from hpcpipe.nn.core.decode import DecodeStage
from hpcpipe.nn.core.decode_graphs import GraphedStage, graph_problem, pages_bucket
from hpcpipe.nn.core.decode_plan import Segment
from hpcpipe.nn.core.decoder_model import Decoder


def _calls(vocab, rng):
    """Prompts of three sequences, decode steps of two then three of them (one leaves, one joins), a prompt
    beside a decode step, logit rows: 20 positions with KV blocks of 4 cross a block every fourth token."""
    calls = [(rng.integers(0, vocab, 7), [Segment(0, 0, 3), Segment(2, 0, 4)], None)]
    for t in range(5):
        calls.append((rng.integers(0, vocab, 2), [Segment(0, 3 + t, 1), Segment(2, 4 + t, 1)], None))
    calls.append((rng.integers(0, vocab, 3), [Segment(1, 0, 2), Segment(0, 8, 1)], None))
    for t in range(9):
        calls.append((rng.integers(0, vocab, 3), [Segment(1, 2 + t, 1), Segment(0, 9 + t, 1), Segment(2, 9 + t, 1)],
                      None))
    calls.append((rng.integers(0, vocab, 2), [Segment(1, 11, 1), Segment(0, 18, 1)], [0, 1]))   # logit rows
    for t in range(2):      # up to position 19: the smallest model's context is 20
        calls.append((rng.integers(0, vocab, 2), [Segment(2, 18 + t, 1), Segment(1, 12 + t, 1)], None))
    return calls


def _outputs(stages, calls):
    out = []
    for x, segments, rows in calls:
        for stage in stages:
            x = stage.forward(x, segments, rows if stage is stages[-1] else None)
        out.append(x)
    return out


def _arrays(model):
    ref = Decoder(model, np, "float32", seed=5)
    return {i: {name: np.array(v) for name, v in group.items()} for i, group in enumerate(ref.params)}


@pytest.mark.parametrize("compact", [False, "stored", "q8_0"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_replayed_steps_equal_the_stage(name, compact):
    if compact and cpu.library() is None:
        pytest.skip("compiled kernels not built (no C compiler): no CPU row products")
    model = MODELS[name]()
    arrays = _arrays(model)
    calls = _calls(model.shape.vocab, np.random.default_rng(len(name)))
    n = model.shape.n_groups
    options = {"compiled": False, "kv_block": 4}
    if compact:
        options.update(weight_format=compact, compact=True)
    int8 = cpu.int8_activations() if cpu.library() is not None else None
    if int8 is not None:
        cpu.int8_activations(False)
    try:
        for splits in ([range(n)], [range(0, 2), range(2, n)]):
            want = _outputs(_stages(model, arrays, splits, **options), calls)
            graphed = [GraphedStage(s) for s in _stages(model, arrays, splits, **options)]
            got = _outputs(graphed, calls)
            for step, (g, w) in enumerate(zip(got, want, strict=True)):
                assert g.shape == w.shape, (name, step)
                assert np.abs(g - w).max() <= 1e-5 * np.abs(w).max(), (name, len(splits), step)
            decode = [rows for _, segs, rows in calls if all(s.length == 1 for s in segs)]
            for stage in graphed:     # a call asking for logit rows runs the head's stage as it is
                assert stage.replayed == len(decode) - (stage is graphed[-1]) * sum(r is not None for r in decode)
                # (rows, KV blocks) shapes: 2 or 3 rows; 2, 4, 8 blocks of 4 positions
                assert 2 <= stage.captured <= 6 and stage.captured < stage.replayed, stage.captured
    finally:
        if int8 is not None:
            cpu.int8_activations(int8)


def test_graphs_are_dropped_least_recent_first():
    model = MODELS["gpt_tied"]()
    stage = GraphedStage(DecodeStage(model, range(model.shape.n_groups), _arrays(model), np, "float32", 3,
                                     compiled=False, kv_block=4), kept=2)
    rng = np.random.default_rng(0)
    stage.forward(rng.integers(0, 37, 8), [Segment(0, 0, 8)])
    stage.forward(rng.integers(0, 37, 1), [Segment(0, 8, 1)])                        # (1, 4)
    stage.forward(rng.integers(0, 37, 2), [Segment(0, 9, 1), Segment(1, 0, 1)])      # (2, 4)
    stage.forward(rng.integers(0, 37, 1), [Segment(1, 1, 1)])                        # (1, 1)
    assert list(stage._graphs) == [(2, 4), (1, 1)] and stage.captured == 3


def test_padding_reads_no_other_sequences_blocks():
    """A bucket's padding KV blocks are masked, but a weight of 0 times Inf or NaN is NaN: a lone sequence whose
    table still names a block it gave up (now another sequence's, here holding NaN) must not read it."""
    model = MODELS["gpt_tied"]()
    arrays = _arrays(model)
    outs = []
    for graphs in (False, True):
        stage = DecodeStage(model, range(model.shape.n_groups), arrays, np, "float32", 2, compiled=False,
                            kv_block=4, kv_blocks=12)
        stage.set_pages(0, 0, [4, 5, 6, 7])      # an earlier sequence's blocks
        stage.set_pages(0, 0, [1, 2, 3])         # the next sequence of slot 0: its table still names block 7
        stage.set_pages(1, 0, [7, 8])
        stage._cache[:, :, :, 7] = np.nan        # slot 1's values went non-finite
        stage = GraphedStage(stage) if graphs else stage
        ids = np.random.default_rng(2).integers(0, model.shape.vocab, 12)
        out = [stage.forward(ids[:9], [Segment(0, 0, 9)])]
        out += [stage.forward(ids[9 + t:10 + t], [Segment(0, 9 + t, 1)]) for t in range(3)]   # 3 blocks: bucket 4
        outs.append(out)
    assert stage.replayed == 3 and list(stage._graphs) == [(1, 4)]
    for step, (w, g) in enumerate(zip(*outs, strict=True)):
        assert np.isfinite(w).all() and np.isfinite(g).all(), step
        assert np.abs(g - w).max() <= 1e-5 * np.abs(w).max(), step


def test_bucket_and_refusals():
    assert [pages_bucket(p, 6) for p in (1, 2, 3, 4, 5, 6)] == [1, 2, 4, 4, 6, 6]
    model = MODELS["mistral_window"]()
    arrays = _arrays(model)
    groups = range(model.shape.n_groups)
    ringed = DecodeStage(model, groups, arrays, np, "float32", 2, compiled=False, kv_block=4, kv_ring=3)
    assert "ring caches" in graph_problem(ringed)
    with pytest.raises(ValueError, match="decode graphs: not for this stage: ring caches"):
        GraphedStage(ringed)
    if cpu.library() is not None:
        fused = DecodeStage(model, groups, arrays, np, "float32", 2, compiled=True)
        assert "compiled CPU stage" in graph_problem(fused)
    with pytest.raises(ValueError, match="graphs kept must be a positive integer, got 0"):
        GraphedStage(DecodeStage(model, groups, arrays, np, "float32", 2, compiled=False), kept=0)
    with pytest.raises(ValueError, match="token id 41 out of range"):
        GraphedStage(DecodeStage(model, groups, arrays, np, "float32", 2, compiled=False)).forward(
            np.array([41]), [Segment(0, 0, 1)])
