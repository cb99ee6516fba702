"""A pipeline rank's share of a model: its stages' layers, and their parameters in one flat buffer.

All of a rank's parameters live in one flat buffer (and gradients in another) so that the
data-parallel average and the optimizer are one call each; each layer gets views of its own.
Initial weights depend only on (model.seed, global layer index), never on the layout, so every
(dp, pp, tp, schedule) builds the identical model.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hpcpipe.nn.core.sharding import assemble
from hpcpipe.nn.protocol import Layer


class StageModule:
    """The layers of one (virtual) stage: forward/backward over a micro-batch."""

    def __init__(self, stage: int, layers: list[Layer]):
        self.stage = stage
        self.layers = layers

    def forward(self, x: Any) -> tuple[Any, list]:
        """Return (output, per-layer caches)."""
        caches = []
        for layer in self.layers:
            x, cache = layer.forward(x)
            caches.append(cache)
        return x, caches

    def forward_caches(self, x: Any) -> list:
        """Return the per-layer caches of forward(x) without the stage's output (recomputation before a backward).

        The last layer builds only its cache (``forward_cache``): its output, which
        the backward never reads, is the stage's most expensive product to skip.
        """
        caches = []
        for layer in self.layers[:-1]:
            x, cache = layer.forward(x)
            caches.append(cache)
        last = self.layers[-1]
        caches.append(last.forward_cache(x))
        return caches

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


TIED = -1   # views key of a tok_emb copy held by the last stage when the first stage lives on another rank


def frozen_names(model: Any, index: int) -> frozenset[str]:
    """The parameters of group ``index`` (TIED: the embedding's) that do not train (LoRA's base)."""
    return getattr(model.specs[0 if index == TIED else index], "frozen", frozenset())


class RankParameters:
    """Flat parameter/gradient buffers of all stages one pipeline rank owns, with per-parameter views.

    ``model`` is an hpcpipe.nn.model_def.ModelDef. A tied GPT head on a rank without the
    embedding reads its own copy of tok_emb (views key ``TIED``): it is in the flat
    buffers, so the optimizer updates it exactly as the embedding's, and the engine
    sums its gradient with the first stage's every step; it is never saved.

    With tensor parallelism (``tp``: the stage's group), the buffers hold this rank's part of each
    parameter (``model.shards``); ``load`` takes whole tensors or parts, ``export`` returns the parts.
    """

    def __init__(self, model: Any, stage_ranges: dict[int, range], xp: Any, dtype: str, tp: Any = None):
        self.xp = xp
        self.model = model
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.specs = {i: model.specs[i] for r in stage_ranges.values() for i in r}
        last = model.n_layers - 1
        self.tied_copy = bool(model.tied) and last in self.specs and 0 not in self.specs
        held = sorted(set(self.specs) | ({0} if self.tied_copy else set()))
        self.shards = {i: model.shards(i, self.tp.size, self.tp.rank) for i in held} if self.tp else {}
        layout: list[tuple[int, str, tuple[int, ...]]] = [
            (i, name, self.local_shape(i, name)) for i in sorted(self.specs) for name in self.specs[i].shapes]
        if self.tied_copy:
            layout.append((TIED, "tok_emb", self.local_shape(0, "tok_emb")))
        # a frozen parameter (its spec's ``frozen``: LoRA's base) lives in its own buffer, with no gradient and no
        # optimizer state; flat and grad hold the trained ones only
        frozen = [(i, name, shape) for i, name, shape in layout if name in frozen_names(model, i)]
        trained = [entry for entry in layout if entry not in frozen]
        self.flat, self.views = self._buffer(trained, dtype, sorted(self.specs))
        self.grad = xp.zeros(self.flat.size, dtype=dtype)
        self.frozen, self.frozen_views = self._buffer(frozen, dtype)
        tok = grad_tok = None
        self.tied_trains = bool(model.tied) and "tok_emb" not in frozen_names(model, 0)
        if model.tied and last in self.specs:
            owner = TIED if self.tied_copy else 0
            tok = self.param(owner, "tok_emb")
            grad_tok = self.grad_of(owner, "tok_emb") if self.tied_trains else None
        self.stages = {stage: StageModule(stage, [model.build_layer(i, self._params_group(i), self._grads_group(i), xp,
                                                                    tok, grad_tok, tp=self.tp) for i in r])
                       for stage, r in stage_ranges.items()}

    def _buffer(self, layout: list[tuple[int, str, tuple[int, ...]]], dtype: str,
                groups: list[int] = ()) -> tuple[Any, dict]:
        """One zeroed flat buffer for the layout's parameters, and their views {index: {name: (offset, shape)}}
        (an entry, maybe empty, for each of ``groups``)."""
        views: dict[int, dict[str, tuple[int, tuple[int, ...]]]] = {i: {} for i in groups}
        offset = 0
        for i, name, shape in layout:
            views.setdefault(i, {})[name] = (offset, shape)
            offset += int(np.prod(shape))
        return self.xp.zeros(offset, dtype=dtype), views

    def local_shape(self, index: int, name: str) -> tuple[int, ...]:
        """The shape of this rank's part of parameter ``name`` of group ``index`` (the whole at tp = 1)."""
        full = tuple(self.model.specs[index].shapes[name])
        return self.shards[index][name].shape(full) if self.tp else full

    def _part(self, index: int, name: str, array: Any) -> Any:
        """This rank's part of an array that is either the whole tensor or already the part."""
        if not self.tp or tuple(array.shape) == self.local_shape(index, name):
            return array
        return self.shards[index][name].take(array)

    def norm_sq(self) -> float:
        """Squared norm of the gradient as one term of a sum over the tp ranks: every parameter counted once.

        A tied head's copy of tok_emb is not counted (the embedding's gradient is the same sum); a
        replicated parameter counts on tp rank 0, a shared part on the first rank holding it.
        """
        if not self.tp:
            return float(self.xp.vdot(self.grad, self.grad)) - self.copy_norm_sq()
        counted = [(i, name) for i in self.layer_indices() for name in self.views[i]
                   if self.shards[i][name].counts_on(self.tp.rank)]     # trained parameters only
        terms = [self.xp.vdot(self.grad_of(i, name), self.grad_of(i, name)) for i, name in counted]
        if not terms:
            return 0.0
        # one copy to the host for all the terms (a float() per parameter would wait for the GPU each time),
        # then the same float64 additions in the same order as before
        return sum(self.xp.stack(terms).astype("float64").tolist())

    def reduce_shared(self) -> None:
        """Sum the gradients of parameter parts several tp ranks hold (a llama's key/value heads when tp >
        n_kv_heads; a replicated parameter each rank's heads add to, Qwen3's q/k norms), so that each holder
        updates with the whole gradient."""
        for i in self.layer_indices() if self.tp else ():
            for name, shard in self.shards[i].items():
                if not shard.shared or name not in self.views[i]:      # a frozen parameter has no gradient
                    continue
                if shard.axis is None:
                    self.tp.sum_(self.grad_of(i, name))
                else:
                    full = self.xp.zeros(tuple(self.model.specs[i].shapes[name]), dtype=self.grad.dtype)
                    key = [slice(None)] * full.ndim
                    key[shard.axis] = shard.index
                    full[tuple(key)] = self.grad_of(i, name)
                    self.tp.sum_(full)
                    self.grad_of(i, name)[...] = full[tuple(key)]

    def _params_group(self, index: int) -> dict[str, Any]:
        """Views of every parameter of a group, trained or frozen."""
        frozen = {name: self._view(self.frozen, index, name, self.frozen_views)
                  for name in self.frozen_views.get(index, {})}
        return {**{name: self._view(self.flat, index, name) for name in self.views.get(index, {})}, **frozen}

    def _grads_group(self, index: int) -> dict[str, Any]:
        """Gradient views of a group's parameters; None for a frozen one (its layer accumulates nothing)."""
        frozen = dict.fromkeys(self.frozen_views.get(index, {}))
        return {**{name: self._view(self.grad, index, name) for name in self.views.get(index, {})}, **frozen}

    def _view(self, buf: Any, index: int, name: str, views: dict | None = None) -> Any:
        offset, shape = (self.views if views is None else views)[index][name]
        size = int(np.prod(shape))
        return buf[offset:offset + size].reshape(shape)

    def slice_of(self, buf: Any, index: int, name: str) -> Any:
        """Return the view of a layer's parameter ``name`` inside any flat buffer laid out like the parameters."""
        return self._view(buf, index, name)

    def host(self, array: Any) -> np.ndarray:
        """Return a host (NumPy) copy of a buffer or view of this rank's backend."""
        return array.get() if hasattr(array, "get") else np.array(array)

    def param(self, index: int, name: str) -> Any:
        """Return the live view of a parameter of a global layer (trained or frozen)."""
        if name in self.views.get(index, {}):
            return self._view(self.flat, index, name)
        return self._view(self.frozen, index, name, self.frozen_views)

    def names(self, index: int) -> list[str]:
        """Every parameter name of a group this rank holds: the trained ones, then the frozen ones."""
        return [*self.views.get(index, {}), *self.frozen_views.get(index, {})]

    def grad_of(self, index: int, name: str) -> Any:
        """Return the live view of a parameter's gradient."""
        return self._view(self.grad, index, name)

    def tied_grad(self) -> Any:
        """Return the gradient view of the tied tok_emb this rank holds for the head (its copy, or the embedding's)."""
        return self.grad_of(TIED if self.tied_copy else 0, "tok_emb")

    def copy_norm_sq(self) -> float:
        """Squared norm of the tied copy's gradient (0 without one): the global norm counts the table once."""
        if not self.tied_copy or not self.tied_trains:
            return 0.0
        g = self.grad_of(TIED, "tok_emb")
        return float(self.xp.vdot(g, g))

    def layer_indices(self) -> list[int]:
        """Global indices of the layers this rank owns, ascending."""
        return sorted(self.specs)

    def read_indices(self) -> list[int]:
        """Layers whose stored values this rank needs: its own, and group 0 for a tied copy."""
        return sorted(set(self.specs) | ({0} if self.tied_copy else set()))

    def load(self, arrays: dict[int, dict[str, np.ndarray]]) -> None:
        """Copy host arrays {layer: {name: array}} into the parameter buffers (and the tied copy from group 0)."""
        for i in self.layer_indices():
            for name in self.names(i):
                self.param(i, name)[...] = self.xp.asarray(self._part(i, name, arrays[i][name]))
        if self.tied_copy:
            self.param(TIED, "tok_emb")[...] = self.xp.asarray(self._part(0, "tok_emb", arrays[0]["tok_emb"]))

    def load_state(self, buf: Any, arrays: dict[int, dict[str, np.ndarray]]) -> None:
        """Copy per-layer host arrays into a buffer laid out like the parameters (optimizer state)."""
        for i in self.layer_indices():
            for name in self.views[i]:
                self.slice_of(buf, i, name)[...] = self.xp.asarray(self._part(i, name, arrays[i][name]))
        if self.tied_copy and TIED in self.views:
            self.slice_of(buf, TIED, "tok_emb")[...] = self.xp.asarray(self._part(0, "tok_emb", arrays[0]["tok_emb"]))

    def export(self) -> dict[int, dict[str, np.ndarray]]:
        """Return host copies of this rank's parameters (trained and frozen) by global layer index."""
        return {i: {name: self.host(self.param(i, name)) for name in self.names(i)} for i in self.layer_indices()}

    def whole(self, local: dict[int, dict[str, np.ndarray]]) -> dict[int, dict[str, np.ndarray]] | None:
        """Whole tensors from this stage's tp ranks' parts of ``local`` (export-shaped) on tp rank 0, None on the
        others (collective over the tp ranks); ``local`` itself without tensor parallelism."""
        if not self.tp:
            return local
        parts = self.tp.gather(local)
        return None if parts is None else assemble(self.model, parts)

    def whole_states(self, local: dict[int, dict[str, dict[str, np.ndarray]]]) -> dict | None:
        """:meth:`whole` of optimizer state ({group: {state: {name: part}}}), on tp rank 0."""
        if not self.tp:
            return local
        states = sorted({state for per in local.values() for state in per})
        wholes = {state: self.whole({i: local[i][state] for i in local}) for state in states}   # collective
        if self.tp.rank:
            return None
        return {i: {state: wholes[state][i] for state in states} for i in local}

    def export_grads(self) -> dict[int, dict[str, np.ndarray]]:
        """Return host copies of this rank's gradients by global layer index."""
        return {i: {name: self.host(self.grad_of(i, name)) for name in self.views.get(i, {})}
                for i in self.layer_indices()}
