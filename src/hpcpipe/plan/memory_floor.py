"""What the planner knows about memory before it measures: the least any plan needs, what profiling holds.

Profiling allocates the model: the layer bench builds one stage of up to 4 of
each layer group with its gradients, in as many processes side by side as the
planned job runs ranks on a node, and the calibration trains the whole model
on each of them. A model whose single layer holds 10 GB of weights made the
kernel kill 12 and 24 GB profiling processes, and then no plan could fit the
budget anyway. Both checks here are arithmetic on the model's specs
(:mod:`hpcpipe.nn.memory`), so the planner refuses such a model in one line
before it starts any process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from hpcpipe.config import Config
from hpcpipe.errors import ConfigError
from hpcpipe.nn.memory import ITEMSIZE, estimate_rank_bytes, trained_params
from hpcpipe.nn.optim import make_optimizer
from hpcpipe.nn.registry import model_def
from hpcpipe.plan.layer_profile import bench_indices
from hpcpipe.plan.report import size_text
from hpcpipe.plan.search import divisors

OPTIMIZER_BENCH = 1 << 22      # parameters of layer_profile's optimizer timing (params, grads, state, a temporary)


@dataclass(frozen=True)
class Floor:
    """The least bytes the busiest rank of any plan holds, and what they are."""

    total: int
    params: int          # parameters on the busiest rank at best
    param_bytes: int     # with their gradients and optimizer state
    data: int            # the synthetic data set every rank builds
    pp_max: int          # the most pipeline stages any plan has
    buffers: int         # optimizer state buffers per parameter
    largest: int         # the largest layer group's parameters
    largest_index: int


def largest_pp(config: Config, ranks: int, global_batch: int) -> int:
    """The most pipeline ranks a plan for this batch on ``ranks`` ranks can have (1 when none is possible)."""
    layouts = [ranks // dp for dp in divisors(ranks) if ranks // dp <= config.n_layers and global_batch % dp == 0]
    return max(layouts, default=1)


def plan_floor(config: Config, ranks: int, global_batch: int) -> Floor:
    """The least memory per rank of every plan: parameters, gradients and optimizer state at the best split, data.

    Whatever the cut or the virtual stages, some rank of pp holds the largest
    layer group and at least 1/pp of all parameters; activations, messages,
    the interpreter and its libraries only add to it.
    """
    specs = model_def(config).specs
    counts = [int(spec.n_params) for spec in specs]
    pp = largest_pp(config, ranks, global_batch)
    params = max(max(counts), math.ceil(sum(counts) / pp))
    buffers = len(make_optimizer(config.train, np, 0, np.float32).state)
    # the trained share of them (LoRA: the adapters) has gradients and state; under ZeRO-1 the state of the whole
    # model is held once over all ranks, so some rank holds at least 1/ranks of it
    total_trained = sum(trained_params(spec) for spec in specs)
    trained = math.ceil(params * total_trained / max(sum(counts), 1))
    state = -(-total_trained // ranks) if config.train.zero else trained
    param_bytes = (params + trained + buffers * state) * ITEMSIZE[config.model.dtype]
    data = estimate_rank_bytes(config, [range(len(specs))], 1, "interleaved").data
    largest = max(range(len(counts)), key=counts.__getitem__)
    return Floor(param_bytes + data, params, param_bytes, data, pp, buffers, counts[largest], largest)


def check_budget(config: Config, ranks: int, global_batch: int, budget: int | None, budget_how: str) -> None:
    """Raise ConfigError, one line, when no plan can fit the budget per rank whatever the profile would say."""
    if budget is None:
        return
    floor = plan_floor(config, ranks, global_batch)
    if floor.total <= budget:
        return
    group = "layer" if config.model.kind == "mlp" else "layer group"
    if floor.params == floor.largest:
        what = f"{group} {floor.largest_index}'s {floor.largest:,} parameters"
    else:
        what = f"1/{floor.pp_max} of the model's parameters ({floor.params:,}; pp is at most {floor.pp_max})"
    data = f" and the synthetic data set ({size_text(floor.data)})" if floor.data else ""
    state = f" and {config.train.optimizer} state" if floor.buffers else ""
    raise ConfigError(f"no plan for {ranks} ranks fits {size_text(budget)} per rank ({budget_how}): the busiest "
                      f"rank of any plan needs at least {size_text(floor.total)} ({floor.total} bytes) for "
                      f"{what} with their gradients{state} ({size_text(floor.param_bytes)}, {config.model.dtype})"
                      f"{data}; nothing was measured: give a larger --memory-per-rank, more ranks or a smaller model")


def profiling_bytes(config: Config, sizes: list[int]) -> int:
    """About the most one layer-bench process holds: its stage's parameters (with gradients and initial values),
    the inputs of every size, two micro-batches' caches at the largest, a group's temporaries, the optimizer bench."""
    model = model_def(config)
    itemsize = ITEMSIZE[config.model.dtype]
    indices = bench_indices(model)
    specs = [model.specs[i] for i in indices]
    params = sum(int(s.n_params) for s in specs)
    largest = max(int(s.n_params) for s in specs)
    rows = max(sizes)

    def boundary(index: int, n: int) -> int:
        shape, dtype = model.boundary(index, n)
        return math.prod(shape) * (8 if dtype == "int64" else itemsize)

    inputs = sum(boundary(indices[0], n) + boundary(model.n_layers, n) for n in sizes)
    caches = 2 * rows * sum(int(s.act_elements) for s in specs) * itemsize
    widest = max(boundary(i, rows) for i in range(model.n_layers + 1))
    return (3 * params + largest) * itemsize + inputs + caches + 4 * widest + 5 * OPTIMIZER_BENCH * itemsize


def check_profiling(config: Config, sizes: list[int], processes: int, available: int) -> None:
    """Raise ConfigError, one line, when the layer bench's processes would need more than this machine has."""
    if available <= 0:       # unknown: nothing to compare with
        return
    each = profiling_bytes(config, sizes)
    if each * processes <= available:
        return
    side = f"{processes} processes side by side" if processes > 1 else "1 process"
    raise ConfigError(f"profiling {config.layers_text()} here needs about {size_text(each * processes)} ({side}, "
                      f"each holding up to 4 of every layer group with gradients and micro-batches up to "
                      f"{max(sizes)} rows: {size_text(each)}), more than this machine's {size_text(available)} "
                      f"available; nothing was measured: plan on a machine with more memory, or with fewer ranks "
                      f"per node (--cores) or a smaller --global-batch")

