"""Llama layers split and recomputed: backward_input then backward_weight equals backward (per layer and for the
whole model), forward_cache equals forward's cache, attention without an input gradient."""

import dataclasses

import numpy as np
import pytest
from llama_layer_parts import CASES, SPLIT_SHAPE, build_layer, loaded_model, model_rope, random_groups
from support.split_backward import assert_split_backward_equals_backward

from hpcpipe.nn.core.attention import CausalAttention, SplitQKV
from hpcpipe.nn.core.decoder import Embedding
from hpcpipe.nn.core.dense import linear
from hpcpipe.nn.core.mlps import SwiGLU
from hpcpipe.nn.core.norms import RMSNorm
from hpcpipe.nn.llama.model import LlamaModel


def _attention(params, grads, n_heads, n_kv_heads, rope, xp):
    """Grouped-query attention over the group's attn/{q,k,v,o} (biases when the group has them)."""
    qkv = SplitQKV(params, grads, xp, "attn", None, bias="attn/q/bias" in params)
    return CausalAttention(qkv, linear(params, grads, "attn/o", xp, bias=False), n_heads, n_kv_heads,
                           rope.head_dim, rope, xp)


# --- the split: backward_input + backward_weight == backward; forward_cache == forward's cache

def _layers(rng, tied=True):
    shape = dataclasses.replace(SPLIT_SHAPE, tied=tied)
    groups = random_groups(shape, rng)
    grads = [{k: np.zeros_like(v) for k, v in g.items()} for g in groups]
    emb, blk, fin = groups
    g_emb, g_blk, g_fin = grads
    rope = model_rope(shape, np, np.float64)
    x = rng.standard_normal((2, 6, 12))
    return {
        "rmsnorm": (RMSNorm(blk["attn_norm/weight"], g_blk["attn_norm/weight"], 1e-5, np), x, grads),
        "attention": (_attention(blk, g_blk, 4, 2, rope, np), x, grads),
        "swiglu": (SwiGLU(blk, g_blk, np), x, grads),
        "block": (LlamaModel(shape).block(blk, g_blk, np), x, grads),
        "embedding": (Embedding(emb, g_emb, 6, np), np.array([[1, 1, 2, 6, 1, 0], [0, 2, 2, 3, 1, 1]]), grads),
        "head": (build_layer(shape, 2, fin, g_fin, np, emb["tok_emb"], g_emb["tok_emb"]), x, grads),
    }


LAYERS = ["rmsnorm", "attention", "swiglu", "block", "embedding", "head", "head_untied"]


def _layer(name, rng):
    if name == "head_untied":
        layer, x, grads = _layers(rng, tied=False)["head"]
        assert not layer.tied
        return layer, x, grads
    return _layers(rng)[name]


@pytest.mark.parametrize("name", LAYERS)
def test_backward_input_then_weight_equals_backward(name):
    layer, x, grads = _layer(name, np.random.default_rng(8))
    y, cache = layer.forward(x)
    probe = np.random.default_rng(9).standard_normal(y.shape)
    gx_full = layer.backward(cache, probe.copy())
    full = [{k: v.copy() for k, v in g.items()} for g in grads]
    for g in grads:
        for v in g.values():
            v[...] = 0
    gx, state = layer.backward_input(cache, probe.copy())
    assert not any(v.any() for g in grads for v in g.values())      # the input half touches no weight gradient
    layer.backward_weight(cache, state)
    if gx_full is None:
        assert gx is None
    else:
        np.testing.assert_allclose(gx, gx_full, rtol=0, atol=1e-14)
    for g, want in zip(grads, full, strict=True):
        for k in g:
            np.testing.assert_allclose(g[k], want[k], rtol=0, atol=1e-14, err_msg=k)
    assert any(v.any() for g in grads for v in g.values())


def _flatten(tree):
    out, pending = [], [tree]
    while pending:
        item = pending.pop()
        if isinstance(item, tuple | list):
            pending.extend(item)
        else:
            out.append(item)
    return out


@pytest.mark.parametrize("name", LAYERS)
def test_forward_cache_equals_the_cache_of_forward(name):
    layer, x, _ = _layer(name, np.random.default_rng(3))
    full, quick = _flatten(layer.forward(x)[1]), _flatten(layer.forward_cache(x))
    assert len(full) == len(quick)
    for a, b in zip(full, quick, strict=True):
        if a is None:
            assert b is None
        else:
            np.testing.assert_array_equal(a, b)


def test_attention_without_input_gradient_still_accumulates_weights():
    rng = np.random.default_rng(4)
    layer, x, grads = _layers(rng)["attention"]
    y, cache = layer.forward(x)
    probe = rng.standard_normal(y.shape)
    assert layer.backward(cache, probe, need_input_grad=False) is None
    without = {k: v.copy() for k, v in grads[1].items()}
    for v in grads[1].values():
        v[...] = 0
    layer.backward(cache, probe)
    for k, v in grads[1].items():
        np.testing.assert_array_equal(v, without[k])


def test_model_split_backward_equals_backward():
    shape = CASES["gqa_tied_bias"]
    rng = np.random.default_rng(12)
    model = loaded_model(shape, random_groups(shape, rng))
    tokens, targets = rng.integers(0, shape.vocab, (2, 5)), rng.integers(0, shape.vocab, (2, 5))
    assert_split_backward_equals_backward(model, tokens, targets)
