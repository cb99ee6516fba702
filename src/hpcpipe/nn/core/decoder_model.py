"""What every decoder kind shares: the shape's common keys, the layer-group model, and a sequential reference.

A kind (GPT, Llama, ...) subclasses :class:`DecoderShape` with its own keys and :class:`DecoderModel`
with its parts (``norm``, ``attention``, ``mlp``, parameter names and initial values, costs, tensor-
parallel cuts); everything else (token ids in, (micro-batch, T, d) between groups, logits out, the
token loss and its vocabulary-parallel form, the layers of each group) is here, once. :class:`Decoder`
runs every group of a model on one process (the sequential reference the tests compare pipelines to).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from hpcpipe.kernels.stage import FusedBlock, FusedKind
from hpcpipe.nn.core.decoder import Block, Embedding, OutputHead
from hpcpipe.nn.core.sharding import Shard, vocab_range
from hpcpipe.nn.core.tensor_parallel import vocab_parallel_cross_entropy
from hpcpipe.nn.model_def import GroupSpec, ModelDef
from hpcpipe.nn.protocol import Layer
from hpcpipe.nn.token_loss import token_cross_entropy

INIT_STD = 0.02


def positive_int(label: str, name: str, value: Any, zero_hint: str = "") -> None:
    """Raise ValueError naming the key unless value is a positive integer (or 0 when ``zero_hint`` says what 0 is)."""
    low = 0 if zero_hint else 1
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        hint = f" (or 0 for {zero_hint})" if zero_hint else ""
        raise ValueError(f"{label} {name} must be a positive integer{hint}, got {value!r}")


@dataclass(frozen=True)
class DecoderShape:
    """The keys every decoder has; ``d_ff`` 0 means the kind's default MLP width (:attr:`ff`)."""

    vocab: int
    seq_len: int
    d_model: int
    n_heads: int
    n_blocks: int
    d_ff: int = 0
    tied: bool = True

    label: ClassVar[str] = "decoder"        # the kind's name in messages
    ff_default: ClassVar[str] = ""          # what d_ff 0 means, in messages

    def __post_init__(self):
        for name in ("vocab", "seq_len", "d_model", "n_heads", "n_blocks"):
            positive_int(self.label, name, getattr(self, name))
        positive_int(self.label, "d_ff", self.d_ff, self.ff_default)

    @property
    def ff(self) -> int:
        """Width of the MLP's hidden layer."""
        raise NotImplementedError

    @property
    def n_groups(self) -> int:
        """Number of layer groups: embedding, blocks, final norm + head."""
        return self.n_blocks + 2


class DecoderModel(ModelDef):
    """A decoder kind's layer groups: group 0 embedding, 1..n_blocks blocks, n_blocks + 1 final norm and head.

    Subclasses give ``kind``, ``NORMS`` (the parameter prefixes of a block's two norms and the final one)
    and the parts below; the groups' layers, boundaries and losses are built here from them.
    """

    NORMS: ClassVar[tuple[str, str, str]]

    def __init__(self, shape: DecoderShape):
        self.shape = shape
        self.tied = shape.tied
        self.specs: list[GroupSpec] = [GroupSpec(i, dict(self.group_params(i)), self.group_cost(i),
                                                 self.group_activations(i), kind=self.kind)
                                       for i in range(shape.n_groups)]
        self.loss_fn = token_cross_entropy

    # -- what a kind gives ------------------------------------------------------------------------------------------

    def group_params(self, index: int) -> list[tuple[str, tuple[int, ...]]]:
        """Return the (name, shape) of every parameter of layer group ``index``, in storage order."""
        raise NotImplementedError

    def group_cost(self, index: int) -> int:
        """Multiply-adds per token of group ``index``'s forward (what the stage partition balances)."""
        raise NotImplementedError

    def group_activations(self, index: int) -> int:
        """Elements per window group ``index``'s forward caches for its backward (an upper bound)."""
        raise NotImplementedError

    def init_value(self, name: str, dims: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
        """Return the initial value of parameter ``name`` (float64), drawn from ``rng`` for matrices."""
        raise NotImplementedError

    def norm(self, params: dict[str, Any], grads: dict[str, Any], prefix: str, xp: Any) -> Any:
        """Return the norm ``prefix/...`` of a parameter group."""
        raise NotImplementedError

    def attention(self, params: dict[str, Any], grads: dict[str, Any], xp: Any, tp: Any, index: int) -> Any:
        """Return block ``index``'s attention (hpcpipe.nn.core.attention.CausalAttention) over this rank's heads."""
        raise NotImplementedError

    def mlp(self, params: dict[str, Any], grads: dict[str, Any], xp: Any, tp: Any, index: int, ep: Any = None) -> Any:
        """Return block ``index``'s MLP over this rank's hidden columns (``ep``: the expert-parallel group, for a
        kind with experts)."""
        raise NotImplementedError

    def local_heads(self, tp: Any) -> tuple[int, int]:
        """(query heads, key/value heads) a rank of tp holds (all of them at tp = 1)."""
        raise NotImplementedError

    def shards(self, index: int, tp: int, rank: int) -> dict[str, Shard]:
        raise NotImplementedError

    def fusable(self) -> bool:
        """Whether the compiled decode step computes every block of this model (a kind it cannot: False)."""
        return True

    def fused_kind(self) -> FusedKind:
        """What the compiled decode step computes for this kind (norm, MLP, RoPE, epsilons)."""
        raise NotImplementedError

    def fused_block(self, params: dict[str, Any], fmt: str, index: int) -> FusedBlock:
        """Block ``index``'s parameters (float (in, out) arrays or (out, in) RowWeights) as the compiled step takes
        them, matrices in weight format ``fmt``."""
        raise NotImplementedError

    # -- built from those ---------------------------------------------------------------------------------------------

    def init_group(self, index: int, seed: int, dtype: str = "float32") -> dict[str, np.ndarray]:
        """Return group ``index``'s initial parameters, drawn from (seed, index) only, never from the layout."""
        rng = np.random.default_rng([seed, index])
        return {name: self.init_value(name, dims, rng).astype(dtype) for name, dims in self.group_params(index)}

    def init_arrays(self, indices, seed, dtype):
        return {i: self.init_group(i, seed, dtype) for i in indices}

    def vocab_lo(self, tp: Any) -> int:
        """The first token id of the vocabulary part of tp's rank (0 at tp = 1)."""
        return 0 if tp is None else vocab_range(self.shape.vocab, tp.size, tp.rank)[0]

    def window(self, index: int) -> int:
        """The sliding attention window of layer group ``index`` (a block): 0 when it sees the whole context."""
        return 0

    def block(self, params: dict[str, Any], grads: dict[str, Any], xp: Any, tp: Any = None, index: int = 1,
              ep: Any = None) -> Block:
        """Return decoder block ``index`` (a layer group) over its parameter and gradient views (gradients None:
        forward only)."""
        first, second, _ = self.NORMS
        return Block(self.norm(params, grads, first, xp), self.attention(params, grads, xp, tp, index),
                     self.norm(params, grads, second, xp), self.mlp(params, grads, xp, tp, index, ep))

    def build_layer(self, index, params, grads, xp, tok_emb=None, grad_tok_emb=None, tp=None, ep=None) -> Layer:
        if index == 0:
            return Embedding(params, grads, self.shape.seq_len, xp, tp, self.vocab_lo(tp))
        if index <= self.shape.n_blocks:
            return self.block(params, grads, xp, tp, index, ep)
        return OutputHead(self.norm(params, grads, self.NORMS[2], xp), params, grads, xp, tok_emb, grad_tok_emb, tp)

    def tp_loss(self, tp):
        if tp is None or tp.size == 1:
            return self.loss_fn
        lo = self.vocab_lo(tp)
        return lambda xp, logits, targets, scale: vocab_parallel_cross_entropy(xp, logits, targets, scale, lo, tp)

    def boundary(self, index, batch, tp=1, rank=0):
        t = self.shape.seq_len
        if index == 0:
            return (batch, t), "int64"
        if index == self.n_layers:
            return (batch, t, self.shape.vocab), None
        return (batch, t, self.shape.d_model), None

    def samples_norm(self, n_samples):
        return n_samples * self.shape.seq_len     # mean over every target token

    def residual_std(self) -> float:
        """The init std of the residual projections: INIT_STD / sqrt(2 n_blocks) (GPT-2's scaling)."""
        return INIT_STD / math.sqrt(2 * self.shape.n_blocks)


class Decoder:
    """Every layer group of a decoder model on one process, over one flat parameter and one gradient buffer.

    The sequential reference of the pipeline: the trainer's stages run the same layers over slices of
    the same groups. With a tied head the output layer reads the embedding's ``tok_emb`` and accumulates
    into its gradient view, so both uses sum in one place.
    """

    def __init__(self, model: DecoderModel, xp: Any = np, dtype: str = "float32", seed: int = 0):
        self.model, self.shape, self.xp = model, model.shape, xp
        groups = [model.group_params(i) for i in range(model.n_layers)]
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
        for index in range(model.n_layers):
            self.load_group(index, model.init_group(index, seed, dtype))
        tok, grad_tok = self.params[0]["tok_emb"], self.grads[0]["tok_emb"]
        self.layers = [model.build_layer(i, self.params[i], self.grads[i], xp, tok, grad_tok)
                       for i in range(model.n_layers)]

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
