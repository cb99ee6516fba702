"""GPT layers' hand-written backward against finite differences (float64), the token cross-entropy, and the whole
GPT against JAX autograd written from the contract's equations (float64 and float32)."""

import math

import numpy as np
import pytest
from gpt_layer_parts import gpt_attention, gpt_block, gpt_head, random_group
from support.gpt_reference import jax_gpt as _jax_gpt

from hpcpipe.nn.core.decoder import Embedding
from hpcpipe.nn.core.decoder_model import Decoder
from hpcpipe.nn.core.mlps import GeluMLP
from hpcpipe.nn.core.norms import LayerNorm
from hpcpipe.nn.gpt.model import GPTModel
from hpcpipe.nn.gpt.shape import GPTShape
from hpcpipe.nn.token_loss import token_cross_entropy

EPS = 1e-6


def _fd(objective, array, n_max=60, rng=None):
    """Central differences of objective() w.r.t. up to n_max entries of array (perturbed in place)."""
    flat = array.reshape(-1)
    idx = np.arange(flat.size) if flat.size <= n_max else rng.choice(flat.size, n_max, replace=False)
    out = {}
    for i in idx:
        keep = flat[i]
        flat[i] = keep + EPS
        up = objective()
        flat[i] = keep - EPS
        down = objective()
        flat[i] = keep
        out[int(i)] = (up - down) / (2 * EPS)
    return out


def _assert_fd(analytic, numeric, what):
    flat = analytic.reshape(-1)
    worst = max(abs(flat[i] - v) for i, v in numeric.items())
    scale = max(1.0, max(abs(v) for v in numeric.values()))
    assert worst <= 1e-6 * scale, f"{what}: max |analytic - finite difference| = {worst:g}"


def _check_layer(layer, x, params, grads, rng, input_grad=True):
    """FD-check dL/dx and every dL/dparam of layer for L = sum(forward(x) * probe)."""
    y, cache = layer.forward(x)
    probe = rng.standard_normal(y.shape)
    gx = layer.backward(cache, probe)

    def objective():
        return float((layer.forward(x)[0] * probe).sum())

    if input_grad:
        _assert_fd(gx, _fd(objective, x, rng=rng), "input")
    else:
        assert gx is None
    for name in params:
        _assert_fd(grads[name], _fd(objective, params[name], rng=rng), name)


SHAPE = GPTShape(vocab=7, seq_len=6, d_model=8, n_heads=2, n_blocks=2, d_ff=12, tied=False)


def test_layer_norm_matches_finite_differences():
    rng = np.random.default_rng(0)
    p, g = random_group(SHAPE, 1, rng)
    layer = LayerNorm(p["ln1/weight"], p["ln1/bias"], g["ln1/weight"], g["ln1/bias"], np)
    _check_layer(layer, rng.standard_normal((2, 3, 8)), {k: p[k] for k in ("ln1/weight", "ln1/bias")}, g, rng)


@pytest.mark.parametrize("n_heads", [1, 2, 4])
def test_causal_attention_matches_finite_differences(n_heads):
    rng = np.random.default_rng(n_heads)
    p, g = random_group(SHAPE, 1, rng)
    layer = gpt_attention(p, g, n_heads, np)
    names = [n for n in p if n.startswith("attn/")]
    _check_layer(layer, rng.standard_normal((2, 5, 8)), {n: p[n] for n in names}, g, rng)


def test_gelu_mlp_matches_finite_differences():
    rng = np.random.default_rng(3)
    p, g = random_group(SHAPE, 1, rng)
    names = [n for n in p if n.startswith("mlp/")]
    _check_layer(GeluMLP(p, g, np), rng.standard_normal((2, 4, 8)), {n: p[n] for n in names}, g, rng)


def test_block_matches_finite_differences():
    rng = np.random.default_rng(4)
    p, g = random_group(SHAPE, 1, rng)
    _check_layer(gpt_block(p, g, SHAPE, np), rng.standard_normal((2, 5, 8)), p, g, rng)


def test_embedding_accumulates_repeated_tokens():
    rng = np.random.default_rng(5)
    p, g = random_group(SHAPE, 0, rng)
    tokens = np.array([[1, 3, 1, 1], [3, 0, 6, 1]])      # token 1 four times, 3 twice; T = 4 < seq_len
    layer = Embedding(p, g, SHAPE.seq_len, np)
    y, cache = layer.forward(tokens)
    probe = rng.standard_normal(y.shape)
    assert layer.backward(cache, probe) is None
    expect = np.zeros_like(p["tok_emb"])
    for (i, j), tok in np.ndenumerate(tokens):
        expect[tok] += probe[i, j]
    np.testing.assert_allclose(g["tok_emb"], expect, rtol=0, atol=1e-12)
    g["tok_emb"][...] = 0
    g["pos_emb"][...] = 0
    _check_layer(layer, tokens, p, g, rng, input_grad=False)
    assert not g["pos_emb"][4:].any()                  # positions past T get no gradient


@pytest.mark.parametrize("tied", [True, False])
def test_output_head_matches_finite_differences(tied):
    rng = np.random.default_rng(6)
    shape = GPTShape(7, 6, 8, 2, 2, tied=tied)
    p, g = random_group(shape, shape.n_blocks + 1, rng)
    emb, g_emb = random_group(shape, 0, rng)
    g_emb["tok_emb"][...] = 0
    layer = gpt_head(shape, p, g, np, emb["tok_emb"], g_emb["tok_emb"])
    assert layer.tied == tied
    params, grads = dict(p), dict(g)
    if tied:                                           # the head's gradient lands in tok_emb's
        params["tok_emb"], grads["tok_emb"] = emb["tok_emb"], g_emb["tok_emb"]
    _check_layer(layer, rng.standard_normal((2, 3, 8)), params, grads, rng)
    if tied:
        assert g_emb["tok_emb"].any()
    else:
        assert not g_emb["tok_emb"].any()


def test_token_cross_entropy_matches_finite_differences_and_log_sum_exp():
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((2, 3, 5)) * 3
    targets = np.array([[0, 4, 4], [2, 2, 1]])
    total, grad = token_cross_entropy(np, logits.copy(), targets, 0.25)
    by_hand = sum(math.log(np.exp(logits[i, j]).sum()) - logits[i, j, targets[i, j]]
                  for i in range(2) for j in range(3))
    assert total == pytest.approx(by_hand, rel=1e-12)
    numeric = _fd(lambda: 0.25 * token_cross_entropy(np, logits.copy(), targets, 1.0)[0], logits)
    _assert_fd(grad, numeric, "logits")
    big, _ = token_cross_entropy(np, logits + 1000.0, targets, 1.0)   # shift-invariant, no overflow
    assert big == pytest.approx(total, rel=1e-9)
    with pytest.raises(ValueError, match="do not match"):
        token_cross_entropy(np, logits, targets[:, :2], 1.0)
    # the gradient is computed in the logits' own buffer (no vocab-sized temporaries)
    buffer = logits.astype(np.float32)
    _, g32 = token_cross_entropy(np, buffer, targets, 0.25)
    assert np.shares_memory(g32, buffer) and g32.dtype == np.float32
    np.testing.assert_allclose(g32, grad, rtol=1e-5, atol=1e-7)


# --- the whole GPT against JAX autograd written directly from the contract's equations

@pytest.fixture
def x64():
    import jax
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", before)


def _gpt_errors(shape, dtype, seed=0, batch=3, t=None):
    """Return (relative loss error, max |grad - JAX| / max |JAX grad|) of a GPT on random tokens."""
    rng = np.random.default_rng(seed)
    groups = [random_group(shape, i, rng)[0] for i in range(shape.n_groups)]
    t = t or shape.seq_len
    tokens = rng.integers(0, shape.vocab, (batch, t))
    targets = rng.integers(0, shape.vocab, (batch, t))
    model = Decoder(GPTModel(shape), np, dtype)
    for i, g in enumerate(groups):
        model.load_group(i, g)
    loss = model.loss_and_grad(tokens, targets)
    assert model.forward(tokens)[0].dtype == np.dtype(dtype)          # no silent promotion to float64
    ref_loss, ref_grads = _jax_gpt(shape, groups, tokens, targets)
    largest = max(np.abs(v).max() for g in ref_grads for v in g.values())
    worst = max(np.abs(model.grads[i][k] - v).max() for i, g in enumerate(ref_grads) for k, v in g.items())
    assert set(ref_grads[-1]) == set(model.grads[-1])
    return abs(loss - ref_loss) / abs(ref_loss), worst / largest


GPT_SHAPES = [
    (GPTShape(vocab=13, seq_len=6, d_model=8, n_heads=1, n_blocks=2), None),
    (GPTShape(vocab=13, seq_len=6, d_model=16, n_heads=4, n_blocks=2, d_ff=24), 5),
    (GPTShape(vocab=11, seq_len=5, d_model=12, n_heads=4, n_blocks=1, d_ff=20), None),
]


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("case", range(len(GPT_SHAPES)))
def test_gpt_matches_jax_float64(x64, case, tied):
    base, t = GPT_SHAPES[case]
    shape = GPTShape(base.vocab, base.seq_len, base.d_model, base.n_heads, base.n_blocks, base.d_ff, tied)
    loss_err, grad_err = _gpt_errors(shape, "float64", seed=case, t=t)
    assert loss_err < 1e-12 and grad_err < 1e-9, (loss_err, grad_err)


@pytest.mark.parametrize("tied", [True, False])
def test_gpt_matches_jax_float32(x64, tied):
    base, t = GPT_SHAPES[1]
    shape = GPTShape(base.vocab, base.seq_len, base.d_model, base.n_heads, base.n_blocks, base.d_ff, tied)
    loss_err, grad_err = _gpt_errors(shape, "float32", seed=11, t=t)
    assert loss_err < 1e-5 and grad_err < 1e-4, (loss_err, grad_err)
