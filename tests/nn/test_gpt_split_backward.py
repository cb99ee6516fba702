"""GPT layers split and recomputed: backward_input then backward_weight equals backward (per layer and for the
whole model), forward_cache equals forward's cache, and train.recompute = "stage" is bit-identical on one rank."""

import numpy as np
import pytest
from gpt_layer_parts import gpt_attention, gpt_block, gpt_head, random_group
from support.split_backward import assert_split_backward_equals_backward

from hpcpipe.nn.core.decoder import Embedding
from hpcpipe.nn.core.decoder_model import Decoder
from hpcpipe.nn.core.mlps import GeluMLP
from hpcpipe.nn.core.norms import LayerNorm
from hpcpipe.nn.gpt.model import GPTModel
from hpcpipe.nn.gpt.shape import GPTShape

# --- the split: backward_input + backward_weight == backward; backward_input touches no weight gradient

def _layers_for_split(rng):
    shape = GPTShape(7, 6, 8, 2, 1, tied=True)
    emb, g_emb = random_group(shape, 0, rng)
    blk, g_blk = random_group(shape, 1, rng)
    fin, g_fin = random_group(shape, 2, rng)
    x = rng.standard_normal((2, 5, 8))
    return {
        "layer_norm": (LayerNorm(blk["ln1/weight"], blk["ln1/bias"], g_blk["ln1/weight"], g_blk["ln1/bias"], np),
                       x, [g_blk]),
        "attention": (gpt_attention(blk, g_blk, 2, np), x, [g_blk]),
        "mlp": (GeluMLP(blk, g_blk, np), x, [g_blk]),
        "block": (gpt_block(blk, g_blk, shape, np), x, [g_blk]),
        "embedding": (Embedding(emb, g_emb, shape.seq_len, np), np.array([[1, 1, 2, 6, 1], [0, 2, 2, 3, 1]]),
                      [g_emb]),
        "head_tied": (gpt_head(shape, fin, g_fin, np, emb["tok_emb"], g_emb["tok_emb"]), x, [g_fin, g_emb]),
    }


@pytest.mark.parametrize("name", ["layer_norm", "attention", "mlp", "block", "embedding", "head_tied"])
def test_backward_input_then_weight_equals_backward(name):
    rng = np.random.default_rng(8)
    layer, x, grad_dicts = _layers_for_split(rng)[name]
    arrays = [a for d in grad_dicts for a in d.values()]
    y, cache = layer.forward(x)
    probe = rng.standard_normal(y.shape)
    for a in arrays:
        a[...] = 0
    gx_full = layer.backward(cache, probe.copy())
    full = [a.copy() for a in arrays]
    for a in arrays:
        a[...] = 7.0
    gx, state = layer.backward_input(cache, probe.copy())
    assert all((a == 7.0).all() for a in arrays), "backward_input wrote a weight gradient"
    for a in arrays:
        a[...] = 0
    layer.backward_weight(cache, state)
    for a, b in zip(arrays, full, strict=True):
        np.testing.assert_array_equal(a, b)
    assert any(a.any() for a in arrays)
    if gx_full is None:
        assert gx is None
    else:
        np.testing.assert_array_equal(gx, gx_full)


def test_gpt_split_backward_equals_backward():
    # a zero-bubble stage runs every layer's backward_input first, the weight halves later
    shape = GPTShape(vocab=9, seq_len=4, d_model=8, n_heads=2, n_blocks=2, tied=True)
    rng = np.random.default_rng(12)
    tokens, targets = rng.integers(0, 9, (2, 4)), rng.integers(0, 9, (2, 4))
    model = Decoder(GPTModel(shape), np, "float64", seed=3)
    assert_split_backward_equals_backward(model, tokens, targets)


@pytest.mark.parametrize("name", ["embedding", "block", "head_tied", "head_untied", "dense_identity", "dense_gelu"])
def test_forward_cache_equals_the_cache_of_forward(name):
    """Recomputation builds a layer's cache without its output: the same arrays as forward's cache, bit for bit."""
    from hpcpipe.nn.core.activations import GELU, Activation
    from hpcpipe.nn.core.dense import Dense

    rng = np.random.default_rng(3)
    shape = GPTShape(vocab=13, seq_len=6, d_model=8, n_heads=2, n_blocks=1, tied=name != "head_untied")
    groups = [random_group(shape, i, rng) for i in range(shape.n_groups)]
    h = rng.standard_normal((2, 6, 8))
    if name == "embedding":
        layer, x = GPTModel(shape).build_layer(0, *groups[0], np), rng.integers(0, 13, (2, 6))
    elif name == "block":
        layer, x = GPTModel(shape).build_layer(1, *groups[1], np), h
    elif name.startswith("head"):
        layer, x = gpt_head(shape, *groups[2], np, groups[0][0]["tok_emb"], groups[0][1]["tok_emb"]), h
    else:
        act = Activation() if name == "dense_identity" else GELU()
        w, gw = rng.standard_normal((8, 5)), np.zeros((8, 5))
        layer, x = Dense(0, w, np.zeros(5), gw, np.zeros(5), act, np), h.reshape(12, 8)
    full = layer.forward(x)[1]
    quick = layer.forward_cache(x)
    flat_full, flat_quick = [], []
    for tree, out in ((full, flat_full), (quick, flat_quick)):
        pending = [tree]
        while pending:
            item = pending.pop()
            if isinstance(item, (tuple, list)):
                pending.extend(item)
            else:
                out.append(item)
    assert len(flat_full) == len(flat_quick)
    for a, b in zip(flat_full, flat_quick, strict=True):
        if a is None:
            assert b is None
        else:
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_recompute_is_bit_identical_on_one_rank(kind):
    """train.recompute = "stage" on one rank (MLP and GPT): the same loss and gradients as keeping the caches."""
    from mpi4py import MPI

    from hpcpipe.config import from_dict
    from hpcpipe.train.setup import prepare
    from hpcpipe.train.trainer import Trainer
    model = {"dims": [6, 9, 7, 4], "activation": "gelu"} if kind == "mlp" else \
        {"kind": "gpt", "vocab_size": 20, "seq_len": 5, "d_model": 8, "n_heads": 2, "n_blocks": 2}
    results = []
    for recompute in ("none", "stage"):
        cfg = from_dict({"parallel": {"pp": 1, "dp": 1}, "checkpoint": {"dir": ""}, "log": {"progress": False},
                         "model": model, "train": {"micro_batches": 3, "micro_batch_size": 2, "recompute": recompute}})
        trainer = Trainer(prepare(cfg, 1), MPI.COMM_SELF)
        try:
            results.append((trainer.compute_gradients(0), trainer.params.grad.copy()))
        finally:
            trainer.close()
    assert results[0][0] == results[1][0]
    np.testing.assert_array_equal(results[0][1], results[1][1])
