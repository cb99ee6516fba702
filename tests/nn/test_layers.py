"""Hand-written backward of every layer and loss against central finite differences (float64)."""

import numpy as np
import pytest

from hpcpipe.nn import loss as losses
from hpcpipe.nn.core.activations import make_activation
from hpcpipe.nn.core.dense import Dense

EPS = 1e-6


def _dense(activation, bias, rng, fan_in=5, fan_out=4):
    w = rng.standard_normal((fan_in, fan_out))
    b = rng.standard_normal(fan_out) if bias else None
    layer = Dense(0, w, b, np.zeros_like(w), np.zeros_like(b) if bias else None, make_activation(activation), np)
    return layer


def _objective(layer, x, probe):
    y, _ = layer.forward(x.copy())
    return float((y * probe).sum())


@pytest.mark.parametrize("activation", ["relu", "gelu", "tanh", "identity"])
@pytest.mark.parametrize("bias", [True, False])
def test_dense_backward_matches_finite_differences(activation, bias):
    rng = np.random.default_rng(1)
    layer = _dense(activation, bias, rng)
    x = rng.standard_normal((3, 5))
    x[np.abs(x) < 1e-2] = 0.5   # keep relu away from its kink
    probe = rng.standard_normal((3, 4))
    y, cache = layer.forward(x.copy())
    gx = layer.backward(cache, probe.copy())

    def numeric(array):
        grad = np.zeros_like(array)
        for idx in np.ndindex(array.shape):
            keep = array[idx]
            array[idx] = keep + EPS
            up = _objective(layer, x, probe)
            array[idx] = keep - EPS
            down = _objective(layer, x, probe)
            array[idx] = keep
            grad[idx] = (up - down) / (2 * EPS)
        return grad

    np.testing.assert_allclose(gx, numeric(x), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(layer.grad_weight, numeric(layer.weight), rtol=1e-5, atol=1e-7)
    if bias:
        np.testing.assert_allclose(layer.grad_bias, numeric(layer.bias), rtol=1e-5, atol=1e-7)


def test_split_backward_equals_full_backward():
    rng = np.random.default_rng(2)
    full, split = _dense("gelu", True, rng), _dense("gelu", True, np.random.default_rng(2))
    x, g = rng.standard_normal((6, 5)), rng.standard_normal((6, 4))
    _, c1 = full.forward(x.copy())
    gx_full = full.backward(c1, g.copy())
    _, c2 = split.forward(x.copy())
    gx_split, dz = split.backward_input(c2, g.copy())
    split.backward_weight(c2, dz)
    np.testing.assert_array_equal(gx_full, gx_split)
    np.testing.assert_array_equal(full.grad_weight, split.grad_weight)
    np.testing.assert_array_equal(full.grad_bias, split.grad_bias)


def test_backward_accumulates_over_micro_batches():
    rng = np.random.default_rng(3)
    layer = _dense("relu", True, rng)
    xs, gs = rng.standard_normal((2, 3, 5)), rng.standard_normal((2, 3, 4))
    for x, g in zip(xs, gs, strict=True):
        _, cache = layer.forward(x)
        layer.backward(cache, g.copy())
    one = _dense("relu", True, np.random.default_rng(3))
    _, cache = one.forward(xs.reshape(6, 5))
    one.backward(cache, gs.reshape(6, 4).copy())
    np.testing.assert_allclose(layer.grad_weight, one.grad_weight, rtol=1e-12)


@pytest.mark.parametrize("name", ["mse", "cross_entropy"])
def test_loss_gradient_matches_finite_differences(name):
    rng = np.random.default_rng(4)
    pred = rng.standard_normal((5, 3))
    target = rng.integers(0, 3, 5) if name == "cross_entropy" else rng.standard_normal((5, 3))
    scale = 0.25
    _, grad = losses.LOSSES[name](np, pred.copy(), target, scale)
    numeric = np.zeros_like(pred)
    for idx in np.ndindex(pred.shape):
        up, down = pred.copy(), pred.copy()
        up[idx] += EPS
        down[idx] -= EPS
        loss = losses.LOSSES[name]
        numeric[idx] = (loss(np, up, target, scale)[0] - loss(np, down, target, scale)[0]) / (2 * EPS)
    np.testing.assert_allclose(grad, scale * numeric, rtol=1e-5, atol=1e-8)


def test_cross_entropy_value_is_stable_for_large_logits():
    logits = np.array([[1000.0, 0.0], [0.0, 1000.0]])
    total, _ = losses.cross_entropy(np, logits, np.array([0, 0]), 1.0)
    assert total == pytest.approx(1000.0)


def test_scipy_accumulate_only_with_one_blas_thread(monkeypatch):
    """NumPy's and SciPy's OpenBLAS pools spin against each other with more than one thread each."""
    from hpcpipe.nn.core.dense import _inplace_gemm
    grad = np.zeros((4, 3), np.float32)
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    assert _inplace_gemm(np, grad) is not None
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")
    assert _inplace_gemm(np, grad) is None
    # both paths accumulate the same weight gradient
    from hpcpipe.nn.core.activations import Activation
    from hpcpipe.nn.core.dense import Dense
    rng = np.random.default_rng(0)
    x, dz = rng.standard_normal((5, 4)), rng.standard_normal((5, 3))
    grads = []
    for threads in ("1", "2"):
        monkeypatch.setenv("OPENBLAS_NUM_THREADS", threads)
        w, gw = np.ones((4, 3)), np.full((4, 3), 0.5)
        layer = Dense(0, w, None, gw, None, Activation(), np)
        y, cache = layer.forward(x)
        layer.backward(cache, dz, True)
        grads.append(gw.copy())
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-12)
    np.testing.assert_allclose(grads[0], 0.5 + x.T @ dz, rtol=1e-12)
