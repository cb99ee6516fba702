"""The moe kind's shape: a llama-family decoder whose MLPs are (on the blocks ``moe_layers`` names) sparse mixtures
of SwiGLU experts behind a softmax router (Mixtral; Qwen3-MoE with q/k norms and dense blocks between).

A sparse block's MLP parameters are ``mlp/router/weight`` (d, E) and ``mlp/experts/{gate,up}`` (E, d, moe_ff),
``mlp/experts/down`` (E, moe_ff, d): every expert of the block in one (E, ...) array, by expert index. A dense
block keeps the llama kind's ``mlp/{gate,up,down}/weight``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hpcpipe.nn.core.decoder_model import positive_int
from hpcpipe.nn.llama.shape import LlamaShape
from hpcpipe.nn.llama.shape import block_params as llama_block_params
from hpcpipe.nn.llama.shape import group_params as llama_group_params


@dataclass(frozen=True)
class MoEShape(LlamaShape):
    """A llama-family shape with experts: ``n_experts`` of width ``moe_d_ff`` (0: d_ff), ``experts_per_token``."""

    n_experts: int = 8
    experts_per_token: int = 2
    moe_d_ff: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[int, ...] = ()        # blocks (0-based) with experts; () = every block
    router_aux_loss_coef: float = 0.0

    label: ClassVar[str] = "moe"

    def __post_init__(self):
        super().__post_init__()
        positive_int(self.label, "n_experts", self.n_experts)
        positive_int(self.label, "experts_per_token", self.experts_per_token)
        positive_int(self.label, "moe_d_ff", self.moe_d_ff, "d_ff")
        if self.experts_per_token > self.n_experts:
            raise ValueError(f"moe experts_per_token {self.experts_per_token} exceeds n_experts {self.n_experts}")
        layers = tuple(int(i) for i in self.moe_layers)
        if any(not 0 <= i < self.n_blocks for i in layers) or len(set(layers)) != len(layers):
            raise ValueError(f"moe moe_layers {list(layers)} must be distinct blocks of 0..{self.n_blocks - 1}")
        object.__setattr__(self, "moe_layers", layers)
        object.__setattr__(self, "norm_topk_prob", bool(self.norm_topk_prob))
        object.__setattr__(self, "router_aux_loss_coef", float(self.router_aux_loss_coef))

    @property
    def expert_ff(self) -> int:
        """Hidden width of one expert."""
        return self.moe_d_ff or self.ff

    def sparse(self, index: int) -> bool:
        """Whether layer group ``index`` (block index - 1) has experts."""
        return 1 <= index <= self.n_blocks and (not self.moe_layers or index - 1 in self.moe_layers)


def group_params(shape: MoEShape, index: int) -> list[tuple[str, tuple[int, ...]]]:
    """Return the (name, shape) of every parameter of layer group ``index``, in storage order."""
    params = llama_group_params(shape, index)
    if not shape.sparse(index):
        return params
    d, e, ff = shape.d_model, shape.n_experts, shape.expert_ff
    attention = [p for p in llama_block_params(shape) if not p[0].startswith("mlp/")]
    return attention + [("mlp/router/weight", (d, e)), ("mlp/experts/gate", (e, d, ff)),
                        ("mlp/experts/up", (e, d, ff)), ("mlp/experts/down", (e, ff, d))]
