"""A decoder's split backward (every layer's backward_input first, the weight halves later, as a zero-bubble
stage runs them) against its one-piece backward: the same gradient, bit for bit."""

import numpy as np

from hpcpipe.nn.token_loss import token_cross_entropy


def assert_split_backward_equals_backward(model, tokens, targets):
    """Run model's backward whole and split; the gradients must be identical and the input halves write none."""
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
