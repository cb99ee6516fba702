"""Measure the model's layer groups on this machine: forward, input- and weight-gradient halves, bytes.

``python -m hpcpipe.plan.layer_profile REQUEST.json OUT.json`` runs :func:`profile_layers`
in a process of its own, so that it computes with exactly the BLAS thread count a
rank of the planned job gets (the planner sets the thread variables before NumPy
loads). Each distinct layer group (the MLP's hidden layers, or a GPT's blocks, are
one shape repeated) is built with the engine's own layer code
(:class:`hpcpipe.nn.model.RankParameters`, a one-group stage) and timed at each
micro-batch size: F (with the loss when it is the model's last group), the
input-gradient half I, the weight-gradient half W and the full backward B. Bytes
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

from hpcpipe.config import Config, from_dict
from hpcpipe.nn.model import RankParameters
from hpcpipe.nn.model_spec import model_def
from hpcpipe.nn.optim import make_optimizer
from hpcpipe.train.engine import _cache_bytes

OPS = ("F", "I", "W", "B")


def group_signature(model: Any, index: int) -> str:
    """A key equal for layer groups that cost the same (same parameters, same place in the model's ends)."""
    spec = model.specs[index]
    shapes = sorted((k, tuple(v)) for k, v in spec.shapes.items())
    extra = getattr(spec, "activation", "")
    return json.dumps([model.kind, shapes, extra, index == 0, index == model.n_layers - 1])


def _rss_bytes() -> int:
    """Resident memory of this process now (VmRSS), 0 when /proc is not there."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _inputs(model: Any, index: int, rows: int, rng: np.random.Generator, xp: Any, dtype: str) -> tuple[Any, Any]:
    """A random input of group ``index`` and what its backward receives (targets for the last group)."""
    shape, kind = model.boundary(index, rows)
    if kind == "int64":
        x = xp.asarray(rng.integers(0, model.shape.vocab, size=shape))
    else:
        x = xp.asarray(rng.standard_normal(shape).astype(dtype))
    out_shape, _ = model.boundary(index + 1, rows)
    if index == model.n_layers - 1:
        if model.kind == "gpt":
            target = xp.asarray(rng.integers(0, model.shape.vocab, size=(rows, model.shape.seq_len)))
        elif model.loss_name == "cross_entropy":
            target = xp.asarray(rng.integers(0, out_shape[-1], size=(rows,)))
        else:
            target = xp.asarray(rng.standard_normal(out_shape).astype(dtype))
        return x, target
    return x, xp.asarray(rng.standard_normal(out_shape).astype(dtype))


class _GroupBench:
    """One layer group as a one-group stage, with the actions the engine runs on it."""

    def __init__(self, model: Any, index: int, xp: Any, dtype: str, seed: int):
        self.model, self.index, self.xp = model, index, xp
        self.last = index == model.n_layers - 1
        self.params = RankParameters(model, {0: range(index, index + 1)}, xp, dtype)
        arrays = model.init_arrays([index], seed, dtype)[index]
        for name, value in arrays.items():
            self.params.param(index, name)[...] = xp.asarray(value)
        if self.params.tied_copy:     # a tied head without the embedding reads its own copy of the table
            self.params.param(-1, "tok_emb")[...] = xp.asarray(model.init_arrays([0], seed, dtype)[0]["tok_emb"])
        self.stage = self.params.stages[0]
        self.need_input_grad = index > 0     # the first stage never computes the model input's gradient
        # one thread computes in this thread: its CPU time is the work, whatever else runs on the machine
        self.clock = time.thread_time if os.environ.get("OMP_NUM_THREADS") == "1" else time.perf_counter

    def forward(self, x: Any, target: Any) -> tuple[list, Any]:
        y, caches = self.stage.forward(x)
        if self.last:
            _, g = self.model.loss_fn(self.xp, y, target, 1.0)
            return caches, g
        return caches, target

    def run(self, op: str, x: Any, target: Any) -> float:
        """Run one action (after what it needs) and return its seconds (of CPU time with one BLAS thread)."""
        clock = self.clock
        if op == "F":
            start = clock()
            self.forward(x, target)
            return clock() - start
        caches, g = self.forward(x, target)
        if op == "B":
            start = clock()
            self.stage.backward(caches, g, self.need_input_grad)
            return clock() - start
        start = clock()
        _, dzs = self.stage.backward_input(caches, g, self.need_input_grad)
        mid = clock()
        if op == "I":
            return mid - start
        start = clock()
        self.stage.backward_weight(caches, dzs)
        return clock() - start


def _median_time(bench: _GroupBench, op: str, x: Any, target: Any, repeats: int, budget_s: float) -> float:
    bench.run(op, x, target)   # warm-up: first-touch page faults, BLAS buffers
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < repeats and (len(times) < 2 or time.perf_counter() - start < budget_s):
        times.append(bench.run(op, x, target))
    return statistics.median(times)


def _bytes(bench: _GroupBench, x: Any, target: Any) -> tuple[int, int]:
    """(cache bytes a forward keeps, peak NumPy bytes allocated by any one of F, I, W, B beyond what it received)."""
    caches, _ = bench.forward(x, target)
    stash = _cache_bytes(caches)
    del caches
    peak = 0
    for op in OPS:
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            bench.run(op, x, target)
            peak = max(peak, tracemalloc.get_traced_memory()[1] - base)
        finally:
            tracemalloc.stop()
    return stash, peak


def profile_layers(config: Config, sizes: list[int], repeats: int = 5, budget_s: float = 0.5) -> dict:
    """Measure every distinct layer group at each micro-batch size; return the profile's layer part (JSON-able)."""
    from hpcpipe.runtime.backend import select_backend

    backend = select_backend(config.run.backend)
    xp, dtype = backend.xp, config.model.dtype
    model = model_def(config)
    rng = np.random.default_rng(0)
    rss_start = _rss_bytes()
    groups: dict[str, dict] = {}
    for index in range(model.n_layers):
        key = group_signature(model, index)
        if key in groups:
            continue
        bench = _GroupBench(model, index, xp, dtype, config.model.seed)
        entry: dict[str, Any] = {"index": index, "params": int(bench.params.flat.size)}
        for op in OPS:
            entry[op] = {}
        entry["stash_bytes"], entry["work_bytes"] = {}, {}
        for rows in sizes:
            x, target = _inputs(model, index, rows, rng, xp, dtype)
            for op in OPS:
                entry[op][str(rows)] = _median_time(bench, op, x, target, repeats, budget_s)
                backend.synchronize()
            entry["stash_bytes"][str(rows)], entry["work_bytes"][str(rows)] = _bytes(bench, x, target)
        groups[key] = entry
        del bench
    return {"groups": groups, "signatures": [group_signature(model, i) for i in range(model.n_layers)],
            "optimizer": _optimizer_costs(config, xp, dtype), "blas_rss_bytes": max(0, _rss_bytes() - rss_start),
            "backend": backend.name}


def optimizer_name(train: Any) -> str:
    """The optimizer variant whose update cost differs: sgd, sgd+momentum, adam, adamw."""
    momentum = train.optimizer == "sgd" and train.momentum > 0
    return train.optimizer + ("+momentum" if momentum else "")


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
    for _ in range(5):
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
    """Entry point of the profiling subprocess: REQUEST.json (config dict, sizes, repeats) -> OUT.json."""
    args = sys.argv[1:] if argv is None else argv
    with open(args[0]) as f:
        request = json.load(f)
    config = from_dict(request["config"])
    result = profile_layers(config, [int(s) for s in request["sizes"]], int(request.get("repeats", 5)),
                            float(request.get("budget_s", 0.5)))
    with open(args[1], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
