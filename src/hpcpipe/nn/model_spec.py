"""Model kinds behind one interface: layer groups, their parameters, initial values, layers and stage boundaries.

The trainer, the partition, the parameter buffers and the state code see a
model only through :class:`ModelDef`: ``specs`` (one per HDF5 layer group, with
``index``, ``kind``, ``shapes``, ``n_params``, ``cost``), ``init_arrays``,
``build_layer``, the activation shape at each group boundary and the loss.
``mlp`` is the Linear + activation model; ``gpt`` the GPT-2 style decoder and
``llama`` the Llama-family decoder (both: group 0 embedding, 1..n_blocks decoder
blocks, n_blocks + 1 final norm + head).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from hpcpipe.config import Config
from hpcpipe.errors import ConfigError
from hpcpipe.nn import loss as losses
from hpcpipe.nn.gpt_layers import build_layer as build_gpt_layer
from hpcpipe.nn.gpt_params import GPTShape, group_params, init_group
from hpcpipe.nn.layers import Dense, make_activation
from hpcpipe.nn.llama_layers import build_layer as build_llama_layer
from hpcpipe.nn.llama_params import LlamaShape
from hpcpipe.nn.llama_params import group_params as llama_group_params
from hpcpipe.nn.llama_params import init_group as llama_init_group
from hpcpipe.nn.model import LayerSpec, initial_arrays, layer_specs
from hpcpipe.nn.protocol import Layer
from hpcpipe.nn.sharding import Shard, gpt_shards, llama_shards, mlp_shards, split_range, vocab_range
from hpcpipe.nn.tensor_parallel import vocab_parallel_cross_entropy
from hpcpipe.nn.token_loss import token_cross_entropy


@dataclass(frozen=True)
class GroupSpec:
    """One decoder layer group (GPT or llama): parameters (HDF5 names below /layers/NNNN/), forward cost per token."""

    index: int
    shapes: dict[str, tuple[int, ...]]
    cost: int
    act_elements: int           # elements per sample (window) the group caches for its backward
    kind: str = "gpt"

    @property
    def n_params(self) -> int:
        """Number of scalars in the group's parameters."""
        return sum(math.prod(s) for s in self.shapes.values())


def gpt_shape(config: Config) -> GPTShape:
    """Return the GPTShape the [model] keys describe."""
    m = config.model
    return GPTShape(m.vocab_size, m.seq_len, m.d_model, m.n_heads, m.n_blocks, m.d_ff, m.tie_embeddings)


def llama_shape(config: Config) -> LlamaShape:
    """Return the LlamaShape the [model] keys describe."""
    m = config.model
    return LlamaShape(m.vocab_size, m.seq_len, m.d_model, m.n_heads, m.n_blocks, m.d_ff, m.tie_embeddings,
                      m.n_kv_heads, m.head_dim, m.rope_theta, dict(m.rope_scaling) or None, m.norm_eps, m.qkv_bias)


def decoder_shape(config: Config) -> GPTShape | LlamaShape:
    """Return the shape of a decoder model (model.kind gpt or llama)."""
    return gpt_shape(config) if config.model.kind == "gpt" else llama_shape(config)


def llama_group_cost(shape: LlamaShape, index: int) -> int:
    """Multiply-adds per token of a llama group's forward (as gpt_group_cost: attention over the causal prefix)."""
    d, t, qw, kvw = shape.d_model, shape.seq_len, shape.q_width, shape.kv_width
    if index == 0:
        return d
    if index <= shape.n_blocks:
        return 2 * d * qw + 2 * d * kvw + 3 * d * shape.ff + qw * (t + 1)
    return d * shape.vocab


def llama_group_activations(shape: LlamaShape, index: int) -> int:
    """Elements per window a llama group's forward caches for its backward (an upper bound, as the GPT's).

    Per token, a block keeps: the two RMSNorms' inputs and outputs (4 d), q, k and v
    (q_width + 2 kv_width), the attention weights (heads x T), the heads (q_width), the
    gate, up, silu and product (4 ff), and the norms' 1 / rms (2).
    """
    d, t = shape.d_model, shape.seq_len
    if index == 0:
        return t
    if index <= shape.n_blocks:
        return t * (4 * d + 2 * shape.q_width + 2 * shape.kv_width + shape.n_heads * t + 4 * shape.ff + 2)
    return t * (2 * d + 1)


def gpt_group_cost(shape: GPTShape, index: int) -> int:
    """Multiply-adds per token of a group's forward: blocks count attention over the causal prefix, the head d x vocab.

    The embedding is a gather (d per token); counting the head's d x vocab is what
    keeps a large vocabulary from piling onto the last stage unnoticed.
    """
    d, t = shape.d_model, shape.seq_len
    if index == 0:
        return d
    if index <= shape.n_blocks:
        # qkv (3 d^2) + proj (d^2) + MLP (2 d ff) + scores and weighted values over (t + 1) / 2 keys on average
        return 4 * d * d + 2 * d * shape.ff + d * (t + 1)
    return d * shape.vocab


def gpt_group_activations(shape: GPTShape, index: int) -> int:
    """Elements per window a group's forward caches for its backward (what the engine's stash counts).

    Per token, a block keeps: ln1's x_hat and output (2 d), qkv (3 d: q, k and v are
    views of it), the attention weights (heads x T), the concatenated heads (d),
    ln2's x_hat and output (2 d), the GELU's pre-activation, tanh and output (3 ff),
    and the two LayerNorms' 1 / std (2). The head keeps ln_f's x_hat and output and
    1 / std (2 d + 1); the embedding its token ids (int64: counted as 2 elements of
    float32 would over-count float64; the estimate counts 1).
    """
    d, t = shape.d_model, shape.seq_len
    if index == 0:
        return t
    if index <= shape.n_blocks:
        return t * (8 * d + shape.n_heads * t + 3 * shape.ff + 2)
    return t * (2 * d + 1)


class ModelDef:
    """What the engine needs of a model kind (MLP or GPT); built once from the config."""

    kind: str
    specs: list
    tied: bool = False
    loss_fn: Callable

    @property
    def n_layers(self) -> int:
        """Number of layer groups (HDF5 /layers entries)."""
        return len(self.specs)

    def init_arrays(self, indices: list[int], seed: int, dtype: str) -> dict[int, dict[str, np.ndarray]]:
        """Return the deterministic initial parameters of the given groups."""
        raise NotImplementedError

    def build_layer(self, index: int, params: dict[str, Any], grads: dict[str, Any], xp: Any,
                    tok_emb: Any = None, grad_tok_emb: Any = None, tp: Any = None) -> Layer:
        """Return the layer of group ``index`` over its parameter and gradient views (``tp``: the stage's
        tensor-parallel group, whose rank holds the parts :meth:`shards` names)."""
        raise NotImplementedError

    def shards(self, index: int, tp: int, rank: int) -> dict[str, Shard]:
        """The part of each parameter of group ``index`` tp rank ``rank`` holds (hpcpipe.nn.sharding)."""
        raise NotImplementedError

    def boundary_shared(self, index: int) -> bool:
        """Whether the activation entering group ``index`` is the same on every tp rank (else each holds a part)."""
        return True

    def tp_loss(self, tp: Any) -> Callable:
        """The loss function of a last stage whose tp ranks hold parts of the output (loss_fn at tp = 1)."""
        return self.loss_fn

    def boundary(self, index: int, batch: int) -> tuple[tuple[int, ...], str | None]:
        """Return (shape, dtype or None for the model's dtype) of the activation entering group ``index``.

        ``index == n_layers`` is the model's output.
        """
        raise NotImplementedError

    def samples_norm(self, n_samples: int) -> int:
        """Return the count a summed loss over n_samples samples is divided by to give the mean."""
        raise NotImplementedError


class MLPModel(ModelDef):
    """The Linear + activation model of ``model.dims``."""

    kind = "mlp"

    def __init__(self, config: Config):
        self.config = config
        self.specs: list[LayerSpec] = layer_specs(config)
        self.loss_name = config.train.loss
        self.loss_fn = losses.LOSSES[self.loss_name]

    def init_arrays(self, indices, seed, dtype):
        return initial_arrays(self.specs, indices, seed, dtype)

    def build_layer(self, index, params, grads, xp, tok_emb=None, grad_tok_emb=None, tp=None):
        s = self.specs[index]
        split = tp if tp is not None and tp.size > 1 else None
        # even layers column-parallel (their input gradient summed), odd layers row-parallel (output summed)
        return Dense(index, params["weight"], params.get("bias"), grads["weight"], grads.get("bias"),
                     make_activation(s.activation), xp, reduce_out=split if index % 2 else None,
                     reduce_input_grad=None if index % 2 else split)

    def shards(self, index, tp, rank):
        s = self.specs[index]
        return mlp_shards(index, list(s.shapes), s.fan_in, s.fan_out, tp, rank)

    def boundary(self, index, batch, tp=1, rank=0):
        dims = self.config.model.dims
        if self.boundary_shared(index):
            return (batch, dims[index]), None
        part = split_range(dims[index], tp, rank)
        return (batch, part.stop - part.start), None

    def boundary_shared(self, index):
        return index % 2 == 0      # after a column-parallel (even) layer each rank holds its columns

    def tp_loss(self, tp):
        if tp is None or tp.size == 1 or self.boundary_shared(self.n_layers):
            return self.loss_fn
        part = split_range(self.config.model.dims[-1], tp.size, tp.rank)
        if self.loss_name == "cross_entropy":
            # a copy: the gradient is written into its argument, and y may be what the activation saved
            return lambda xp, y, labels, scale: vocab_parallel_cross_entropy(xp, y.copy(), labels, scale, part.start,
                                                                             tp)

        def mse_part(xp, y, target, scale):      # this rank's output columns; the sum over every rank
            total, grad = losses.mse(xp, y, target[:, part], scale)
            return float(tp.sum_(np.array([total]))[0]), grad
        return mse_part

    def samples_norm(self, n_samples):
        return losses.normaliser(self.loss_name, n_samples, self.config.model.dims[-1])


class DecoderModel(ModelDef):
    """What a GPT and a llama share: token ids in, (micro-batch, T, d) between groups, logits out, token loss."""

    shape: GPTShape | LlamaShape

    def tp_loss(self, tp):
        if tp is None or tp.size == 1:
            return self.loss_fn
        lo, _ = vocab_range(self.shape.vocab, tp.size, tp.rank)
        return lambda xp, logits, targets, scale: vocab_parallel_cross_entropy(xp, logits, targets, scale, lo, tp)

    def vocab_lo(self, tp: Any) -> int:
        """The first token id of the vocabulary part of tp's rank (0 at tp = 1)."""
        return 0 if tp is None else vocab_range(self.shape.vocab, tp.size, tp.rank)[0]

    def boundary(self, index, batch, tp=1, rank=0):
        t = self.shape.seq_len
        if index == 0:
            return (batch, t), "int64"
        if index == self.n_layers:
            return (batch, t, self.shape.vocab), None
        return (batch, t, self.shape.d_model), None

    def samples_norm(self, n_samples):
        return n_samples * self.shape.seq_len     # mean over every target token


class LlamaModel(DecoderModel):
    """A Llama-family decoder: embedding, n_blocks blocks (RMSNorm, RoPE, GQA, SwiGLU), final norm and head."""

    kind = "llama"

    def __init__(self, config: Config):
        try:
            self.shape = llama_shape(config)
        except ValueError as exc:     # a combination config_checks does not see (e.g. rope_theta in rope_scaling)
            raise ConfigError(f"model: {exc}") from None
        self.tied = self.shape.tied
        self.specs: list[GroupSpec] = [
            GroupSpec(i, dict(llama_group_params(self.shape, i)), llama_group_cost(self.shape, i),
                      llama_group_activations(self.shape, i), kind="llama") for i in range(self.shape.n_groups)]
        self.loss_fn = token_cross_entropy

    def init_arrays(self, indices, seed, dtype):
        return {i: llama_init_group(self.shape, i, seed, dtype) for i in indices}

    def build_layer(self, index, params, grads, xp, tok_emb=None, grad_tok_emb=None, tp=None):
        return build_llama_layer(self.shape, index, params, grads, xp, tok_emb, grad_tok_emb, tp, self.vocab_lo(tp))

    def shards(self, index, tp, rank):
        return llama_shards(self.shape, index, list(self.specs[index].shapes), tp, rank)


class GPTModel(DecoderModel):
    """A GPT-2 style decoder: embedding, n_blocks blocks, final norm and (tied or own) head."""

    kind = "gpt"

    def __init__(self, config: Config):
        self.shape = gpt_shape(config)
        self.tied = self.shape.tied
        self.specs: list[GroupSpec] = [GroupSpec(i, dict(group_params(self.shape, i)), gpt_group_cost(self.shape, i),
                                                 gpt_group_activations(self.shape, i))
                                       for i in range(self.shape.n_groups)]
        self.loss_fn = token_cross_entropy

    def init_arrays(self, indices, seed, dtype):
        return {i: init_group(self.shape, i, seed, dtype) for i in indices}

    def build_layer(self, index, params, grads, xp, tok_emb=None, grad_tok_emb=None, tp=None):
        return build_gpt_layer(self.shape, index, params, grads, xp, tok_emb, grad_tok_emb, tp, self.vocab_lo(tp))

    def shards(self, index, tp, rank):
        return gpt_shards(self.shape, index, list(self.specs[index].shapes), tp, rank)


def model_def(config: Config) -> ModelDef:
    """Return the model definition of config.model.kind."""
    return {"gpt": GPTModel, "llama": LlamaModel}.get(config.model.kind, MLPModel)(config)


def model_specs(config: Config) -> list:
    """Return one spec per layer group of the configured model (MLP: LayerSpec; GPT, llama: GroupSpec)."""
    return model_def(config).specs
