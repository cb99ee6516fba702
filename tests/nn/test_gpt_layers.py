"""GPT layers: hand-written backward against finite differences (float64), the whole model against JAX autograd
written from the contract's equations, the split of backward into input and weight halves, the parameter groups."""

import math

import numpy as np
import pytest
from support import ROOT
from support.gpt_reference import jax_gpt as _jax_gpt

from hpcpipe.nn.core.attention import CausalAttention, FusedQKV
from hpcpipe.nn.core.decoder import Block, Embedding, OutputHead
from hpcpipe.nn.core.decoder_model import Decoder
from hpcpipe.nn.core.dense import linear
from hpcpipe.nn.core.mlps import GeluMLP
from hpcpipe.nn.core.norms import LayerNorm
from hpcpipe.nn.gpt.model import GPTModel
from hpcpipe.nn.gpt.shape import GPTShape, block_params, group_params
from hpcpipe.nn.token_loss import token_cross_entropy

EPS = 1e-6


def _attention(params, grads, n_heads, xp):
    """The GPT's attention over ``n_heads`` heads of the group's qkv (attn/qkv, attn/proj)."""
    width = params["attn/proj/weight"].shape[0]
    return CausalAttention(FusedQKV(params, grads, xp, "attn", None), linear(params, grads, "attn/proj", xp),
                           n_heads, n_heads, width // n_heads, None, xp)


def _block(params, grads, shape, xp):
    return GPTModel(shape).block(params, grads, xp)


def _head(shape, params, grads, xp, tok_emb=None, grad_tok_emb=None):
    return GPTModel(shape).build_layer(shape.n_blocks + 1, params, grads, xp, tok_emb, grad_tok_emb)


def _random_group(shape, index, rng):
    """Parameters of group ``index`` far from the init (LayerNorm weights != 1, biases != 0) so every term counts."""
    params = {}
    for name, dims in group_params(shape, index):
        value = rng.standard_normal(dims) * 0.3
        params[name] = value + 1.0 if name.startswith("ln") and name.endswith("weight") else value
    return params, {name: np.zeros_like(v) for name, v in params.items()}


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
    p, g = _random_group(SHAPE, 1, rng)
    layer = LayerNorm(p["ln1/weight"], p["ln1/bias"], g["ln1/weight"], g["ln1/bias"], np)
    _check_layer(layer, rng.standard_normal((2, 3, 8)), {k: p[k] for k in ("ln1/weight", "ln1/bias")}, g, rng)


@pytest.mark.parametrize("n_heads", [1, 2, 4])
def test_causal_attention_matches_finite_differences(n_heads):
    rng = np.random.default_rng(n_heads)
    p, g = _random_group(SHAPE, 1, rng)
    layer = _attention(p, g, n_heads, np)
    names = [n for n in p if n.startswith("attn/")]
    _check_layer(layer, rng.standard_normal((2, 5, 8)), {n: p[n] for n in names}, g, rng)


def test_gelu_mlp_matches_finite_differences():
    rng = np.random.default_rng(3)
    p, g = _random_group(SHAPE, 1, rng)
    names = [n for n in p if n.startswith("mlp/")]
    _check_layer(GeluMLP(p, g, np), rng.standard_normal((2, 4, 8)), {n: p[n] for n in names}, g, rng)


def test_block_matches_finite_differences():
    rng = np.random.default_rng(4)
    p, g = _random_group(SHAPE, 1, rng)
    _check_layer(_block(p, g, SHAPE, np), rng.standard_normal((2, 5, 8)), p, g, rng)


def test_embedding_accumulates_repeated_tokens():
    rng = np.random.default_rng(5)
    p, g = _random_group(SHAPE, 0, rng)
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
    p, g = _random_group(shape, shape.n_blocks + 1, rng)
    emb, g_emb = _random_group(shape, 0, rng)
    g_emb["tok_emb"][...] = 0
    layer = _head(shape, p, g, np, emb["tok_emb"], g_emb["tok_emb"])
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


# --- the split: backward_input + backward_weight == backward; backward_input touches no weight gradient

def _layers_for_split(rng):
    shape = GPTShape(7, 6, 8, 2, 1, tied=True)
    emb, g_emb = _random_group(shape, 0, rng)
    blk, g_blk = _random_group(shape, 1, rng)
    fin, g_fin = _random_group(shape, 2, rng)
    x = rng.standard_normal((2, 5, 8))
    return {
        "layer_norm": (LayerNorm(blk["ln1/weight"], blk["ln1/bias"], g_blk["ln1/weight"], g_blk["ln1/bias"], np),
                       x, [g_blk]),
        "attention": (_attention(blk, g_blk, 2, np), x, [g_blk]),
        "mlp": (GeluMLP(blk, g_blk, np), x, [g_blk]),
        "block": (_block(blk, g_blk, shape, np), x, [g_blk]),
        "embedding": (Embedding(emb, g_emb, shape.seq_len, np), np.array([[1, 1, 2, 6, 1], [0, 2, 2, 3, 1]]),
                      [g_emb]),
        "head_tied": (_head(shape, fin, g_fin, np, emb["tok_emb"], g_emb["tok_emb"]), x, [g_fin, g_emb]),
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
    groups = [_random_group(shape, i, rng)[0] for i in range(shape.n_groups)]
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


def test_gpt_split_backward_equals_backward():
    # a zero-bubble stage runs every layer's backward_input first, the weight halves later
    shape = GPTShape(vocab=9, seq_len=4, d_model=8, n_heads=2, n_blocks=2, tied=True)
    rng = np.random.default_rng(12)
    tokens, targets = rng.integers(0, 9, (2, 4)), rng.integers(0, 9, (2, 4))
    model = Decoder(GPTModel(shape), np, "float64", seed=3)
    model.loss_and_grad(tokens, targets)
    full = model.grad.copy()
    model.grad[...] = 0
    logits, caches = model.forward(tokens)
    _, g = token_cross_entropy(np, logits, targets, 1.0 / targets.size)
    states = []
    for layer, cache in zip(reversed(model.layers), reversed(caches), strict=True):
        g, state = layer.backward_input(cache, g)
        states.append(state)
    assert not model.grad.any()
    for layer, cache, state in zip(reversed(model.layers), reversed(caches), states, strict=True):
        layer.backward_weight(cache, state)
    np.testing.assert_array_equal(model.grad, full)


# --- parameter groups and initial values

def test_param_groups_follow_the_hdf5_contract():
    shape = GPTShape(vocab=50, seq_len=16, d_model=8, n_heads=2, n_blocks=3, d_ff=20, tied=False)
    groups = [group_params(shape, i) for i in range(shape.n_groups)]
    assert len(groups) == 5
    assert groups[0] == [("tok_emb", (50, 8)), ("pos_emb", (16, 8))]
    expect_block = {"ln1/weight": (8,), "ln1/bias": (8,), "attn/qkv/weight": (8, 24), "attn/qkv/bias": (24,),
                    "attn/proj/weight": (8, 8), "attn/proj/bias": (8,), "ln2/weight": (8,), "ln2/bias": (8,),
                    "mlp/fc/weight": (8, 20), "mlp/fc/bias": (20,), "mlp/proj/weight": (20, 8),
                    "mlp/proj/bias": (8,)}
    assert all(dict(groups[i]) == expect_block for i in (1, 2, 3))
    assert dict(groups[4]) == {"ln_f/weight": (8,), "ln_f/bias": (8,), "head/weight": (8, 50)}
    tied = GPTShape(50, 16, 8, 2, 3, tied=True)
    assert dict([group_params(tied, i) for i in range(tied.n_groups)][4]) == {"ln_f/weight": (8,), "ln_f/bias": (8,)}
    assert dict(block_params(tied))["mlp/fc/weight"] == (8, 32)          # d_ff 0 -> 4 * d_model


@pytest.mark.parametrize("bad", [dict(d_model=10, n_heads=4), dict(n_blocks=0), dict(vocab=-1), dict(d_ff=-2),
                                 dict(seq_len=2.0)])
def test_shape_rejects_bad_values(bad):
    fields = dict(vocab=5, seq_len=4, d_model=8, n_heads=2, n_blocks=1) | bad
    with pytest.raises(ValueError, match="GPT"):
        GPTShape(**fields)


def test_init_depends_on_seed_and_group_only_and_is_gpt2_style():
    shape = GPTShape(vocab=300, seq_len=64, d_model=64, n_heads=4, n_blocks=8)
    a = GPTModel(shape).init_group(2, seed=5)
    b = GPTModel(shape).init_group(2, seed=5)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["attn/qkv/weight"], GPTModel(shape).init_group(3, seed=5)["attn/qkv/weight"])
    assert not np.array_equal(a["attn/qkv/weight"], GPTModel(shape).init_group(2, seed=6)["attn/qkv/weight"])
    assert a["attn/qkv/weight"].dtype == np.float32
    assert {k: v.shape for k, v in a.items()} == dict(block_params(shape))
    assert (a["ln1/weight"] == 1).all() and not a["ln1/bias"].any() and not a["attn/qkv/bias"].any()
    assert a["attn/qkv/weight"].std() == pytest.approx(0.02, rel=0.05)
    assert a["mlp/fc/weight"].std() == pytest.approx(0.02, rel=0.05)
    for proj in ("attn/proj/weight", "mlp/proj/weight"):
        assert a[proj].std() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    emb = GPTModel(shape).init_group(0, seed=5)
    assert emb["tok_emb"].std() == pytest.approx(0.02, rel=0.05) and emb["pos_emb"].shape == (64, 64)
    final = GPTModel(GPTShape(300, 64, 64, 4, 8, tied=False)).init_group(9, seed=5)
    assert (final["ln_f/weight"] == 1).all() and final["head/weight"].std() == pytest.approx(0.02, rel=0.05)
    model = Decoder(GPTModel(shape), np, "float32", seed=5)         # the model starts from these values
    assert np.array_equal(model.params[2]["mlp/proj/weight"], a["mlp/proj/weight"])


def test_build_layer_kinds_by_group():
    shape = GPTShape(vocab=9, seq_len=4, d_model=8, n_heads=2, n_blocks=2, tied=True)
    model = Decoder(GPTModel(shape), np, "float64")
    kinds = [type(layer) for layer in model.layers]
    assert kinds == [Embedding, Block, Block, OutputHead]
    assert _head(shape, model.params[3], model.grads[3], np, model.params[0]["tok_emb"],
                 model.grads[0]["tok_emb"]).tied
    with pytest.raises(ValueError, match="tied output head needs tok_emb"):
        _head(shape, model.params[3], model.grads[3], np)
    with pytest.raises(ValueError, match="longer than the 4 positions"):
        model.forward(np.zeros((1, 5), dtype=np.int64))


def test_compute_modules_use_only_xp():
    # the layers run unchanged on CuPy: no NumPy import in a compute path (host-side init lives in the models)
    import ast
    nn = ROOT / "src" / "hpcpipe" / "nn"
    for name in ("core/norms", "core/attention", "core/activations", "core/decoder", "core/mlps",
                 "core/decode_steps", "token_loss"):
        for node in ast.walk(ast.parse((nn / f"{name}.py").read_text())):
            if isinstance(node, ast.Import):
                assert all(a.name.split(".")[0] != "numpy" for a in node.names), name
            if isinstance(node, ast.ImportFrom):
                assert (node.module or "").split(".")[0] != "numpy", name


# --- the model definition the engine uses: groups, costs, stage cut

def _config(**model):
    from hpcpipe.config import from_dict
    return from_dict({"model": {"kind": "gpt", **model}, "parallel": {"pp": 1}})


def test_gpt_specs_follow_the_hdf5_contract():
    from hpcpipe.nn.registry import model_def
    m = model_def(_config(vocab_size=50, seq_len=8, d_model=16, n_heads=2, n_blocks=3, tie_embeddings=False))
    assert m.n_layers == 5 and [s.index for s in m.specs] == list(range(5))
    assert m.specs[0].shapes == {"tok_emb": (50, 16), "pos_emb": (8, 16)}
    assert m.specs[2].shapes["attn/qkv/weight"] == (16, 48) and m.specs[2].shapes["mlp/proj/weight"] == (64, 16)
    assert m.specs[4].shapes == {"ln_f/weight": (16,), "ln_f/bias": (16,), "head/weight": (16, 50)}
    assert m.boundary(0, 3) == ((3, 8), "int64") and m.boundary(2, 3) == ((3, 8, 16), None)
    assert m.boundary(5, 3) == ((3, 8, 50), None) and m.samples_norm(6) == 48


def test_partition_counts_the_head_of_a_large_vocabulary():
    """vocab 8192, d 64: the head costs as much as ~13 blocks, so it gets a stage of its own."""
    from hpcpipe.nn.partition import partition
    from hpcpipe.nn.registry import model_def
    specs = model_def(_config(vocab_size=8192, seq_len=64, d_model=64, n_heads=4, n_blocks=6)).specs
    ranges = partition(specs, 4)
    assert list(ranges[-1]) == [7]                     # the final norm + head alone
    assert sum(len(r) for r in ranges) == 8 and min(len(r) for r in ranges) >= 1
    by_params = [s.n_params for s in specs]            # parameter counts would put the embedding alone instead
    assert by_params[0] > 10 * by_params[1]


def test_stash_formula_matches_what_the_engine_counts():
    """The engine's peak stash of one GPipe step at pp = 1 equals the per-group formula (within 0.1 %)."""
    from mpi4py import MPI

    from hpcpipe.config import from_dict
    from hpcpipe.train.setup import prepare
    from hpcpipe.train.trainer import Trainer
    for recompute in ("none", "stage"):
        cfg = from_dict({"parallel": {"pp": 1, "dp": 1}, "checkpoint": {"dir": ""}, "log": {"progress": False},
                         "model": {"kind": "gpt", "vocab_size": 50, "seq_len": 16, "d_model": 32, "n_heads": 4,
                                   "n_blocks": 3},
                         "train": {"micro_batches": 3, "micro_batch_size": 5, "recompute": recompute}})
        trainer = Trainer(prepare(cfg, 1), MPI.COMM_SELF)
        try:
            trainer.compute_gradients(0)
            measured = trainer.engine.stats.peak_stash_bytes
        finally:
            trainer.close()
        if recompute == "none":
            formula = sum(s.act_elements for s in trainer.specs) * 3 * 5 * 4
            assert abs(measured - formula) <= 1e-3 * formula, (measured, formula)
        else:
            assert measured == 3 * 5 * 16 * 8        # the token ids (int64) of the 3 micro-batches


@pytest.mark.parametrize("name", ["embedding", "block", "head_tied", "head_untied", "dense_identity", "dense_gelu"])
def test_forward_cache_equals_the_cache_of_forward(name):
    """Recomputation builds a layer's cache without its output: the same arrays as forward's cache, bit for bit."""
    from hpcpipe.nn.core.activations import GELU, Activation
    from hpcpipe.nn.core.dense import Dense

    rng = np.random.default_rng(3)
    shape = GPTShape(vocab=13, seq_len=6, d_model=8, n_heads=2, n_blocks=1, tied=name != "head_untied")
    groups = [_random_group(shape, i, rng) for i in range(shape.n_groups)]
    h = rng.standard_normal((2, 6, 8))
    if name == "embedding":
        layer, x = GPTModel(shape).build_layer(0, *groups[0], np), rng.integers(0, 13, (2, 6))
    elif name == "block":
        layer, x = GPTModel(shape).build_layer(1, *groups[1], np), h
    elif name.startswith("head"):
        layer, x = _head(shape, *groups[2], np, groups[0][0]["tok_emb"], groups[0][1]["tok_emb"]), h
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
