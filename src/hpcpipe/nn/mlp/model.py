"""The mlp kind: ``model.dims`` Linear layers with an activation, one layer group each (the seeds' model).

Layer i: ``y = act(x @ weight + bias)``, weight (dims[i], dims[i+1]), He-normal initial weights drawn
from (seed, i) only. With tensor parallelism layers alternate column- and row-parallel: even layers
cut their weight's columns (and bias), so their output is cut too; odd layers cut their weight's rows
(the input they receive is cut), sum their partial outputs over the ranks and add a replicated bias.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hpcpipe.nn import loss as losses
from hpcpipe.nn.core.activations import make_activation
from hpcpipe.nn.core.dense import Dense
from hpcpipe.nn.core.sharding import REPLICATED, Shard, column_part, row_part, split_range
from hpcpipe.nn.core.tensor_parallel import vocab_parallel_cross_entropy
from hpcpipe.nn.model_def import ModelDef


@dataclass(frozen=True)
class LayerSpec:
    """Shape and activation of one global layer."""

    index: int
    fan_in: int
    fan_out: int
    bias: bool
    activation: str

    kind = "mlp"

    @property
    def n_params(self) -> int:
        """Number of scalars in weight and bias."""
        return self.fan_in * self.fan_out + (self.fan_out if self.bias else 0)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Parameter names and shapes: weight (in, out) and, with biases, bias (out,)."""
        shapes: dict[str, tuple[int, ...]] = {"weight": (self.fan_in, self.fan_out)}
        if self.bias:
            shapes["bias"] = (self.fan_out,)
        return shapes

    @property
    def cost(self) -> int:
        """Multiply-adds per sample of the forward (what the stage partition balances)."""
        return self.fan_in * self.fan_out

    @property
    def act_elements(self) -> int:
        """Upper bound of the elements per sample the layer caches for its backward: its input and output."""
        return self.fan_in + self.fan_out


def layer_specs(config: Any) -> list[LayerSpec]:
    """Return every global layer of the configured MLP, in order."""
    m = config.model
    n = len(m.dims) - 1
    return [LayerSpec(i, m.dims[i], m.dims[i + 1], m.bias,
                      m.activation if (i < n - 1 or m.final_activation) else "identity")
            for i in range(n)]


def init_layer(spec: LayerSpec, seed: int, dtype: str = "float32") -> tuple[np.ndarray, np.ndarray | None]:
    """Return (weight, bias) of a layer drawn from (seed, global index) only: He normal, zero bias."""
    rng = np.random.default_rng([seed, spec.index])
    gain = 2.0 if spec.activation == "relu" else 1.0
    weight = rng.standard_normal((spec.fan_in, spec.fan_out)) * np.sqrt(gain / spec.fan_in)
    bias = np.zeros(spec.fan_out) if spec.bias else None
    return weight.astype(dtype), (bias.astype(dtype) if bias is not None else None)


def initial_arrays(specs: list[LayerSpec], indices: list[int], seed: int,
                   dtype: str) -> dict[int, dict[str, np.ndarray]]:
    """Return the deterministic initial weights of the given global layers."""
    out = {}
    for i in indices:
        w, b = init_layer(specs[i], seed, dtype)
        out[i] = {"weight": w} if b is None else {"weight": w, "bias": b}
    return out


def mlp_shards(index: int, names: list[str], fan_in: int, fan_out: int, tp: int, rank: int) -> dict[str, Shard]:
    """Shards of MLP layer ``index``: even layers column-parallel, odd layers row-parallel."""
    if index % 2 == 0:
        bias = {"bias": row_part(fan_out, tp, rank)} if "bias" in names else {}
        return {"weight": column_part(fan_out, tp, rank), **bias}
    return {"weight": row_part(fan_in, tp, rank), **({"bias": Shard(REPLICATED)} if "bias" in names else {})}


class MLPModel(ModelDef):
    """The Linear + activation model of ``model.dims``."""

    kind = "mlp"

    def __init__(self, config: Any):
        self.config = config
        self.specs: list[LayerSpec] = layer_specs(config)
        self.loss_name = config.train.loss
        self.loss_fn = losses.LOSSES[self.loss_name]

    def init_arrays(self, indices, seed, dtype):
        return initial_arrays(self.specs, indices, seed, dtype)

    def build_layer(self, index, params, grads, xp, tok_emb=None, grad_tok_emb=None, tp=None, ep=None):
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
