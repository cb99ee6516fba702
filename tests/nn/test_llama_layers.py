"""Llama layers: the whole model against a PyTorch float64 autograd reference written from the contract's equations,
logits against Hugging Face transformers (Llama, Mistral, Qwen2), the split backward, recomputation, the groups."""

import dataclasses
import math

import numpy as np
import pytest

from hpcpipe.nn.core.attention import CausalAttention, SplitQKV
from hpcpipe.nn.core.decoder import Block, Embedding, OutputHead
from hpcpipe.nn.core.decoder_model import Decoder
from hpcpipe.nn.core.dense import linear
from hpcpipe.nn.core.mlps import SwiGLU
from hpcpipe.nn.core.norms import RMSNorm
from hpcpipe.nn.core.rope import check_scaling, inverse_frequencies, rotate
from hpcpipe.nn.llama.model import LlamaModel
from hpcpipe.nn.llama.shape import LlamaShape, default_ff, group_params
from hpcpipe.nn.token_loss import token_cross_entropy

torch = pytest.importorskip("torch")
from support.llama_reference import torch_llama  # noqa: E402


def model_rope(shape, xp, dtype):
    """The model's RoPE tables in ``dtype``."""
    return LlamaModel(shape).rope(xp, dtype)


def _attention(params, grads, n_heads, n_kv_heads, rope, xp):
    """Grouped-query attention over the group's attn/{q,k,v,o} (biases when the group has them)."""
    qkv = SplitQKV(params, grads, xp, "attn", None, bias="attn/q/bias" in params)
    return CausalAttention(qkv, linear(params, grads, "attn/o", xp, bias=False), n_heads, n_kv_heads,
                           rope.head_dim, rope, xp)


def build_layer(shape, index, params, grads, xp, tok_emb=None, grad_tok_emb=None):
    """The llama layer of group ``index``."""
    return LlamaModel(shape).build_layer(index, params, grads, xp, tok_emb, grad_tok_emb)


LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def _random_groups(shape, rng, dtype="float64"):
    """Parameters far from the init (norm weights != 1, biases != 0) so every term counts."""
    groups = []
    for index in range(shape.n_groups):
        group = {}
        for name, dims in group_params(shape, index):
            value = rng.standard_normal(dims) * 0.3
            group[name] = (value + 1.0 if "norm/" in name else value).astype(dtype)
        groups.append(group)
    return groups


def _model(shape, groups, dtype="float64"):
    model = Decoder(LlamaModel(shape), np, dtype)
    for i, group in enumerate(groups):
        model.load_group(i, group)
    return model


# --- the independent reference (PyTorch autograd, straight from the contract): tests/support/llama_reference.py

CASES = {
    "gqa_tied_bias": LlamaShape(vocab=17, seq_len=8, d_model=16, n_heads=4, n_blocks=2, d_ff=24, tied=True,
                                n_kv_heads=2, qkv_bias=True),
    "mqa_untied_theta500k": LlamaShape(vocab=13, seq_len=7, d_model=16, n_heads=4, n_blocks=2, d_ff=20,
                                       n_kv_heads=1, rope_theta=500000.0),
    "mha_llama3": LlamaShape(vocab=11, seq_len=9, d_model=16, n_heads=2, n_blocks=1, d_ff=12, tied=True,
                             rope_scaling=LLAMA3, norm_eps=1e-6),
    "gqa_head_dim_linear": LlamaShape(vocab=19, seq_len=6, d_model=12, n_heads=4, n_blocks=2, d_ff=16,
                                      n_kv_heads=2, head_dim=6, qkv_bias=True,
                                      rope_scaling={"type": "linear", "factor": 2.5}),
    "mqa_llama3_500k_untied": LlamaShape(vocab=9, seq_len=8, d_model=8, n_heads=2, n_blocks=2, d_ff=10,
                                         n_kv_heads=1, rope_theta=500000.0, qkv_bias=True,
                                         rope_scaling=dict(LLAMA3, original_max_position_embeddings=8192)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_llama_matches_torch_float64(case):
    shape = CASES[case]
    rng = np.random.default_rng(sorted(CASES).index(case))
    groups = _random_groups(shape, rng)
    tokens = rng.integers(0, shape.vocab, (2, shape.seq_len))
    targets = rng.integers(0, shape.vocab, (2, shape.seq_len))
    model = _model(shape, groups)
    loss = model.loss_and_grad(tokens, targets)
    ref_loss, ref_grads, ref_logits = torch_llama(shape, groups, tokens, targets)
    np.testing.assert_allclose(model.forward(tokens)[0], ref_logits, rtol=0, atol=1e-10 * np.abs(ref_logits).max())
    assert abs(loss - ref_loss) <= 1e-12 * abs(ref_loss)
    largest = max(np.abs(v).max() for g in ref_grads for v in g.values())
    for i, ref in enumerate(ref_grads):
        assert set(ref) == set(model.grads[i])
        for name, want in ref.items():
            worst = np.abs(model.grads[i][name] - want).max()
            assert worst <= 1e-7 * largest, (case, i, name, worst, largest)


def test_rope_scaling_changes_the_model():
    """The scaled cases differ from unscaled RoPE (so the reference comparison covers the scaling)."""
    for scaling in (LLAMA3, {"rope_type": "linear", "factor": 2.0}):
        assert not np.allclose(inverse_frequencies(8, 10000.0, scaling), inverse_frequencies(8, 10000.0, None))
    inv = np.array(inverse_frequencies(8, 10000.0, LLAMA3))      # wavelengths 6.3 (kept), 63 (smoothed), 628 (/4)
    base = np.array(inverse_frequencies(8, 10000.0))
    assert inv[0] == base[0] and inv[2] == base[2] / 4 and base[1] / 4 < inv[1] < base[1]


def test_float32_stays_float32():
    shape = CASES["gqa_tied_bias"]
    rng = np.random.default_rng(3)
    groups = _random_groups(shape, rng)
    model = _model(shape, groups, "float32")
    tokens = rng.integers(0, shape.vocab, (2, 8))
    logits, caches = model.forward(tokens)
    assert logits.dtype == np.float32
    pending = list(caches)
    while pending:
        item = pending.pop()
        if isinstance(item, tuple | list):
            pending.extend(item)
        elif item is not None and item.dtype.kind == "f":
            assert item.dtype == np.float32
    loss = model.loss_and_grad(tokens, tokens)
    ref_loss, ref_grads, _ = torch_llama(shape, groups, tokens, tokens)
    assert model.grad.dtype == np.float32
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    largest = max(np.abs(v).max() for g in ref_grads for v in g.values())
    worst = max(np.abs(model.grads[i][k] - v).max() for i, g in enumerate(ref_grads) for k, v in g.items())
    assert worst <= 1e-4 * largest


# --- the split: backward_input + backward_weight == backward; forward_cache == forward's cache

SPLIT_SHAPE = LlamaShape(vocab=11, seq_len=6, d_model=12, n_heads=4, n_blocks=1, d_ff=10, n_kv_heads=2,
                         head_dim=4, qkv_bias=True, rope_scaling=LLAMA3, tied=True)


def _layers(rng, tied=True):
    shape = dataclasses.replace(SPLIT_SHAPE, tied=tied)
    groups = _random_groups(shape, rng)
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
    model = _model(shape, _random_groups(shape, rng))
    tokens, targets = rng.integers(0, shape.vocab, (2, 5)), rng.integers(0, shape.vocab, (2, 5))
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


# --- RoPE

def test_rotate_in_place_out_of_place_and_transpose():
    rng = np.random.default_rng(5)
    rope = model_rope(SPLIT_SHAPE, np, np.float64)
    cos, sin = rope.tables(6)
    x = rng.standard_normal((2, 6, 3, 4))
    out = rotate(np, x, cos[:, None], sin[:, None])
    inplace = x.copy()
    assert rotate(np, inplace, cos[:, None], sin[:, None], out=inplace) is inplace
    np.testing.assert_allclose(inplace, out, rtol=0, atol=1e-15)
    back = rotate(np, out, cos[:, None], sin[:, None], inverse=True)          # orthogonal: R^T R = I
    np.testing.assert_allclose(back, x, rtol=0, atol=1e-14)
    positions = np.array([5, 0, 3])
    c, s = rope.at(positions)
    np.testing.assert_array_equal(c, cos[positions])
    np.testing.assert_array_equal(s, sin[positions])
    assert model_rope(SPLIT_SHAPE, np, np.float32).tables(6)[0].dtype == np.float32
    with pytest.raises(ValueError, match="7 positions exceed the 6"):
        rope.tables(7)


@pytest.mark.parametrize("bad, message", [
    ({"rope_type": "yarn", "factor": 2.0}, r"'yarn' is not supported \(supported: default, linear, llama3\)"),
    ({"type": "dynamic", "factor": 2.0}, "'dynamic' is not supported"),
    ({"rope_type": "linear"}, "'linear' needs a positive number factor, got None"),
    ({"rope_type": "linear", "factor": -1.0}, "factor, got -1.0"),
    ({k: v for k, v in LLAMA3.items() if k != "low_freq_factor"}, "low_freq_factor, got None"),
    (dict(LLAMA3, high_freq_factor=1.0), "high_freq_factor 1.0 must exceed low_freq_factor 1.0"),
    (dict(LLAMA3, partial_rotary_factor=0.5), "partial_rotary_factor 0.5"),
    ([("rope_type", "linear")], "must be a dict or None"),
])
def test_bad_rope_scaling_is_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        check_scaling(bad)
    with pytest.raises(ValueError, match=message):
        LlamaShape(vocab=5, seq_len=4, d_model=8, n_heads=2, n_blocks=1, rope_scaling=bad)


def test_rope_scaling_is_normalised():
    assert check_scaling(None) is None and check_scaling({"rope_type": "default", "rope_theta": 1e4}) is None
    assert check_scaling({"type": "linear", "factor": 2}) == {"rope_type": "linear", "factor": 2}
    scaling = dict(LLAMA3)
    shape = LlamaShape(vocab=5, seq_len=4, d_model=8, n_heads=2, n_blocks=1, rope_scaling=scaling)
    scaling["factor"] = 1.0                                        # the shape keeps its own copy
    assert shape.rope_scaling["factor"] == 4.0
    assert hash(shape) == hash(LlamaShape(vocab=5, seq_len=4, d_model=8, n_heads=2, n_blocks=1, rope_scaling=LLAMA3))


# --- shape, parameter groups and initial values

def test_param_groups_follow_the_hdf5_contract():
    shape = LlamaShape(vocab=50, seq_len=16, d_model=16, n_heads=4, n_blocks=3, d_ff=40, n_kv_heads=2,
                       head_dim=6, qkv_bias=True)
    assert (shape.head_dim, shape.q_width, shape.kv_width, shape.ff, shape.n_groups) == (6, 24, 12, 40, 5)
    groups = [group_params(shape, i) for i in range(shape.n_groups)]
    assert groups[0] == [("tok_emb", (50, 16))]
    expect = {"attn_norm/weight": (16,), "attn/q/weight": (16, 24), "attn/k/weight": (16, 12),
              "attn/v/weight": (16, 12), "attn/o/weight": (24, 16), "attn/q/bias": (24,), "attn/k/bias": (12,),
              "attn/v/bias": (12,), "mlp_norm/weight": (16,), "mlp/gate/weight": (16, 40),
              "mlp/up/weight": (16, 40), "mlp/down/weight": (40, 16)}
    assert all(dict(groups[i]) == expect for i in (1, 2, 3))
    assert dict(groups[4]) == {"norm/weight": (16,), "head/weight": (16, 50)}
    plain = LlamaShape(vocab=50, seq_len=16, d_model=16, n_heads=4, n_blocks=3, tied=True)
    assert (plain.n_kv_heads, plain.head_dim, plain.ff) == (4, 4, 256)
    assert not any(name.endswith("bias") for name, _ in group_params(plain, 1))
    assert group_params(plain, 4) == [("norm/weight", (16,))]
    assert default_ff(4096) == 11008 and default_ff(2048) == 5632
    with pytest.raises(ValueError, match="layer group 5 out of range 0..4"):
        group_params(plain, 5)


@pytest.mark.parametrize("bad, message", [
    (dict(n_heads=4, n_kv_heads=3), "n_heads 4 is not a multiple of n_kv_heads 3"),
    (dict(d_model=10, n_heads=4), "d_model 10 is not a multiple of n_heads 4"),
    (dict(head_dim=5), "head_dim 5 must be even"),
    (dict(n_blocks=0), "n_blocks must be a positive integer, got 0"),
    (dict(vocab=-1), "vocab must be a positive integer, got -1"),
    (dict(d_ff=-2), "d_ff must be a positive integer"),
    (dict(seq_len=2.0), "seq_len must be a positive integer, got 2.0"),
    (dict(rope_theta=0), "rope_theta must be a positive number, got 0"),
    (dict(norm_eps=-1e-6), "norm_eps must be a positive number"),
    (dict(tied="yes"), "tied must be true or false"),
    (dict(rope_scaling={"rope_type": "default", "rope_theta": 5.0}), "says rope_theta 5.0 but rope_theta is 10000"),
])
def test_shape_rejects_bad_values(bad, message):
    fields = dict(vocab=5, seq_len=4, d_model=8, n_heads=2, n_blocks=1) | bad
    with pytest.raises(ValueError, match=message):
        LlamaShape(**fields)


def test_init_depends_on_seed_and_group_only():
    shape = LlamaShape(vocab=300, seq_len=64, d_model=64, n_heads=4, n_blocks=8, d_ff=128, n_kv_heads=2,
                       qkv_bias=True)
    model = LlamaModel(shape)
    a, b = model.init_group(2, seed=5), model.init_group(2, seed=5)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["attn/q/weight"], model.init_group(3, seed=5)["attn/q/weight"])
    assert not np.array_equal(a["attn/q/weight"], model.init_group(2, seed=6)["attn/q/weight"])
    assert a["attn/q/weight"].dtype == np.float32 and model.init_group(2, 5, "float64")["attn/k/weight"].dtype == \
        np.float64
    assert {k: v.shape for k, v in a.items()} == dict(group_params(shape, 2))
    assert (a["attn_norm/weight"] == 1).all() and (a["mlp_norm/weight"] == 1).all() and not a["attn/q/bias"].any()
    for name in ("attn/q/weight", "attn/k/weight", "attn/v/weight", "mlp/gate/weight", "mlp/up/weight"):
        assert a[name].std() == pytest.approx(0.02, rel=0.1), name
    for name in ("attn/o/weight", "mlp/down/weight"):
        assert a[name].std() == pytest.approx(0.02 / math.sqrt(16), rel=0.1), name
    assert LlamaModel(shape).init_group(0, seed=5)["tok_emb"].std() == pytest.approx(0.02, rel=0.05)
    final = LlamaModel(shape).init_group(9, seed=5)
    assert (final["norm/weight"] == 1).all() and final["head/weight"].std() == pytest.approx(0.02, rel=0.05)
    model = Decoder(LlamaModel(shape), np, "float32", seed=5)
    assert np.array_equal(model.params[2]["mlp/down/weight"], a["mlp/down/weight"])


def test_build_layer_kinds_by_group():
    shape = LlamaShape(vocab=9, seq_len=4, d_model=8, n_heads=2, n_blocks=2, tied=True)
    model = Decoder(LlamaModel(shape), np, "float64")
    assert [type(layer) for layer in model.layers] == [Embedding, Block, Block, OutputHead]
    assert model.layers[-1].tied
    with pytest.raises(ValueError, match="tied output head needs tok_emb"):
        build_layer(shape, 3, model.params[3], model.grads[3], np)
    with pytest.raises(ValueError, match="longer than the 4 positions"):
        model.forward(np.zeros((1, 5), dtype=np.int64))


def test_compute_modules_use_only_xp():
    # the layers run unchanged on CuPy: no NumPy import in a compute path (host-side init lives in the models)
    import ast
    from pathlib import Path
    nn = Path(__file__).resolve().parents[2] / "src" / "hpcpipe" / "nn"
    for name in ("core/norms", "core/rope", "core/attention", "core/mlps", "core/decoder"):
        for node in ast.walk(ast.parse((nn / f"{name}.py").read_text())):
            if isinstance(node, ast.Import):
                assert all(a.name.split(".")[0] != "numpy" for a in node.names), name
            if isinstance(node, ast.ImportFrom):
                assert (node.module or "").split(".")[0] != "numpy", name


# --- Hugging Face transformers

def _hf_groups(model, shape):
    """Our layer groups from a *ForCausalLM's state_dict: nn.Linear weights (out, in) -> (in, out)."""
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    groups = [{"tok_emb": sd["model.embed_tokens.weight"]}]
    for i in range(shape.n_blocks):
        pre = f"model.layers.{i}."
        g = {"attn_norm/weight": sd[pre + "input_layernorm.weight"],
             "mlp_norm/weight": sd[pre + "post_attention_layernorm.weight"]}
        for ours, theirs in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "o_proj")):
            g[f"attn/{ours}/weight"] = sd[f"{pre}self_attn.{theirs}.weight"].T
            if shape.qkv_bias and ours != "o":
                g[f"attn/{ours}/bias"] = sd[f"{pre}self_attn.{theirs}.bias"]
        for ours in ("gate", "up", "down"):
            g[f"mlp/{ours}/weight"] = sd[f"{pre}mlp.{ours}_proj.weight"].T
        groups.append(g)
    final = {"norm/weight": sd["model.norm.weight"]}
    if not shape.tied:
        final["head/weight"] = sd["lm_head.weight"].T
    return groups + [final]


def _hf_case(family, tied, bias=False, rope=None, theta=10000.0, head_dim=None):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(17)
    common = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6,
                  tie_word_embeddings=tied, rope_parameters=dict(rope or {"rope_type": "default"}, rope_theta=theta))
    if head_dim:
        common["head_dim"] = head_dim
    if family == "llama":
        config, cls = transformers.LlamaConfig(attention_bias=bias, **common), transformers.LlamaForCausalLM
    elif family == "mistral":
        config, cls = transformers.MistralConfig(sliding_window=None, **common), transformers.MistralForCausalLM
    else:
        config, cls = transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():     # far from the init, so every term counts
            if name.endswith("o_proj.bias"):
                p.zero_()                          # Llama's attention_bias also biases o: not in the contract
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    shape = LlamaShape(vocab=97, seq_len=16, d_model=32, n_heads=4, n_blocks=2, d_ff=48, tied=tied, n_kv_heads=2,
                       head_dim=head_dim or 0, rope_theta=theta, rope_scaling=rope, norm_eps=1e-6,
                       qkv_bias=bias or family == "qwen2")
    ours = _model(shape, _hf_groups(model, shape), "float32")
    tokens = np.random.default_rng(5).integers(0, 97, (2, 11))
    with torch.no_grad():
        want = model(torch.as_tensor(tokens)).logits.numpy()
    got = ours.forward(tokens)[0]
    assert got.dtype == np.float32
    return np.abs(got - want).max() / np.abs(want).max(), model


HF_CASES = [("llama", True, False, None, 10000.0, None), ("llama", False, False, None, 500000.0, None),
            ("llama", True, True, None, 10000.0, None), ("llama", False, True, None, 10000.0, None),
            ("llama", True, False, dict(LLAMA3, factor=8.0, original_max_position_embeddings=32), 500000.0, None),
            ("llama", False, False, {"rope_type": "linear", "factor": 3.0}, 10000.0, 12),
            ("mistral", False, False, None, 10000.0, None), ("mistral", True, False, None, 1e6, 12),
            ("qwen2", True, True, None, 1e6, None), ("qwen2", False, True, None, 10000.0, None)]


@pytest.mark.parametrize("case", HF_CASES, ids=lambda c: "-".join(str(x) for x in c))
def test_logits_match_hugging_face(case):
    err, model = _hf_case(*case)
    assert err <= 1e-5, err
    if case[3] is not None:                        # the same inverse frequencies as transformers computes
        hf = model.model.rotary_emb.inv_freq.numpy()
        np.testing.assert_allclose(inverse_frequencies(case[5] or 8, case[4], case[3]), hf, rtol=1e-6, atol=0)
