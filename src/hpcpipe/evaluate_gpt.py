"""Held-out loss of a stored GPT over a token file: the sequential forward in the model's dtype, in slabs of windows.

``python -m hpcpipe.evaluate`` comes here when the weights hold ``model.kind =
"gpt"``. The token file is checked first (integer ``x`` and ``y`` of shape
(N, seq_len), every id inside the vocabulary: the first bad one is named by
row); then the windows are run through :class:`hpcpipe.nn.gpt.GPT` (the
layers the pipeline trains) in slabs whose largest activation holds about
``SLAB_ELEMENTS`` numbers, so memory stays bounded whatever the file's size.
The loss is the mean cross-entropy per target token, as ``train.loss`` for a GPT.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from hpcpipe.errors import ConfigError
from hpcpipe.h5files import open_hdf5
from hpcpipe.nn.gpt import GPT
from hpcpipe.nn.gpt_params import GPTShape
from hpcpipe.nn.model_spec import gpt_shape, model_specs
from hpcpipe.state.kinds import stored_config
from hpcpipe.state.sources import WeightsSource
from hpcpipe.train.tokens import check_token_file

SLAB_ELEMENTS = 1 << 21   # numbers in the largest activation of one slab (logits or attention scores)


def slab_rows(shape: GPTShape) -> int:
    """Return how many windows to run at once so that no activation exceeds about SLAB_ELEMENTS numbers."""
    widest = max(shape.vocab, shape.ff, 3 * shape.d_model, shape.n_heads * shape.seq_len)
    return max(1, SLAB_ELEMENTS // (shape.seq_len * widest))


def load_gpt(source: WeightsSource, specs: list[Any], shape: GPTShape, dtype: str) -> GPT:
    """Return a GPT holding the stored weights (every group checked against its spec, then read)."""
    source.check(specs)
    model = GPT(shape, np, dtype)
    arrays = source.read(list(range(shape.n_groups)))
    for index in range(shape.n_groups):
        model.load_group(index, arrays[index])
    return model


def logits_of(model: GPT, tokens: np.ndarray) -> np.ndarray:
    """Return the (rows, T, vocab) logits, keeping no layer's cache beyond its own step."""
    x: Any = tokens
    for layer in model.layers:
        x, _ = layer.forward(x)
    return x


def token_losses(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Return the cross-entropy of every target token (rows, T): log-sum-exp minus the target's logit."""
    shifted = logits - logits.max(axis=-1, keepdims=True)
    lse = np.log(np.exp(shifted).sum(axis=-1))
    return lse - np.take_along_axis(shifted, targets[..., None], axis=-1)[..., 0]


def evaluate_gpt(source: WeightsSource, data: str | Path, x_name: str = "x", y_name: str = "y",
                 read_rows: Any = None) -> dict[str, Any]:
    """Return {'n', 'tokens', 'loss_nats', 'loss_bits', 'weights', 'step'} of a GPT over a token file.

    ``n`` counts windows, ``tokens`` target tokens; ``loss_nats`` is their mean
    cross-entropy and ``loss_bits`` the same in bits (nats / ln 2). A non-finite
    loss is a ConfigError naming the row, never a NaN in the result.
    """
    label = source.describe()
    config = stored_config(source.model, label)
    shape, dtype = gpt_shape(config), config.model.dtype
    n = check_token_file(data, x_name, y_name, shape.seq_len, shape.vocab)
    model = load_gpt(source, model_specs(config), shape, dtype)
    where = f"token file {str(data)!r}"
    read = read_rows or (lambda dset, a, b, _label: dset[a:b])
    total, step = 0.0, slab_rows(shape)
    with open_hdf5(data, where) as f:
        x, y = f[x_name], f[y_name]
        for a in range(0, n, step):
            b = min(a + step, n)
            xs = read(x, a, b, where).astype(np.int64)
            ys = read(y, a, b, where).astype(np.int64)
            losses = token_losses(logits_of(model, xs), ys)
            finite = np.isfinite(losses).all(axis=1)
            if not finite.all():
                row = a + int(np.flatnonzero(~finite)[0])
                raise ConfigError(f"the loss of {label} on row {row} of {where} is not finite "
                                  f"(non-finite weights, or values beyond {dtype})")
            total += float(losses.sum(dtype=np.float64))
    tokens = n * shape.seq_len
    nats = total / tokens
    return {"n": int(n), "tokens": int(tokens), "loss_nats": nats, "loss_bits": nats / math.log(2),
            "weights": str(source.path), "step": source.step}
