"""Optimizer updates against their closed forms (PyTorch semantics)."""

import numpy as np
import pytest

from hpcpipe.config import TrainConfig
from hpcpipe.nn.optim import clip_factor, make_optimizer


def _run(cfg, grads, p0):
    params = np.array(p0, dtype=np.float64)
    opt = make_optimizer(cfg, np, params.size, params.dtype)
    for g in grads:
        opt.step(params, np.array(g, dtype=np.float64))
    return params, opt


def test_sgd_momentum_and_weight_decay():
    cfg = TrainConfig(optimizer="sgd", lr=0.1, momentum=0.5, weight_decay=0.0)
    p, _ = _run(cfg, [[1.0, -2.0], [1.0, -2.0]], [0.0, 0.0])
    # buf1 = g, buf2 = 0.5 g + g
    np.testing.assert_allclose(p, -0.1 * np.array([1.0, -2.0]) * (1 + 1.5))
    cfg = TrainConfig(optimizer="sgd", lr=0.1, weight_decay=0.5)
    p, _ = _run(cfg, [[0.0]], [2.0])
    np.testing.assert_allclose(p, [2.0 - 0.1 * 0.5 * 2.0])


def test_adam_first_step_moves_by_lr_times_sign():
    cfg = TrainConfig(optimizer="adam", lr=0.01, eps=1e-12)
    p, opt = _run(cfg, [[3.0, -0.002, 0.0]], [1.0, 1.0, 1.0])
    np.testing.assert_allclose(p, [0.99, 1.01, 1.0], rtol=1e-9)
    assert opt.steps == 1 and set(opt.state) == {"exp_avg", "exp_avg_sq"}


def test_adam_l2_versus_adamw_decoupled_decay():
    adam = TrainConfig(optimizer="adam", lr=0.01, weight_decay=0.1, eps=1e-12)
    adamw = TrainConfig(optimizer="adamw", lr=0.01, weight_decay=0.1, eps=1e-12)
    p_adam, _ = _run(adam, [[0.0]], [2.0])
    p_adamw, _ = _run(adamw, [[0.0]], [2.0])
    np.testing.assert_allclose(p_adam, [1.99])                 # decay enters the gradient, then sign step
    np.testing.assert_allclose(p_adamw, [2.0 * (1 - 0.001)])   # zero gradient: only the decoupled decay


def test_adam_bias_correction_over_two_steps():
    cfg = TrainConfig(optimizer="adam", lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8)
    p, _ = _run(cfg, [[1.0], [3.0]], [0.0])
    m1, v1 = 0.1 * 1.0, 0.001 * 1.0
    step1 = 0.1 * (m1 / 0.1) / (np.sqrt(v1 / 0.001) + 1e-8)
    m2, v2 = 0.9 * m1 + 0.1 * 3.0, 0.999 * v1 + 0.001 * 9.0
    step2 = 0.1 * (m2 / (1 - 0.81)) / (np.sqrt(v2 / (1 - 0.999 ** 2)) + 1e-8)
    np.testing.assert_allclose(p, [-step1 - step2], rtol=1e-6)


@pytest.mark.parametrize("norm,max_norm,factor", [(10.0, 0.0, 1.0), (0.5, 1.0, 1.0), (4.0, 1.0, 1 / (4.0 + 1e-6))])
def test_clip_factor(norm, max_norm, factor):
    assert clip_factor(norm, max_norm) == pytest.approx(factor)
