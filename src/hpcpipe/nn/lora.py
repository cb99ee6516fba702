"""LoRA (Hu et al. 2021) as PEFT computes it: low-rank adapters beside a frozen model's linear maps.

A targeted map ``y = act(x @ W + b)`` (W (in, out), as hpcpipe stores it) gains A (in, r) and B (r, out)::

    y = act(x @ W + b + s (x @ A) @ B),    s = lora_alpha / r   (lora_alpha / sqrt(r) with rsLoRA)

backward, with dz = dL/d(pre-activation):  du = s dz @ B.T,  dx = dz @ W.T + du @ A.T,
dA = x.T @ du,  dB = s (x @ A).T @ dz. W and b, and every other parameter of the model, are frozen (no
gradient, no optimizer state: their spec's ``frozen``, :class:`hpcpipe.nn.rank_parameters.RankParameters`).
The adapters are ``prefix/lora_a`` and ``prefix/lora_b`` beside ``prefix/weight`` in the block's layer group
(HDF5 ``/layers/NNNN/attn/q/lora_a``); a target is named as PEFT's ``target_modules`` (``q_proj``, ``c_attn``),
read off the kind's Hugging Face map, whose names give the PEFT tensors too
(``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` = A.T). Initial values are PEFT's:
A uniform in +-1/sqrt(in) (kaiming_uniform_, a = sqrt(5)) from (model.seed, group, stream 1), B zero.

Tensor parallelism: A and B follow the base map's split. A column-parallel W (columns cut) keeps all of A
and B's columns; a row-parallel W (rows cut) keeps A's rows and all of B. The whole factor's gradient is
then a partial sum on each rank: it is held as a part ``shared`` by every tp rank, so the gradient sum of
shared parts (``reduce_shared``) adds it up once per step, and no collective is added per micro-batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import numpy as np

from hpcpipe.errors import ConfigError
from hpcpipe.nn.core.activations import Activation
from hpcpipe.nn.core.dense import ADAPTER, Dense
from hpcpipe.nn.core.sharding import REPLICATED, Shard
from hpcpipe.nn.model_def import ModelDef
from hpcpipe.nn.protocol import Layer


@dataclass(frozen=True)
class LoraSettings:
    """Rank, alpha and target modules of the adapters (PEFT's LoraConfig r, lora_alpha, target_modules)."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    rslora: bool = False

    @property
    def scaling(self) -> float:
        """The factor of the adapters' output: alpha / r (alpha / sqrt(r) with rsLoRA)."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


def no_lora(hf: Any, kind: str) -> str:
    """Why a kind takes no LoRA adapters, truly: none of its maps are a block's (mlp), or not supported yet (moe)."""
    if hf is None:
        return (f"model.kind = \"{kind}\" has no modules LoRA can target (LoRA adapts the linear maps of a GPT's or "
                f"a Llama-family model's blocks)")
    return (f"LoRA is not supported for model.kind = \"{kind}\" yet (hpcpipe's LoRA adapts the blocks of model.kind "
            f"\"gpt\" and \"llama\")")


def block_maps(hf: Any, keys: dict[str, Any], kind: str) -> dict[str, list[str]]:
    """{PEFT module name: [hpcpipe prefixes]} of the linear maps of a kind's block (``q_proj``: [``attn/q``])."""
    if hf is None or not hf.lora_targets:
        raise ConfigError(f"train.lora_rank: {no_lora(hf, kind)}")
    out: dict[str, list[str]] = {}
    for piece in hf.pieces(keys, 1):
        if piece.name.endswith("/weight") and len(piece.shape) == 2:
            out.setdefault(piece.hf.split(".")[-2], []).append(piece.name.removesuffix("/weight"))
    return out


def settings_of(train: Any, hf: Any, keys: dict[str, Any], kind: str) -> LoraSettings | None:
    """The adapters a [train] section asks for (None without train.lora_rank); ConfigError naming a bad target."""
    if not train.lora_rank:
        return None
    maps = block_maps(hf, keys, kind)
    targets = tuple(train.lora_targets) or hf.lora_targets
    unknown = [t for t in targets if t not in maps]
    if unknown:
        raise ConfigError(f"train.lora_targets: {unknown[0]!r} is not a module of model.kind = \"{kind}\" (its "
                          f"modules: {', '.join(maps)})")
    return LoraSettings(train.lora_rank, train.lora_alpha, targets)


def peft_names(hf: Any, keys: dict[str, Any], index: int, targets: tuple[str, ...]) -> dict[str, str]:
    """{hpcpipe adapter name: PEFT tensor name} of layer group ``index`` (A and B are stored transposed there)."""
    out = {}
    for piece in hf.pieces(keys, index) if 1 <= index <= keys["n_blocks"] else ():
        module = piece.hf.split(".")[-2]
        if piece.name.endswith("/weight") and len(piece.shape) == 2 and module in targets:
            stem = f"base_model.model.{hf.prefix}{piece.hf.removesuffix('.weight')}"
            prefix = piece.name.removesuffix("/weight")
            out[f"{prefix}/lora_a"], out[f"{prefix}/lora_b"] = f"{stem}.lora_A.weight", f"{stem}.lora_B.weight"
    return out


class LoraDense(Dense):
    """A frozen map ``act(x @ W + b)`` with trained adapters: ``act(x @ W + b + s (x @ A) @ B)``."""

    def __init__(self, base: Dense, a: Any, b: Any, grad_a: Any, grad_b: Any, scaling: float):
        super().__init__(base.index, base.weight, base.bias, None, None, base.activation, base.xp, base.reduce_out,
                         base.reduce_input_grad)
        self.a, self.b, self.grad_a, self.grad_b, self.scaling = a, b, grad_a, grad_b, scaling

    def _pre(self, x: Any) -> tuple[Any, Any]:
        u = x @ self.a
        z = x @ self.weight
        z += (u @ self.b) * self.scaling                 # PEFT's order: lora_B(lora_A(x)) * scaling
        if self.reduce_out is not None:                  # row-parallel: the partial products summed once
            self.reduce_out.sum_(z)
        if self.bias is not None:
            z += self.bias
        return z, u

    def forward(self, x: Any) -> tuple[Any, tuple[Any, Any, Any]]:
        """Return (output, cache = (x, what the activation saved, x @ A))."""
        z, u = self._pre(x)
        y, saved = self.activation.forward(self.xp, z)
        return y, (x, saved, u)

    def forward_cache(self, x: Any) -> tuple[Any, Any, Any]:
        """Return only the cache of forward(x): without an activation the output is not computed."""
        if type(self.activation) is Activation:       # a row-parallel output's sum is skipped too, on every rank
            return x, None, x @ self.a
        return self.forward(x)[1]

    def backward_input(self, cache: tuple[Any, Any, Any], g: Any, need_input_grad: bool = True) -> tuple[Any, Any]:
        """Return (dL/dx or None, (dL/dz, dL/du))."""
        dz = self.activation.backward(self.xp, cache[1], g)
        du = (dz @ self.b.T) * self.scaling
        gx = None
        if need_input_grad:
            gx = dz @ self.weight.T
            gx += du @ self.a.T
            if self.reduce_input_grad is not None:
                self.reduce_input_grad.sum_(gx)
        return gx, (dz, du)

    def backward_weight(self, cache: tuple[Any, Any, Any], state: tuple[Any, Any]) -> None:
        """Accumulate the adapters' gradients (the base map is frozen)."""
        x, _, u = cache
        dz, du = state
        self.grad_a += x.T @ du
        self.grad_b += (u.T @ dz) * self.scaling


class Frozen:
    """A layer group without a trained parameter (a LoRA model's embedding and head): no weight gradients."""

    def __init__(self, layer: Layer):
        self.layer = layer

    def forward(self, x: Any) -> tuple[Any, Any]:
        """The layer's forward."""
        return self.layer.forward(x)

    def forward_cache(self, x: Any) -> Any:
        """The layer's cache."""
        return self.layer.forward_cache(x)

    def backward_input(self, cache: Any, g: Any, need_input_grad: bool = True) -> tuple[Any, Any]:
        """The layer's input gradient."""
        return self.layer.backward_input(cache, g, need_input_grad)

    def backward_weight(self, cache: Any, state: Any) -> None:
        """Nothing: every parameter is frozen."""

    def backward(self, cache: Any, g: Any, need_input_grad: bool = True) -> Any:
        """The input gradient only."""
        return self.layer.backward_input(cache, g, need_input_grad)[0]


class LoraModel(ModelDef):
    """A decoder kind's model with adapters on its blocks' targeted maps; every base parameter frozen.

    Specs gain ``prefix/lora_a`` (in, r) and ``prefix/lora_b`` (r, out) in every block group and mark the
    base's parameters ``frozen``; everything else is the base model's.
    """

    def __init__(self, base: ModelDef, settings: LoraSettings, maps: dict[str, list[str]]):
        self.base, self.settings = base, settings
        self.kind, self.tied, self.loss_fn = base.kind, base.tied, base.loss_fn
        self.n_blocks = base.shape.n_blocks
        self.prefixes = [prefix for module in settings.targets for prefix in maps[module]]
        r = settings.rank
        self.specs = []
        for spec in base.specs:
            shapes = dict(spec.shapes)
            if self.adapted(spec.index):
                for prefix in self.prefixes:
                    n_in, n_out = spec.shapes[f"{prefix}/weight"]
                    shapes.update({f"{prefix}/lora_a": (n_in, r), f"{prefix}/lora_b": (r, n_out)})
            self.specs.append(replace(spec, shapes=shapes, frozen=frozenset(spec.shapes)))

    def __getattr__(self, name: str) -> Any:
        # what a decoder model offers beyond the engine's ModelDef (shape, group_params, ...): the base's
        return getattr(self.base, name)

    def adapted(self, index: int) -> bool:
        """Whether layer group ``index`` is a block (it carries adapters)."""
        return 1 <= index <= self.n_blocks

    def init_arrays(self, indices, seed, dtype):
        out = self.base.init_arrays(indices, seed, dtype)
        for i, adapters in self.adapter_arrays(indices, seed, dtype).items():
            out[i].update(adapters)
        return out

    def adapter_arrays(self, indices: list[int], seed: int, dtype: str) -> dict[int, dict[str, np.ndarray]]:
        """Fresh adapters of the given groups, as PEFT starts them: A uniform in +-1/sqrt(in), B zero."""
        out: dict[int, dict[str, np.ndarray]] = {}
        for i in indices:
            if self.adapted(i):
                rng = np.random.default_rng([seed, i, 1])    # its own stream: the base's values do not move
                out[i] = {}
                for prefix in self.prefixes:
                    n_in, n_out = self.base.specs[i].shapes[f"{prefix}/weight"]
                    bound = 1.0 / math.sqrt(n_in)
                    out[i][f"{prefix}/lora_a"] = rng.uniform(-bound, bound, (n_in, self.settings.rank)).astype(dtype)
                    out[i][f"{prefix}/lora_b"] = np.zeros((self.settings.rank, n_out), dtype=dtype)
        return out

    def build_layer(self, index, params, grads, xp, tok_emb=None, grad_tok_emb=None, tp=None, ep=None):
        if not self.adapted(index):
            return Frozen(self.base.build_layer(index, params, grads, xp, tok_emb, grad_tok_emb, tp, ep))
        wrap = partial(self._wrap, params, grads)
        return self.base.build_layer(index, {**params, ADAPTER: wrap}, grads, xp, tok_emb, grad_tok_emb, tp, ep)

    def _wrap(self, params: dict[str, Any], grads: dict[str, Any], dense: Dense, prefix: str) -> LoraDense:
        a, b = f"{prefix}/lora_a", f"{prefix}/lora_b"
        return LoraDense(dense, params[a], params[b], grads[a], grads[b], self.settings.scaling)

    def shards(self, index, tp, rank):
        out = self.base.shards(index, tp, rank)
        everyone = tuple(range(tp))     # a factor every rank holds whole, its gradient a partial sum on each
        for prefix in self.prefixes if self.adapted(index) else ():
            w = out[f"{prefix}/weight"]
            if w.axis is None:
                a = b = Shard(REPLICATED)
            elif w.axis == 1:           # column-parallel: B's columns, all of A
                a, b = Shard(0, slice(None), everyone), Shard(1, w.index, w.shared)
            else:                       # row-parallel: A's rows, all of B
                a, b = Shard(0, w.index, w.shared), Shard(0, slice(None), everyone)
            out.update({f"{prefix}/lora_a": a, f"{prefix}/lora_b": b})
        return out

    def boundary(self, index, batch, tp=1, rank=0):
        return self.base.boundary(index, batch, tp, rank)

    def boundary_shared(self, index):
        return self.base.boundary_shared(index)

    def tp_loss(self, tp):
        return self.base.tp_loss(tp)

    def samples_norm(self, n_samples):
        return self.base.samples_norm(n_samples)


def base_specs(specs: list[Any]) -> list[Any]:
    """The specs of the model without its adapters (what a weights file or Hugging Face model to start from holds)."""
    return [replace(spec, shapes={name: shape for name, shape in spec.shapes.items()
                                  if not name.endswith(("/lora_a", "/lora_b"))}, frozen=frozenset())
            if getattr(spec, "frozen", None) else spec for spec in specs]


def with_adapters(model: ModelDef, hf: Any, config: Any) -> ModelDef:
    """The model with train.lora_* adapters (itself without train.lora_rank); ConfigError for a bad target."""
    keys = config.to_dict()["model"]
    settings = settings_of(config.train, hf, keys, config.model.kind)
    if settings is None:
        return model
    return LoraModel(model, settings, block_maps(hf, keys, config.model.kind))
