"""A paged KV cache gives the outputs of a whole context per slot: KV blocks of 1, 3 or 16 positions from a small
pool, handed out in a scrambled order, shared by two sequences (a prefix computed once), in the NumPy steps and
the compiled stage (float32, within 1e-5 of the largest logit), for GPT and llama kinds, with a sliding window."""

import numpy as np
import pytest

from hpcpipe.kernels import cpu
from hpcpipe.nn.core.decode import DecodeStage, Segment
from hpcpipe.nn.core.decoder_model import Decoder
from hpcpipe.nn.gpt.model import GPTModel
from hpcpipe.nn.gpt.shape import GPTShape
from hpcpipe.nn.llama.model import LlamaModel
from hpcpipe.nn.llama.shape import LlamaShape

MODELS = {
    "gpt": lambda: GPTModel(GPTShape(37, 24, 32, 2, 2, tied=False)),
    "llama_gqa_window": lambda: LlamaModel(LlamaShape(41, 24, 64, 4, 3, d_ff=64, n_kv_heads=2, sliding_window=5,
                                                      sliding_layers=(0, 2))),
}
COMPILED = [False] + ([True] if cpu.library() is not None else [])


def _calls(vocab, rng):
    """Prompts, decode steps, a chunked prompt beside a decode step; slot 2 reuses slot 0's first 6 positions."""
    prompt = rng.integers(0, vocab, 9)
    calls = [(prompt, [Segment(0, 0, 9)])]
    for t in range(4):
        calls.append((rng.integers(0, vocab, 1), [Segment(0, 9 + t, 1)]))
    calls.append((rng.integers(0, vocab, 7), [Segment(1, 0, 6), Segment(0, 13, 1)]))
    calls.append((rng.integers(0, vocab, 5), [Segment(1, 6, 4), Segment(0, 14, 1)]))
    for t in range(5):
        calls.append((rng.integers(0, vocab, 2), [Segment(1, 10 + t, 1), Segment(0, 15 + t, 1)]))
    return prompt, calls


def _arrays(model):
    rng = np.random.default_rng(1)
    ref = Decoder(model, np, "float32", seed=3)
    return {i: {k: np.array(v) + rng.standard_normal(v.shape).astype(np.float32) * 0.2 for k, v in g.items()}
            for i, g in enumerate(ref.params)}


def _stage(model, arrays, compiled, **kw):
    return DecodeStage(model, range(model.shape.n_groups), arrays, np, "float32", 3, compiled=compiled, **kw)


@pytest.mark.parametrize("compiled", COMPILED)
@pytest.mark.parametrize("page", [1, 3, 16])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_paged_blocks_in_any_order_give_the_whole_context_outputs(name, page, compiled):
    model = MODELS[name]()
    arrays = _arrays(model)
    rng = np.random.default_rng(0)
    prompt, calls = _calls(model.shape.vocab, rng)
    whole = _stage(model, arrays, compiled)                 # each slot its own whole context
    want = [whole.forward(x, seg).copy() for x, seg in calls]

    per_seq = -(-model.shape.seq_len // page)
    paged = _stage(model, arrays, compiled, kv_block=page, kv_blocks=2 * per_seq + 1)
    order = [int(b) for b in rng.permutation(2 * per_seq + 1)]
    paged.set_pages(0, 0, order[:per_seq])
    paged.set_pages(1, 0, order[per_seq:2 * per_seq])
    got = [paged.forward(x, seg) for x, seg in calls]
    scale = max(float(np.abs(w).max()) for w in want)
    assert all(np.abs(g - w).max() <= 1e-5 * scale for g, w in zip(got, want, strict=True))

    # slot 2 shares slot 0's KV blocks holding its first `shared` positions (a prefix hit), then its own
    shared = (6 // page) * page
    if shared:
        mine = [b for b in order[2 * per_seq:]] + order[per_seq:2 * per_seq]    # slot 1 is done with its blocks
        paged.set_pages(2, 0, order[:shared // page] + mine[:per_seq - shared // page])
        rest = prompt[shared:]
        hit = paged.forward(rest, [Segment(2, shared, len(rest))])
        assert np.abs(hit - want[0]).max() <= 1e-5 * scale


def test_table_updates_are_checked():
    model = MODELS["gpt"]()
    stage = _stage(model, _arrays(model), False, kv_block=4, kv_blocks=8)
    with pytest.raises(ValueError, match="KV block 8 out of range 0..7"):
        stage.set_pages(0, 0, [1, 8])
    with pytest.raises(ValueError, match="KV blocks 5..6 of slot 1 exceed the 6"):
        stage.set_pages(1, 5, [1, 2])
    with pytest.raises(ValueError, match="slot 3 out of range 0..2"):
        stage.set_pages(3, 0, [1])
    with pytest.raises(ValueError, match="KV blocks must be a positive integer"):
        _stage(model, _arrays(model), False, kv_blocks=0)


def test_block_grid_finds_strided_tables_only():
    from hpcpipe.nn.core.decode_plan import block_grid
    assert block_grid(np.array([[4, 5, 6]])) == (4, 0)
    assert block_grid(np.array([[0, 1], [8, 9], [16, 17]])) == (0, 8)
    assert block_grid(np.array([[0, 1], [8, 9], [17, 18]])) is None      # steps differ
    assert block_grid(np.array([[0, 2], [8, 10]])) is None                # a sequence's blocks not consecutive
    assert block_grid(np.array([[8, 9], [4, 5], [0, 1]])) == (8, -4)    # falling
    assert block_grid(np.array([[8, 9], [4, 5], [1, 2]])) is None


def test_slots_owning_their_blocks_decode_from_a_view_of_the_cache():
    """The whole-context layout needs no copy of the keys: the gather scratch is never made (NumPy steps)."""
    model = MODELS["llama_gqa_window"]()
    arrays = _arrays(model)
    _, calls = _calls(model.shape.vocab, np.random.default_rng(0))
    grid, scrambled = _stage(model, arrays, False), _stage(model, arrays, False, kv_block=8, kv_blocks=7)
    scrambled.set_pages(0, 0, [5, 2, 0])
    scrambled.set_pages(1, 0, [1, 6, 3])
    for x, seg in calls:
        want = scrambled.forward(x, seg)
        assert np.abs(grid.forward(x, seg) - want).max() <= 1e-6 * np.abs(want).max()
    assert grid._scratch is None and scrambled._scratch is not None
