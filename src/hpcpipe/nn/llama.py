"""A whole Llama-family model on one process: flat parameter and gradient buffers, the layers in order, the loss.

The sequential reference of the pipeline for the ``llama`` kind, as ``nn.gpt.GPT`` is
for the GPT: the trainer's stages run the same layers (``llama_layers.build_layer``)
over slices of the same groups. With a tied head the output layer reads the
embedding's ``tok_emb`` and accumulates into its gradient view, so both uses sum
in one place. Equations: ``hpcpipe.nn.llama_layers``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hpcpipe.nn.llama_layers import build_layer
from hpcpipe.nn.llama_params import LlamaShape, init_group, param_groups
from hpcpipe.nn.token_loss import token_cross_entropy


class Llama:
    """Every layer group of a Llama over one flat parameter buffer (``flat``) and one gradient buffer (``grad``)."""

    def __init__(self, shape: LlamaShape, xp: Any = np, dtype: str = "float32", seed: int = 0):
        self.shape, self.xp = shape, xp
        groups = param_groups(shape)
        total = sum(int(np.prod(dims)) for group in groups for _, dims in group)
        self.flat = xp.zeros(total, dtype=dtype)
        self.grad = xp.zeros(total, dtype=dtype)
        self.params: list[dict[str, Any]] = []
        self.grads: list[dict[str, Any]] = []
        offset = 0
        for group in groups:
            p, g = {}, {}
            for name, dims in group:
                size = int(np.prod(dims))
                p[name] = self.flat[offset:offset + size].reshape(dims)
                g[name] = self.grad[offset:offset + size].reshape(dims)
                offset += size
            self.params.append(p)
            self.grads.append(g)
        for index in range(shape.n_groups):
            self.load_group(index, init_group(shape, index, seed, dtype))
        tok, grad_tok = self.params[0]["tok_emb"], self.grads[0]["tok_emb"]
        self.layers = [build_layer(shape, i, self.params[i], self.grads[i], xp, tok, grad_tok)
                       for i in range(shape.n_groups)]

    def load_group(self, index: int, arrays: dict[str, Any]) -> None:
        """Copy host arrays {name: array} into group ``index``'s parameters."""
        for name, view in self.params[index].items():
            view[...] = self.xp.asarray(arrays[name])

    def forward(self, tokens: Any) -> tuple[Any, list]:
        """Return ((micro-batch, T, vocab) logits, per-layer caches) for integer tokens (micro-batch, T)."""
        caches = []
        x = tokens
        for layer in self.layers:
            x, cache = layer.forward(x)
            caches.append(cache)
        return x, caches

    def backward(self, caches: list, g: Any) -> None:
        """Accumulate every parameter gradient from dL/dlogits."""
        for layer, cache in zip(reversed(self.layers), reversed(caches), strict=True):
            g = layer.backward(cache, g)

    def loss_and_grad(self, tokens: Any, targets: Any, scale: float | None = None) -> float:
        """Accumulate the gradient of the loss and return the mean cross-entropy over the target tokens.

        ``scale`` defaults to 1 / (number of targets), the gradient of this batch's mean.
        """
        if scale is None:
            scale = 1.0 / targets.size
        logits, caches = self.forward(tokens)
        total, g = token_cross_entropy(self.xp, logits, targets, scale)
        self.backward(caches, g)
        return total / targets.size
