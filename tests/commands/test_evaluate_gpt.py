"""`python -m hpcpipe.evaluate` on GPT weights: held-out loss per token (nats, bits); one clear error per bad input."""

from __future__ import annotations

import json
import math

import h5py
import numpy as np
import pytest
from support.launch import one_error, run_module

from hpcpipe import evaluate as evaluate_module
from hpcpipe.evaluate import evaluate
from hpcpipe.nn.core.decoder_model import Decoder
from hpcpipe.nn.gpt.model import GPTModel
from hpcpipe.nn.gpt.shape import GPTShape
from hpcpipe.state.weights import write_weights

SHAPE = GPTShape(vocab=11, seq_len=5, d_model=8, n_heads=2, n_blocks=2, d_ff=0, tied=True)


def _model(shape: GPTShape, dtype: str) -> dict:
    return {"kind": "gpt", "vocab_size": shape.vocab, "seq_len": shape.seq_len, "d_model": shape.d_model,
            "n_heads": shape.n_heads, "n_blocks": shape.n_blocks, "d_ff": shape.d_ff,
            "tie_embeddings": shape.tied, "dtype": dtype}


def _weights(path, shape=SHAPE, dtype="float64", seed=3, step=0):
    """Write a GPT's groups (weights drawn larger than at init, so the loss is far from uniform); return them."""
    model = Decoder(GPTModel(shape), np, dtype, seed=seed)
    rng = np.random.default_rng(seed)
    model.flat[...] += 0.3 * rng.standard_normal(model.flat.shape).astype(dtype)
    groups = {i: {name: np.array(view) for name, view in model.params[i].items()} for i in range(shape.n_groups)}
    write_weights(path, groups, n_layers=shape.n_groups, model_config=_model(shape, dtype), step=step)
    return groups


def _tokens(path, n=7, shape=SHAPE, x=None, y=None, seed=0):
    rng = np.random.default_rng(seed)
    with h5py.File(path, "w") as f:
        f["x"] = rng.integers(0, shape.vocab, (n, shape.seq_len)) if x is None else x
        f["y"] = rng.integers(0, shape.vocab, (n, shape.seq_len)) if y is None else y
    return path


def _layer_norm(x, w, b):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + 1e-5) * w + b


def _gelu(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def reference_loss(groups, shape: GPTShape, x, y) -> float:
    """The issue's equations written out in float64 NumPy: mean cross-entropy per target token."""
    g = {i: {k: v.astype(np.float64) for k, v in group.items()} for i, group in groups.items()}
    n, t = x.shape
    h = g[0]["tok_emb"][x] + g[0]["pos_emb"][:t]
    hd = shape.d_head
    mask = np.triu(np.ones((t, t), bool), 1)
    for i in range(1, shape.n_blocks + 1):
        p = g[i]
        qkv = _layer_norm(h, p["ln1/weight"], p["ln1/bias"]) @ p["attn/qkv/weight"] + p["attn/qkv/bias"]
        q, k, v = np.split(qkv, 3, axis=-1)
        heads = []
        for j in range(shape.n_heads):
            sl = slice(j * hd, (j + 1) * hd)
            scores = q[..., sl] @ k[..., sl].transpose(0, 2, 1) / math.sqrt(hd)
            scores = np.where(mask, -np.inf, scores)
            weights = np.exp(scores - scores.max(-1, keepdims=True))
            weights /= weights.sum(-1, keepdims=True)
            heads.append(weights @ v[..., sl])
        a = h + np.concatenate(heads, -1) @ p["attn/proj/weight"] + p["attn/proj/bias"]
        u = _layer_norm(a, p["ln2/weight"], p["ln2/bias"])
        h = a + _gelu(u @ p["mlp/fc/weight"] + p["mlp/fc/bias"]) @ p["mlp/proj/weight"] + p["mlp/proj/bias"]
    last = g[shape.n_blocks + 1]
    head = g[0]["tok_emb"].T if shape.tied else last["head/weight"]
    logits = _layer_norm(h, last["ln_f/weight"], last["ln_f/bias"]) @ head
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    return float(-np.take_along_axis(logp, y[..., None], -1).mean())


@pytest.mark.parametrize("dtype, tol", [("float64", 1e-10), ("float32", 2e-5)])
def test_gpt_loss_per_token_in_nats_and_bits_equals_a_direct_numpy_computation(tmp_path, dtype, tol):
    groups = _weights(tmp_path / "w.h5", dtype=dtype, step=12)
    data = _tokens(tmp_path / "t.h5")
    proc = run_module("hpcpipe.evaluate", "--weights", tmp_path / "w.h5", "--data", data)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "" and len(proc.stdout.splitlines()) == 1
    report = json.loads(proc.stdout)
    assert sorted(report) == ["loss_bits", "loss_nats", "n", "step", "tokens", "weights"]
    with h5py.File(data) as f:
        x, y = f["x"][...], f["y"][...]
    expected = reference_loss(groups, SHAPE, x, y)
    assert abs(expected - math.log(SHAPE.vocab)) > 0.05        # not the loss of a uniform guess
    assert report["n"] == 7 and report["tokens"] == 35 and report["step"] == 12
    assert report["weights"] == str(tmp_path / "w.h5")
    assert report["loss_nats"] == pytest.approx(expected, rel=tol)
    assert report["loss_bits"] == report["loss_nats"] / math.log(2)


def test_untied_head_and_slabs_of_one_window_give_the_same_loss(tmp_path, monkeypatch):
    shape = GPTShape(vocab=9, seq_len=4, d_model=6, n_heads=3, n_blocks=1, d_ff=10, tied=False)
    groups = _weights(tmp_path / "w.h5", shape=shape)
    data = _tokens(tmp_path / "t.h5", n=5, shape=shape, seed=2)
    whole = evaluate(tmp_path / "w.h5", data)
    monkeypatch.setattr(evaluate_module, "SLAB_ELEMENTS", 1)       # one window per slab
    assert evaluate_module.slab_rows(shape) == 1
    sliced = evaluate(tmp_path / "w.h5", data)
    with h5py.File(data) as f:
        expected = reference_loss(groups, shape, f["x"][...], f["y"][...])
    assert whole["loss_nats"] == pytest.approx(expected, rel=1e-10)
    assert sliced["loss_nats"] == pytest.approx(whole["loss_nats"], rel=1e-12)


def test_slab_rows_bound_the_largest_activation():
    shape = GPTShape(vocab=256, seq_len=64, d_model=64, n_heads=4, n_blocks=4)
    rows = evaluate_module.slab_rows(shape)
    assert rows * shape.seq_len * 256 <= evaluate_module.SLAB_ELEMENTS < (rows + 1) * shape.seq_len * 256


def test_out_of_vocab_token_file_is_refused_naming_the_row(tmp_path):
    _weights(tmp_path / "w.h5")
    rng = np.random.default_rng(0)
    y = rng.integers(0, SHAPE.vocab, (7, 5))
    y[3, 2] = SHAPE.vocab
    data = _tokens(tmp_path / "t.h5", y=y)
    proc = run_module("hpcpipe.evaluate", "--weights", tmp_path / "w.h5", "--data", data)
    line = one_error(proc, alone=True, quiet=True)
    assert line.endswith(f"token file {str(data)!r}: dataset 'y' row 3 column 2 holds token id 11, outside the "
                         f"vocabulary [0, 11) (the first bad id in the file)")


@pytest.mark.parametrize("case, message", [
    ("wide", "dataset 'x' in token file '{data}' has shape (7, 6); expected (N, 5)"),
    ("float", "dataset 'x' in token file '{data}' has dtype float32; token ids must be integers"),
    ("negative", "dataset 'x' row 0 column 0 holds token id -1, outside the vocabulary [0, 11)"),
    ("missing group", "weights file '{weights}' has layers [0, 1, 3] but the model has 4 layer groups [0, 1, 2, 3]"),
    ("bad shape", "weights file '{weights}': layers/0001/attn/qkv/weight has shape (8, 8), the model needs (8, 24)"),
    ("no n_heads", "weights file '{weights}' holds a GPT model without n_heads in its model attribute"),
    ("no model attribute", "records no model kind (root attribute 'model') and its layer 0 holds ['pos_emb', "),
    ("model not JSON", "weights file '{weights}': root attribute model is not JSON text"),
    ("model a list", "weights file '{weights}': root attribute model must be a JSON object, got list"),
])
def test_bad_gpt_input_is_one_line_exit_2(tmp_path, case, message):
    weights, data = tmp_path / "w.h5", tmp_path / "t.h5"
    groups = _weights(weights)
    x = None
    if case == "wide":
        x = np.zeros((7, 6), np.int64)
    elif case == "float":
        x = np.zeros((7, 5), np.float32)
    elif case == "negative":
        x = np.full((7, 5), -1)
    elif case == "missing group":
        write_weights(weights, {i: g for i, g in groups.items() if i != 2}, n_layers=4,
                      model_config=_model(SHAPE, "float64"))
    elif case == "bad shape":
        groups[1]["attn/qkv/weight"] = np.zeros((8, 8))
        write_weights(weights, groups, n_layers=4, model_config=_model(SHAPE, "float64"))
    elif case == "no n_heads":
        model = _model(SHAPE, "float64")
        del model["n_heads"]
        write_weights(weights, groups, n_layers=4, model_config=model)
    elif case.startswith("no model") or case.startswith("model "):
        with h5py.File(weights, "a") as f:
            if case == "no model attribute":
                del f.attrs["model"]
            else:
                f.attrs["model"] = "{not json" if case == "model not JSON" else "[1]"
    _tokens(data, x=x)
    line = one_error(run_module("hpcpipe.evaluate", "--weights", weights, "--data", data), alone=True, quiet=True)
    assert message.format(data=data, weights=weights) in line


def test_mlp_data_given_to_gpt_weights_is_refused(tmp_path):
    _weights(tmp_path / "w.h5")
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f["x"] = np.zeros((4, 5), np.float32)
        f["y"] = np.zeros(4, np.int64)
    proc = run_module("hpcpipe.evaluate", "--weights", tmp_path / "w.h5", "--data", tmp_path / "d.h5")
    line = one_error(proc, alone=True, quiet=True)
    assert "token ids must be integers" in line
