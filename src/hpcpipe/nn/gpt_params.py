"""GPT parameter groups (the HDF5 layer contract) and their deterministic initial values.

Group 0 is the embedding (``tok_emb``, ``pos_emb``), groups 1..n_blocks the
decoder blocks, group n_blocks + 1 the final LayerNorm and, when the head is
untied, its own ``head/weight``. Names inside a group are the HDF5 paths below
``/layers/NNNN/``. Initial values depend only on (seed, group index) and the
model's shape, never on the layout, as for the MLP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

INIT_STD = 0.02


@dataclass(frozen=True)
class GPTShape:
    """The shape of a GPT-2 style decoder; ``d_ff`` 0 means 4 * d_model."""

    vocab: int
    seq_len: int
    d_model: int
    n_heads: int
    n_blocks: int
    d_ff: int = 0
    tied: bool = True

    def __post_init__(self):
        for name in ("vocab", "seq_len", "d_model", "n_heads", "n_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPT {name} must be a positive integer, got {value!r}")
        if not isinstance(self.d_ff, int) or isinstance(self.d_ff, bool) or self.d_ff < 0:
            raise ValueError(f"GPT d_ff must be a positive integer (or 0 for 4 * d_model), got {self.d_ff!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"GPT d_model {self.d_model} is not a multiple of n_heads {self.n_heads}")

    @property
    def ff(self) -> int:
        """Width of the MLP's hidden layer."""
        return self.d_ff or 4 * self.d_model

    @property
    def d_head(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.n_heads

    @property
    def n_groups(self) -> int:
        """Number of layer groups: embedding, blocks, final norm + head."""
        return self.n_blocks + 2


def block_params(shape: GPTShape) -> list[tuple[str, tuple[int, ...]]]:
    """Return the (name, shape) of every parameter of one decoder block, in storage order."""
    d, ff = shape.d_model, shape.ff
    return [("ln1/weight", (d,)), ("ln1/bias", (d,)),
            ("attn/qkv/weight", (d, 3 * d)), ("attn/qkv/bias", (3 * d,)),
            ("attn/proj/weight", (d, d)), ("attn/proj/bias", (d,)),
            ("ln2/weight", (d,)), ("ln2/bias", (d,)),
            ("mlp/fc/weight", (d, ff)), ("mlp/fc/bias", (ff,)),
            ("mlp/proj/weight", (ff, d)), ("mlp/proj/bias", (d,))]


def group_params(shape: GPTShape, index: int) -> list[tuple[str, tuple[int, ...]]]:
    """Return the (name, shape) of every parameter of layer group ``index``, in storage order."""
    if not 0 <= index < shape.n_groups:
        raise ValueError(f"GPT layer group {index} out of range 0..{shape.n_groups - 1}")
    d = shape.d_model
    if index == 0:
        return [("tok_emb", (shape.vocab, d)), ("pos_emb", (shape.seq_len, d))]
    if index <= shape.n_blocks:
        return block_params(shape)
    final = [("ln_f/weight", (d,)), ("ln_f/bias", (d,))]
    return final if shape.tied else final + [("head/weight", (d, shape.vocab))]


def param_groups(shape: GPTShape) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Return every group's parameter names and shapes, group 0 (embedding) to n_blocks + 1 (final)."""
    return [group_params(shape, i) for i in range(shape.n_groups)]


def init_group(shape: GPTShape, index: int, seed: int, dtype: str = "float32") -> dict[str, np.ndarray]:
    """Return group ``index``'s initial parameters, drawn from (seed, index) only (GPT-2 style).

    Matrices and embeddings are normal with std 0.02, the two residual projections
    (attn/proj, mlp/proj) scaled by 1 / sqrt(2 n_blocks); biases 0; LayerNorm weights 1.
    """
    rng = np.random.default_rng([seed, index])
    proj_std = INIT_STD / math.sqrt(2 * shape.n_blocks)
    out = {}
    for name, dims in group_params(shape, index):
        if name.endswith("bias"):
            value = np.zeros(dims)
        elif name.startswith("ln"):
            value = np.ones(dims)
        else:
            std = proj_std if name.endswith("proj/weight") else INIT_STD
            value = rng.standard_normal(dims) * std
        out[name] = value.astype(dtype)
    return out
