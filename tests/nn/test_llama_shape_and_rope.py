"""Llama RoPE (rotation, scaling checks and normalisation) and shape: parameter groups (the HDF5 contract),
refused values, initial values, layer kinds, the xp-only compute modules."""

import math

import numpy as np
import pytest
from llama_layer_parts import LLAMA3, SPLIT_SHAPE, build_layer, model_rope

from hpcpipe.nn.core.decoder import Block, Embedding, OutputHead
from hpcpipe.nn.core.decoder_model import Decoder
from hpcpipe.nn.core.rope import check_scaling, rotate
from hpcpipe.nn.llama.model import LlamaModel
from hpcpipe.nn.llama.shape import LlamaShape, default_ff, group_params

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
