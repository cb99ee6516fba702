"""The llama kind's shape and parameter groups: the HDF5 layer contract of a Llama-family decoder.

Group 0 is the token embedding (``tok_emb``; positions enter through RoPE, not
a table), groups 1..n_blocks the decoder blocks, group n_blocks + 1 the final
RMSNorm and, when the head is untied, its own ``head/weight``. Names inside a
group are the HDF5 paths below ``/layers/NNNN/``; weights are stored (in, out),
``y = x @ weight``, as everywhere in hpcpipe.

The same shape describes Llama 2/3.x, Mistral, Qwen2 (``qkv_bias``), Qwen3 (``qk_norm``: an RMSNorm of
each head's q and k before RoPE, ``attn/q_norm`` and ``attn/k_norm``), SmolLM and TinyLlama: grouped-query
attention with ``n_kv_heads`` key/value heads shared by ``n_heads / n_kv_heads`` query heads each, ``head_dim``
possibly other than d_model / n_heads, RoPE with ``rope_theta`` and an optional ``rope_scaling``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from hpcpipe.nn.core.decoder_model import DecoderShape, positive_int
from hpcpipe.nn.core.rope import check_scaling


def default_ff(d_model: int) -> int:
    """Meta's Llama MLP width for d_model: 2/3 of 4 d_model, rounded up to a multiple of 256 (4096 -> 11008)."""
    return (int(8 * d_model / 3) + 255) // 256 * 256


@dataclass(frozen=True)
class LlamaShape(DecoderShape):
    """The shape of a Llama-family decoder.

    ``n_kv_heads`` 0 means n_heads (plain multi-head attention) and ``head_dim`` 0 means
    d_model // n_heads; both are resolved on construction. ``d_ff`` 0 means Meta's
    width (:func:`default_ff`). ``rope_scaling`` is None or a dict as Hugging Face
    configs hold it (see :func:`hpcpipe.nn.core.rope.check_scaling`); it takes no part in the hash.
    """

    tied: bool = False
    n_kv_heads: int = 0
    head_dim: int = 0
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default=None, hash=False)
    norm_eps: float = 1e-5
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int = 0                  # > 0: the blocks of sliding_layers see their last sliding_window tokens
    sliding_layers: tuple[int, ...] = ()     # blocks (0-based) with the window; () = every block

    label: ClassVar[str] = "llama"
    ff_default: ClassVar[str] = "the default"

    def __post_init__(self):
        super().__post_init__()
        for name, zero in (("n_kv_heads", "n_heads"), ("head_dim", "d_model / n_heads")):
            positive_int(self.label, name, getattr(self, name), zero)
        for name in ("tied", "qkv_bias", "qk_norm"):
            if not isinstance(getattr(self, name), bool | np.bool_):
                raise ValueError(f"llama {name} must be true or false, got {getattr(self, name)!r}")
            object.__setattr__(self, name, bool(getattr(self, name)))
        kv = self.n_kv_heads or self.n_heads
        if self.n_heads % kv:
            raise ValueError(f"llama n_heads {self.n_heads} is not a multiple of n_kv_heads {kv}")
        if not self.head_dim and self.d_model % self.n_heads:
            raise ValueError(f"llama d_model {self.d_model} is not a multiple of n_heads {self.n_heads} "
                             "(give head_dim explicitly)")
        hd = self.head_dim or self.d_model // self.n_heads
        if hd % 2:
            raise ValueError(f"llama head_dim {hd} must be even (RoPE rotates pairs of its halves)")
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0 \
                    or not math.isfinite(value):
                raise ValueError(f"llama {name} must be a positive number, got {value!r}")
        object.__setattr__(self, "n_kv_heads", kv)
        object.__setattr__(self, "head_dim", hd)
        object.__setattr__(self, "rope_theta", float(self.rope_theta))
        object.__setattr__(self, "norm_eps", float(self.norm_eps))
        # a private copy: the caller's dict may change later, the frozen shape must not
        scaling = check_scaling(self.rope_scaling)
        # transformers 5 keeps rope_theta inside its rope_parameters dict: it must agree with ours
        theta = self.rope_theta if self.rope_scaling is None else self.rope_scaling.get("rope_theta", self.rope_theta)
        if theta != self.rope_theta:
            raise ValueError(f"llama rope_scaling says rope_theta {theta!r} but rope_theta is {self.rope_theta!r}")
        object.__setattr__(self, "rope_scaling", scaling)
        positive_int(self.label, "sliding_window", self.sliding_window, "no window")
        layers = tuple(int(i) for i in self.sliding_layers)
        if any(not 0 <= i < self.n_blocks for i in layers) or len(set(layers)) != len(layers):
            raise ValueError(f"llama sliding_layers {list(layers)} must be distinct blocks of 0..{self.n_blocks - 1}")
        object.__setattr__(self, "sliding_layers", layers)

    @property
    def ff(self) -> int:
        """Width of the MLP's hidden layer (gate and up outputs)."""
        return self.d_ff or default_ff(self.d_model)

    def window(self, index: int) -> int:
        """The sliding window of layer group ``index`` (block index - 1): 0 when it sees the whole context."""
        if not self.sliding_window or not 1 <= index <= self.n_blocks:
            return 0
        return self.sliding_window if not self.sliding_layers or index - 1 in self.sliding_layers else 0

    @property
    def q_width(self) -> int:
        """Width of the query projection: n_heads * head_dim."""
        return self.n_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Width of the key and of the value projection: n_kv_heads * head_dim."""
        return self.n_kv_heads * self.head_dim

    @property
    def group(self) -> int:
        """Query heads per key/value head."""
        return self.n_heads // self.n_kv_heads


def block_params(shape: LlamaShape) -> list[tuple[str, tuple[int, ...]]]:
    """Return the (name, shape) of every parameter of one decoder block, in storage order."""
    d, ff, qw, kvw = shape.d_model, shape.ff, shape.q_width, shape.kv_width
    out = [("attn_norm/weight", (d,)),
           ("attn/q/weight", (d, qw)), ("attn/k/weight", (d, kvw)), ("attn/v/weight", (d, kvw)),
           ("attn/o/weight", (qw, d))]
    if shape.qkv_bias:
        out += [("attn/q/bias", (qw,)), ("attn/k/bias", (kvw,)), ("attn/v/bias", (kvw,))]
    if shape.qk_norm:
        out += [("attn/q_norm/weight", (shape.head_dim,)), ("attn/k_norm/weight", (shape.head_dim,))]
    return out + [("mlp_norm/weight", (d,)),
                  ("mlp/gate/weight", (d, ff)), ("mlp/up/weight", (d, ff)), ("mlp/down/weight", (ff, d))]


def group_params(shape: LlamaShape, index: int) -> list[tuple[str, tuple[int, ...]]]:
    """Return the (name, shape) of every parameter of layer group ``index``, in storage order."""
    if not 0 <= index < shape.n_groups:
        raise ValueError(f"llama layer group {index} out of range 0..{shape.n_groups - 1}")
    d = shape.d_model
    if index == 0:
        return [("tok_emb", (shape.vocab, d))]
    if index <= shape.n_blocks:
        return block_params(shape)
    final = [("norm/weight", (d,))]
    return final if shape.tied else final + [("head/weight", (d, shape.vocab))]
