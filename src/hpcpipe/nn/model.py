"""Model: Config.model -> global layer list -> contiguous stages -> this rank's parameters.

Initial weights depend only on (model.seed, global layer index), never on the
layout, so every (dp, pp, schedule) builds the identical model. All of a
rank's parameters live in one flat buffer (and gradients in another) so that
the data-parallel average and the optimizer are one call each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hpcpipe.config import Config
from hpcpipe.errors import ConfigError
from hpcpipe.nn.layers import Dense, make_activation


@dataclass(frozen=True)
class LayerSpec:
    """Shape and activation of one global layer."""

    index: int
    fan_in: int
    fan_out: int
    bias: bool
    activation: str

    @property
    def n_params(self) -> int:
        """Number of scalars in weight and bias."""
        return self.fan_in * self.fan_out + (self.fan_out if self.bias else 0)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Parameter names and shapes as stored below /layers/NNNN/ ('bias' only when the model has biases)."""
        shapes: dict[str, tuple[int, ...]] = {"weight": (self.fan_in, self.fan_out)}
        if self.bias:
            shapes["bias"] = (self.fan_out,)
        return shapes


def layer_specs(config: Config) -> list[LayerSpec]:
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


def partition(specs: list[LayerSpec], n_stages: int, explicit: list[int] | tuple[int, ...] = ()) -> list[range]:
    """Split layers into n_stages contiguous ranges, minimising the largest stage's FLOPs.

    ``explicit`` (layers per stage) overrides the balancing.
    """
    n = len(specs)
    if not 1 <= n_stages <= n:
        raise ConfigError(f"cannot cut {n} layers into {n_stages} stages (need 1 <= stages <= layers)")
    if explicit:
        if len(explicit) != n_stages or sum(explicit) != n or min(explicit) < 1:
            raise ConfigError(f"stage layer counts {list(explicit)} do not split {n} layers into {n_stages} stages")
        counts = list(explicit)
    else:
        cost = [s.fan_in * s.fan_out for s in specs]
        prefix = [0]
        for c in cost:
            prefix.append(prefix[-1] + c)
        # best[k][i]: smallest achievable max-stage cost for the first i layers in k stages
        inf = float("inf")
        best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
        cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
        best[0][0] = 0
        for k in range(1, n_stages + 1):
            for i in range(k, n - (n_stages - k) + 1):
                for j in range(k - 1, i):
                    value = max(best[k - 1][j], prefix[i] - prefix[j])
                    if value < best[k][i]:
                        best[k][i], cut[k][i] = value, j
        counts, i = [], n
        for k in range(n_stages, 0, -1):
            j = cut[k][i]
            counts.append(i - j)
            i = j
        counts.reverse()
    ranges, start = [], 0
    for c in counts:
        ranges.append(range(start, start + c))
        start += c
    return ranges


class StageModule:
    """The layers of one (virtual) stage: forward/backward over a micro-batch."""

    def __init__(self, stage: int, layers: list[Dense]):
        self.stage = stage
        self.layers = layers

    def forward(self, x: Any) -> tuple[Any, list]:
        """Return (output, per-layer caches)."""
        caches = []
        for layer in self.layers:
            x, cache = layer.forward(x)
            caches.append(cache)
        return x, caches

    def backward_input(self, caches: list, g: Any, need_input_grad: bool = True) -> tuple[Any, list]:
        """Propagate dL/dy to dL/dx; return it with the per-layer dL/dz for backward_weight."""
        dzs: list = [None] * len(self.layers)
        for i in range(len(self.layers) - 1, -1, -1):
            need = need_input_grad or i > 0
            g, dzs[i] = self.layers[i].backward_input(caches[i], g, need)
        return g, dzs

    def backward_weight(self, caches: list, dzs: list) -> None:
        """Accumulate every layer's weight and bias gradients."""
        for layer, cache, dz in zip(self.layers, caches, dzs, strict=True):
            layer.backward_weight(cache, dz)

    def backward(self, caches: list, g: Any, need_input_grad: bool = True) -> Any:
        """Full backward of the stage: accumulate parameter gradients, return dL/dx."""
        for i in range(len(self.layers) - 1, -1, -1):
            g = self.layers[i].backward(caches[i], g, need_input_grad or i > 0)
        return g


class RankParameters:
    """Flat parameter/gradient buffers of all stages one pipeline rank owns, with per-layer views."""

    def __init__(self, specs: list[LayerSpec], stage_ranges: dict[int, range], xp: Any, dtype: str):
        self.xp = xp
        self.specs = {i: specs[i] for r in stage_ranges.values() for i in r}
        total = sum(s.n_params for s in self.specs.values())
        self.flat = xp.zeros(total, dtype=dtype)
        self.grad = xp.zeros(total, dtype=dtype)
        self.views: dict[int, dict[str, tuple[int, tuple[int, ...]]]] = {}
        offset = 0
        for i in sorted(self.specs):
            s = self.specs[i]
            entry = {"weight": (offset, (s.fan_in, s.fan_out))}
            offset += s.fan_in * s.fan_out
            if s.bias:
                entry["bias"] = (offset, (s.fan_out,))
                offset += s.fan_out
            self.views[i] = entry
        self.stages = {stage: StageModule(stage, [self._dense(i) for i in r]) for stage, r in stage_ranges.items()}

    def _view(self, buf: Any, index: int, name: str) -> Any:
        offset, shape = self.views[index][name]
        size = int(np.prod(shape))
        return buf[offset:offset + size].reshape(shape)

    def slice_of(self, buf: Any, index: int, name: str) -> Any:
        """Return the view of a layer's 'weight' or 'bias' inside any flat buffer laid out like the parameters."""
        return self._view(buf, index, name)

    def host(self, array: Any) -> np.ndarray:
        """Return a host (NumPy) copy of a buffer or view of this rank's backend."""
        return array.get() if hasattr(array, "get") else np.array(array)

    def param(self, index: int, name: str) -> Any:
        """Return the live view of a parameter ('weight' or 'bias') of a global layer."""
        return self._view(self.flat, index, name)

    def grad_of(self, index: int, name: str) -> Any:
        """Return the live view of a parameter's gradient."""
        return self._view(self.grad, index, name)

    def _dense(self, index: int) -> Dense:
        s = self.specs[index]
        bias = s.bias
        return Dense(index, self.param(index, "weight"), self.param(index, "bias") if bias else None,
                     self.grad_of(index, "weight"), self.grad_of(index, "bias") if bias else None,
                     make_activation(s.activation), self.xp)

    def layer_indices(self) -> list[int]:
        """Global indices of the layers this rank owns, ascending."""
        return sorted(self.specs)

    def load(self, arrays: dict[int, dict[str, np.ndarray]]) -> None:
        """Copy host arrays {layer: {'weight', 'bias'}} into the parameter buffer."""
        for i in self.layer_indices():
            for name in self.views[i]:
                self.param(i, name)[...] = self.xp.asarray(arrays[i][name])

    def export(self) -> dict[int, dict[str, np.ndarray]]:
        """Return host copies of this rank's parameters by global layer index."""
        to_host = (lambda a: a.get()) if hasattr(self.flat, "get") else (lambda a: np.array(a))
        return {i: {name: to_host(self.param(i, name)) for name in self.views[i]} for i in self.layer_indices()}

    def export_grads(self) -> dict[int, dict[str, np.ndarray]]:
        """Return host copies of this rank's gradients by global layer index."""
        to_host = (lambda a: a.get()) if hasattr(self.grad, "get") else (lambda a: np.array(a))
        return {i: {name: to_host(self.grad_of(i, name)) for name in self.views[i]} for i in self.layer_indices()}


def initial_arrays(specs: list[LayerSpec], indices: list[int], seed: int,
                   dtype: str) -> dict[int, dict[str, np.ndarray]]:
    """Return the deterministic initial weights of the given global layers."""
    out = {}
    for i in indices:
        w, b = init_layer(specs[i], seed, dtype)
        out[i] = {"weight": w} if b is None else {"weight": w, "bias": b}
    return out
