"""The moe kind's model: the llama kind's attention and norms, and on the blocks ``moe_layers`` names a sparse
mixture of SwiGLU experts (hpcpipe.nn.core.moe) instead of the dense MLP (Mixtral; Qwen3-MoE).

A token's forward cost counts only the experts it is routed to (k of E) and the router; memory counts them
all. The experts are not split over tensor-parallel ranks; the compiled decode step does not compute them
(a stage of this kind decodes on the NumPy path).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hpcpipe.errors import ConfigError
from hpcpipe.nn.core.decoder_model import INIT_STD
from hpcpipe.nn.core.moe import SparseMoE
from hpcpipe.nn.core.router_ledger import RouterLedger
from hpcpipe.nn.llama.model import LlamaModel, llama_shape
from hpcpipe.nn.moe.shape import MoEShape, group_params


def moe_shape(model: Any) -> MoEShape:
    """Return the MoEShape a config's [model] keys describe."""
    llama = llama_shape(model)
    fields = {f.name: getattr(llama, f.name) for f in dataclasses.fields(llama)}
    return MoEShape(**fields, n_experts=model.n_experts, experts_per_token=model.experts_per_token,
                    moe_d_ff=model.moe_d_ff, norm_topk_prob=model.norm_topk_prob,
                    moe_layers=tuple(model.moe_layers), router_aux_loss_coef=model.router_aux_loss_coef)


class MoEModel(LlamaModel):
    """A llama-family decoder whose sparse blocks route each token to ``experts_per_token`` of ``n_experts``."""

    kind = "moe"
    shape: MoEShape
    ledger: RouterLedger | None = None     # training's load-balancing statistics (router_ledger)

    @classmethod
    def from_config(cls, config: Any) -> MoEModel:
        """The model a Config's [model] keys describe."""
        try:
            return cls(moe_shape(config.model))
        except ValueError as exc:
            raise ConfigError(f"model: {exc}") from None

    def group_params(self, index):
        return group_params(self.shape, index)

    def group_cost(self, index):
        """As the llama kind's, a sparse block's MLP counting the router and the k experts a token uses."""
        shape = self.shape
        cost = super().group_cost(index)
        if not shape.sparse(index):
            return cost
        d = shape.d_model
        return cost - 3 * d * shape.ff + d * shape.n_experts + shape.experts_per_token * 3 * d * shape.expert_ff

    def group_activations(self, index):
        """A sparse block keeps, instead of the dense MLP's 4 ff a token: its input and the router's
        probabilities (d + E), the choices and their weights (2 k), and for each of the k experts a token
        uses its rows, up, sigmoid, silu and product and the expert's output (2 d + 4 ff)."""
        shape = self.shape
        total = super().group_activations(index)
        if not shape.sparse(index):
            return total
        k, t = shape.experts_per_token, shape.seq_len
        moe = shape.d_model + shape.n_experts + 2 * k + k * (2 * shape.d_model + 4 * shape.expert_ff)
        return total + t * (moe - 4 * shape.ff)

    def init_value(self, name, dims, rng):
        """The llama kind's values; experts as its MLP (down scaled as a residual projection), the router 0.02."""
        if name == "mlp/experts/down":
            return rng.standard_normal(dims) * self.residual_std()
        if name.startswith("mlp/experts/") or name == "mlp/router/weight":
            return rng.standard_normal(dims) * INIT_STD
        return super().init_value(name, dims, rng)

    def mlp(self, params, grads, xp, tp, index):
        if not self.shape.sparse(index):
            return super().mlp(params, grads, xp, tp, index)
        return SparseMoE(params, grads, self.shape.experts_per_token, self.shape.norm_topk_prob, xp,
                         ledger=self.ledger, layer=index)

    def router_ledger(self, n_micro, chunk_tokens):
        """With model.router_aux_loss_coef > 0: the ledger the sparse layers built after this call record into."""
        coef = self.shape.router_aux_loss_coef
        self.ledger = RouterLedger(self.shape.n_experts, coef, n_micro, chunk_tokens) if coef > 0 else None
        return self.ledger

    def fusable(self):
        return False

    def shards(self, index, tp, rank):
        names = {name for name, _ in self.group_params(index)}
        return {name: shard for name, shard in super().shards(index, tp, rank).items() if name in names}
