"""Measure the model's layer groups on this machine: forward, input- and weight-gradient halves, bytes.

``python -m hpcpipe.plan.layer_profile REQUEST.json OUT.json`` runs :func:`profile_layers`
in a process of its own, so that it computes with exactly the BLAS thread count a
rank of the planned job gets (the planner sets the thread variables before NumPy
loads). The layer groups run as one stage built with the engine's own layer code
(:class:`hpcpipe.nn.rank_parameters.RankParameters`), each distinct group (the MLP's hidden
layers, or a GPT's blocks, are one shape repeated) at most 4 times
(:func:`bench_indices`), and each group is timed inside it at each micro-batch size:
F (with the loss when it is the model's last group), the input-gradient half I, the
weight-gradient half W and the full backward B. For each tensor-parallel width tp the
planner may choose, the same groups are built and timed again as tp rank 0 holds them
(fields ``F/tp2``, ...): the products at their split shapes, the norms, residuals and
softmaxes a tp rank still computes whole, the vocabulary-parallel lookup and loss; the
tp collectives themselves are left out (:class:`Unreduced`): the comm model prices them.
Dividing the whole group's time by tp instead misses that a block's half-width products
run slower per flop and its replicated parts do not shrink (measured: a d 128 GPT block
at tp 2 took 0.55-0.62 of its whole time, the vocabulary head 0.43-0.47). Bytes
come from the arrays themselves: the caches a forward keeps for its backward
(what the engine stashes), the peak of NumPy's allocations during each action
(tracemalloc sees every NumPy data buffer), the group's parameters.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time
import tracemalloc
from typing import Any

import numpy as np

from hpcpipe.config import DECODERS, Config, from_dict
from hpcpipe.nn.memory import cache_bytes
from hpcpipe.nn.optim import make_optimizer
from hpcpipe.nn.rank_parameters import RankParameters
from hpcpipe.nn.registry import model_def
from hpcpipe.runtime.rss import resident_bytes

OPS = ("F", "I", "W", "B")


def tp_field(op: str, tp: int) -> str:
    """The profile field holding op's times at tensor-parallel width tp (op itself at tp 1)."""
    return op if tp == 1 else f"{op}/tp{tp}"


class Unreduced:
    """Tensor-parallel rank 0 of ``size`` ranks whose reductions are left out: its compute alone, as measured.

    The layers then compute exactly a tp rank's part (rank 0 holds the largest part of an
    uneven split); the sums and maxima they would exchange are the comm model's to price.
    """

    def __init__(self, size: int):
        self.size, self.rank = size, 0

    def sum_(self, x: Any) -> Any:
        """Leave x as it is (the sum over the ranks is priced by the comm model)."""
        return x

    def max_(self, x: Any) -> Any:
        """Leave x as it is (the maximum over the ranks is priced by the comm model)."""
        return x


def group_signature(model: Any, index: int) -> str:
    """A key equal for layer groups that cost the same (same parameters, same place in the model's ends)."""
    spec = model.specs[index]
    shapes = sorted((k, tuple(v)) for k, v in spec.shapes.items())
    extra = getattr(spec, "activation", "")
    return json.dumps([model.kind, shapes, extra, index == 0, index == model.n_layers - 1])


def _inputs(model: Any, index: int, rows: int, rng: np.random.Generator, xp: Any, dtype: str) -> tuple[Any, Any]:
    """A random input of group ``index`` and what its backward receives (targets for the last group)."""
    shape, kind = model.boundary(index, rows)
    if kind == "int64":
        x = xp.asarray(rng.integers(0, model.shape.vocab, size=shape))
    else:
        x = xp.asarray(rng.standard_normal(shape).astype(dtype))
    out_shape, _ = model.boundary(index + 1, rows)
    if index == model.n_layers - 1:
        if model.kind in DECODERS:
            target = xp.asarray(rng.integers(0, model.shape.vocab, size=(rows, model.shape.seq_len)))
        elif model.loss_name == "cross_entropy":
            target = xp.asarray(rng.integers(0, out_shape[-1], size=(rows,)))
        else:
            target = xp.asarray(rng.standard_normal(out_shape).astype(dtype))
        return x, target
    return x, xp.asarray(rng.standard_normal(out_shape).astype(dtype))


def bench_indices(model: Any, max_repeat: int = 4) -> list[int]:
    """The layer groups one profiling stage runs: the model in order, each distinct group at most max_repeat times.

    A stage of several groups in a row is what a rank runs: each group's weights
    and caches come after the others' in the caches, and its arrays are fresh
    memory while earlier groups' caches are alive. Measured alone, in a loop on the
    same buffers, a small micro-batch runs 20-40 % faster than it does there. Up
    to max_repeat copies of a repeated group (hidden layers, blocks) keep the
    profile's memory and time bounded for deep models; the last group always runs.
    """
    seen: dict[str, int] = {}
    chosen = []
    for index in range(model.n_layers):
        key = group_signature(model, index)
        if seen.get(key, 0) < max_repeat or index == model.n_layers - 1:
            seen[key] = seen.get(key, 0) + 1
            chosen.append(index)
    return chosen


class _StageBench:
    """The chosen layer groups as one stage built with the engine's layer code, timed layer by layer."""

    def __init__(self, model: Any, indices: list[int], xp: Any, dtype: str, seed: int, tp: int = 1):
        self.model, self.indices, self.xp, self.dtype, self.tp = model, indices, xp, dtype, tp
        group = Unreduced(tp) if tp > 1 else None
        runs: list[list[int]] = []
        for i in indices:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        self.params = RankParameters(model, {k: range(r[0], r[-1] + 1) for k, r in enumerate(runs)}, xp, dtype,
                                     tp=group)
        self.loss_fn = model.tp_loss(group) if group else model.loss_fn
        self.params.load(model.init_arrays(indices, seed, dtype))     # whole tensors, or tp rank 0's parts
        if self.params.tied_copy:     # a tied head without the embedding reads its own copy of the table
            self.params.param(-1, "tok_emb")[...] = xp.asarray(model.init_arrays([0], seed, dtype)[0]["tok_emb"])
        self.layers = [layer for k in range(len(runs)) for layer in self.params.stages[k].layers]
        # one thread computes in this thread: its CPU time is the work, whatever else runs on the machine
        self.clock = time.thread_time if os.environ.get("OMP_NUM_THREADS") == "1" else time.perf_counter
        self.held: list = []          # the previous pass's caches: another micro-batch alive, as in a pipeline

    def _fit(self, array: Any, index: int, rows: int, rng: np.random.Generator) -> Any:
        """array if it is group index's input shape, else a random one (after a group the stage skipped)."""
        shape, kind = self.model.boundary(index, rows, self.tp, 0)     # tp rank 0's part where it is split
        if tuple(array.shape) == tuple(shape):
            return array
        return self.xp.asarray(rng.standard_normal(shape).astype(self.dtype))

    def _grad_fit(self, g: Any, index: int, rows: int, rng: np.random.Generator) -> Any:
        shape, _ = self.model.boundary(index + 1, rows, self.tp, 0)
        # the loss's gradient (a tp rank's: its part of the vocabulary) is the last group's as it comes
        if tuple(g.shape) == tuple(shape) or index == self.model.n_layers - 1:
            return g
        return self.xp.asarray(rng.standard_normal(shape).astype(self.dtype))

    def forward(self, x: Any, target: Any, rows: int, rng: np.random.Generator, times: dict | None) -> tuple:
        """Run the stage's forward (and the loss); return (caches, dL/dy of the last group)."""
        clock, caches, g = self.clock, [], None
        for index, layer in zip(self.indices, self.layers, strict=True):
            x = self._fit(x, index, rows, rng)
            start = clock()
            x, cache = layer.forward(x)
            if index == self.model.n_layers - 1:
                _, g = self.loss_fn(self.xp, x, target, 1.0)
            if times is not None:
                times[tp_field("F", self.tp)][index].append(clock() - start)
            caches.append(cache)
        return caches, g

    def backward(self, caches: list, g: Any, rows: int, rng: np.random.Generator, times: dict, split: bool) -> None:
        """Run the stage's backward, split into I then W (split) or whole (B), timing each group."""
        clock, dzs = self.clock, {}
        for k in range(len(self.layers) - 1, -1, -1):
            index, layer = self.indices[k], self.layers[k]
            g = self._grad_fit(g, index, rows, rng)
            start = clock()
            if split:
                g, dzs[k] = layer.backward_input(caches[k], g, index > 0)
            else:
                g = layer.backward(caches[k], g, index > 0)
            times[tp_field("I" if split else "B", self.tp)][index].append(clock() - start)
        if split:
            for k, layer in enumerate(self.layers):
                start = clock()
                layer.backward_weight(caches[k], dzs[k])
                times[tp_field("W", self.tp)][self.indices[k]].append(clock() - start)

    def step(self, x: Any, target: Any, rows: int, rng: np.random.Generator, times: dict) -> None:
        """One measured pass: F, I and W of every group, then a forward and the full backward B."""
        caches, g = self.forward(x, target, rows, rng, times)
        self.backward(caches, g, rows, rng, times, split=True)
        self.held = caches
        caches, g = self.forward(x, target, rows, rng, None)
        self.backward(caches, g, rows, rng, times, split=False)


def _bytes(bench: _StageBench, x: Any, target: Any, rows: int, rng: np.random.Generator) -> dict[int, tuple]:
    """Per group: (cache bytes a forward keeps, peak NumPy bytes one of its actions allocates)."""
    out: dict[int, list[int]] = {i: [0, 0] for i in bench.indices}
    caches, g = bench.forward(x, target, rows, rng, None)
    for index, cache in zip(bench.indices, caches, strict=True):
        out[index][0] = cache_bytes(cache)
    tracemalloc.start()
    try:
        for k in range(len(bench.layers) - 1, -1, -1):   # each group's backward halves, then its forward
            index, layer = bench.indices[k], bench.layers[k]
            g = bench._grad_fit(g, index, rows, rng)
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            g_in, dz = layer.backward_input(caches[k], g, index > 0)
            layer.backward_weight(caches[k], dz)
            out[index][1] = max(out[index][1], tracemalloc.get_traced_memory()[1] - base)
            g = g_in
        del caches
        shape_x = x
        for index, layer in zip(bench.indices, bench.layers, strict=True):
            shape_x = bench._fit(shape_x, index, rows, rng)
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            shape_x, cache = layer.forward(shape_x)
            if index == bench.model.n_layers - 1:     # the loss and its gradient are the last stage's forward
                loss_grad = bench.model.loss_fn(bench.xp, shape_x, target, 1.0)[1]
                del loss_grad
            del cache
            out[index][1] = max(out[index][1], tracemalloc.get_traced_memory()[1] - base)
    finally:
        tracemalloc.stop()
    return {i: tuple(v) for i, v in out.items()}


class _Share:
    """How far the bench has got, as a share of its estimated time, written to a file the planner polls.

    The bench runs a warm-up pass, then timed passes until 2 are done and the
    time budget is spent (at most ``repeats``), then one pass measuring bytes:
    one pass's time, from the warm-up, says how long the whole takes.
    """

    def __init__(self, path: str | None, n_sizes: int, repeats: int, budget_s: float):
        self.path, self.n_sizes, self.repeats, self.budget_s = path, n_sizes, repeats, budget_s
        self.start = time.perf_counter()
        self.pass_s = 0.0

    def warm(self, done: int) -> None:
        """``done`` sizes of the warm-up pass ran."""
        self.pass_s = (time.perf_counter() - self.start) * self.n_sizes / done
        self.write()

    def write(self, share: float | None = None) -> None:
        """Write the share done (estimated from the elapsed time unless given)."""
        if self.path is None:
            return
        if share is None:
            timed = min(max(self.budget_s * self.n_sizes, 2 * self.pass_s), self.repeats * self.pass_s)
            share = min(0.99, (time.perf_counter() - self.start) / max(2 * self.pass_s + timed, 1e-9))
        part = self.path + ".part"
        with open(part, "w") as f:
            f.write(f"{share:.4f}\n")
        os.replace(part, self.path)


def read_share(path: str) -> float:
    """The share a bench process wrote to ``path`` (0 while it wrote none)."""
    try:
        with open(path) as f:
            return min(1.0, max(0.0, float(f.read())))
    except (OSError, ValueError):
        return 0.0


def profile_layers(config: Config, sizes: list[int], repeats: int = 7, budget_s: float = 1.5, first: int = 0,
                   progress_path: str | None = None, tps: tuple[int, ...] = ()) -> dict:
    """Measure every distinct layer group at each micro-batch size; return the profile's layer part (JSON-able).

    ``tps``: the tensor-parallel widths (> 1) whose split groups are measured too (fields ``F/tp2``, ...).

    Each pass runs the sizes in turn starting with ``sizes[first]``: copies side by side
    start apart, so a group is timed while its siblings run the rest of the model (as
    the other ranks of a pipeline do), not the same group at the same moment. The share
    done is written to ``progress_path`` as the bench goes (the planner's progress line).
    """
    tps = tuple(sorted({int(t) for t in tps if int(t) > 1}))
    share = _Share(progress_path, len(sizes), repeats, budget_s)
    from hpcpipe.runtime.backend import select_backend

    backend = select_backend(config.run.backend, tf32=config.run.tf32)
    xp, dtype = backend.xp, config.model.dtype
    model = model_def(config)
    rng = np.random.default_rng(0)
    rss_start = resident_bytes()
    small = xp.ones((64, 64), dtype=dtype)
    small @ small          # BLAS allocates its buffers at the first product: a rank's fixed cost
    blas_bytes = max(0, resident_bytes() - rss_start)
    indices = bench_indices(model)
    bench = _StageBench(model, indices, xp, dtype, config.model.seed)
    benches = [bench] + [_StageBench(model, indices, xp, dtype, config.model.seed, tp) for tp in tps]
    fields = [tp_field(op, b.tp) for b in benches for op in OPS]
    signatures = [group_signature(model, i) for i in range(model.n_layers)]
    groups: dict[str, dict] = {}
    for index in indices:
        groups.setdefault(signatures[index], {"index": index, "params": int(model.specs[index].n_params),
                                              **{f: {} for f in fields}, "stash_bytes": {}, "work_bytes": {}})
    order = sizes[first % len(sizes):] + sizes[:first % len(sizes)]
    inputs = {rows: (_inputs(model, indices[0], rows, rng, xp, dtype)[0],
                     _inputs(model, model.n_layers - 1, rows, rng, xp, dtype)[1]) for rows in order}
    times = {rows: {f: {i: [] for i in indices} for f in fields} for rows in sizes}
    for done, (rows, (x, target)) in enumerate(inputs.items(), 1):             # warm-up
        for b in benches:
            b.step(x, target, rows, rng, {f: {i: [] for i in indices} for f in fields})
        share.warm(done)
    # The sizes take turns, pass by pass: a slower or faster spell of the machine
    # then touches every size alike instead of tilting the line through them.
    start, passes = time.perf_counter(), 0
    while passes < repeats and (passes < 2 or time.perf_counter() - start < budget_s * len(sizes)):
        for rows, (x, target) in inputs.items():
            for b in benches:      # the widths in turn too: one spell of the machine touches them alike
                b.step(x, target, rows, rng, times[rows])
                backend.synchronize()
            share.write()
        passes += 1
    for b in benches:
        b.held = []
    del benches[1:]
    for rows, (x, target) in inputs.items():
        sizes_bytes = _bytes(bench, x, target, rows, rng)
        share.write()
        for key, entry in groups.items():
            mine = [i for i in indices if signatures[i] == key]
            for f in fields:
                entry[f][str(rows)] = statistics.median([t for i in mine for t in times[rows][f][i]])
            entry["stash_bytes"][str(rows)] = max(sizes_bytes[i][0] for i in mine)
            entry["work_bytes"][str(rows)] = max(sizes_bytes[i][1] for i in mine)
    share.write(1.0)
    return {"groups": groups, "signatures": signatures, "stage": indices, "tps": list(tps),
            "optimizer": _optimizer_costs(config, xp, dtype), "blas_rss_bytes": blas_bytes,
            "backend": backend.name}


def _optimizer_costs(config: Config, xp: Any, dtype: str) -> dict[str, dict]:
    """The update's cost for every optimizer variant (cheap, and then a change of optimizer needs no new profile)."""
    out = {}
    variants = (("sgd", {"optimizer": "sgd", "momentum": 0.0}), ("sgd+momentum", {"optimizer": "sgd", "momentum": 0.9}),
                ("adam", {"optimizer": "adam"}), ("adamw", {"optimizer": "adamw"}))
    for name, keys in variants:
        out[name] = _optimizer_cost(dataclasses.replace(config.train, **keys), xp, dtype)
    return out


def _optimizer_cost(train: Any, xp: Any, dtype: str, size: int = 1 << 22) -> dict:
    """Seconds per parameter of the update (gradient norm + optimizer step) and its temporary bytes per parameter."""
    params = xp.ones(size, dtype=dtype)
    grads = xp.full(size, 1e-3, dtype=dtype)
    opt = make_optimizer(train, xp, size, dtype)
    opt.step(params, grads)
    times = []
    for _ in range(9):      # a memory-bound sweep: the other ranks' sweeps make it noisy, hence 9
        start = time.perf_counter()
        float(xp.vdot(grads, grads))
        opt.step(params, grads)
        times.append(time.perf_counter() - start)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        opt.step(params, grads)
        work = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    return {"seconds_per_param": statistics.median(times) / size, "work_bytes_per_param": work / size,
            "state_buffers": len(opt.state)}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the profiling subprocess: REQUEST.json (config dict, sizes, repeats) OUT.json [FIRST].

    The share done is written to OUT.json.progress as the bench goes.
    """
    args = sys.argv[1:] if argv is None else argv
    with open(args[0]) as f:
        request = json.load(f)
    config = from_dict(request["config"])
    result = profile_layers(config, [int(s) for s in request["sizes"]], int(request.get("repeats", 7)),
                            float(request.get("budget_s", 1.5)), int(args[2]) if len(args) > 2 else 0,
                            args[1] + ".progress", tuple(request.get("tps", ())))
    with open(args[1], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
