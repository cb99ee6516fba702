"""The GPT kind's shape and parameter groups: the HDF5 layer contract of a GPT-2 style decoder.

Group 0 is the embedding (``tok_emb``, ``pos_emb``), groups 1..n_blocks the decoder blocks, group
n_blocks + 1 the final LayerNorm and, when the head is untied, its own ``head/weight``. Names inside a
group are the HDF5 paths below ``/layers/NNNN/``; weights are stored (in, out), ``y = x @ weight``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hpcpipe.nn.core.decoder_model import DecoderShape


@dataclass(frozen=True)
class GPTShape(DecoderShape):
    """The shape of a GPT-2 style decoder; ``d_ff`` 0 means 4 * d_model. Every head has its own keys and values."""

    label: ClassVar[str] = "GPT"
    ff_default: ClassVar[str] = "4 * d_model"

    def __post_init__(self):
        super().__post_init__()
        if self.d_model % self.n_heads:
            raise ValueError(f"GPT d_model {self.d_model} is not a multiple of n_heads {self.n_heads}")

    @property
    def ff(self) -> int:
        """Width of the MLP's hidden layer."""
        return self.d_ff or 4 * self.d_model

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.n_heads

    d_head = head_dim

    @property
    def n_kv_heads(self) -> int:
        """Key/value heads: one per query head."""
        return self.n_heads


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
