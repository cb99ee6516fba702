"""Trainer: wires config, topology, backend, model, schedule, engine, optimizer and data for one rank.

Construction is in two phases so that a bad configuration never reaches a
collective: :func:`plan` checks everything that can be checked locally
(identically on every rank) and raises ConfigError; :class:`Trainer` then
builds communicators and runs steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from . import loss as losses
from .backend import select_backend
from .comm import PipeComm, Poller, gather_to_root
from .config import Config, resolve_layout
from .data import ReplicaFeeder, check_data_file, open_data
from .errors import ConfigError, ScheduleError
from .engine import Engine, StepFeed
from .lowering import lower, validate
from .model import RankParameters, initial_arrays, layer_specs, partition
from .optim import clip_factor, make_optimizer
from .schedules import build_schedule
from .topology import make_topology
from .weights import check_weights, read_weights


@dataclass(frozen=True)
class Plan:
    """Everything decided before the first collective."""

    config: Config
    dp: int
    pp: int
    n_stages: int
    stage_ranges: list[range]
    programs: list[list]


def plan(config: Config, world_size: int) -> Plan:
    """Check config against the world size, data and weights files; lower and validate the schedule."""
    dp, pp = resolve_layout(config, world_size)
    par, tr = config.parallel, config.train
    n_stages = pp * par.virtual_stages
    specs = layer_specs(config)
    ranges = partition(specs, n_stages, par.stage_layers)
    if config.data.path:
        check_data_file(config)
    if config.model.init:
        check_weights(config.model.init, specs)
    try:
        programs = lower(build_schedule(par.schedule, pp, tr.micro_batches, par.virtual_stages), pp, n_stages)
        validate(programs, pp, n_stages, tr.micro_batches)
    except ScheduleError as exc:
        # an unsupported (schedule, pp, micro-batches, virtual stages) is a configuration error:
        # refused on every rank before the first collective
        raise ConfigError(f"parallel.schedule = {par.schedule!r}: {exc}") from None
    return Plan(config, dp, pp, n_stages, ranges, programs)


class Trainer:
    """One rank's share of pipeline-parallel training."""

    def __init__(self, p: Plan, world: Any, keep_input_grads: bool = False, record_events: bool = False):
        cfg = p.config
        self.plan, self.config = p, cfg
        self.topo = make_topology(world, p.dp, p.pp)
        self.backend = select_backend(cfg.run.backend)
        xp = self.backend.xp
        self.poller = Poller(cfg.run.poll_min_us, cfg.run.poll_max_us)
        self.comm = PipeComm(self.topo.pp_comm, self.topo.dp_comm, world, self.backend, self.poller)
        pp_rank = self.topo.pp_rank
        self.my_stages = {s: p.stage_ranges[s] for s in range(pp_rank, p.n_stages, p.pp)}
        specs = layer_specs(cfg)
        self.specs = specs
        self.params = RankParameters(specs, self.my_stages, xp, cfg.model.dtype)
        indices = self.params.layer_indices()
        arrays = read_weights(cfg.model.init, indices) if cfg.model.init else \
            initial_arrays(specs, indices, cfg.model.seed, cfg.model.dtype)
        self.params.load(arrays)
        tr = cfg.train
        self.global_batch = p.dp * tr.micro_batches * tr.micro_batch_size
        out_dim = cfg.model.dims[-1]
        self.loss_norm = losses.normaliser(tr.loss, self.global_batch, out_dim)
        replica_norm = losses.normaliser(tr.loss, tr.micro_batches * tr.micro_batch_size, out_dim)
        widths = [cfg.model.dims[r.start] for r in p.stage_ranges] + [out_dim]
        self.first = 0 in self.my_stages
        self.last = p.n_stages - 1 in self.my_stages
        self.engine = Engine(p.programs[pp_rank], self.params, self.comm, pp=p.pp, n_stages=p.n_stages,
                             n_micro=tr.micro_batches, widths=widths, micro_batch_size=tr.micro_batch_size,
                             loss_fn=losses.LOSSES[tr.loss], loss_scale=1.0 / replica_norm,
                             dtype=np.dtype(cfg.model.dtype), keep_input_grads=keep_input_grads,
                             record_events=record_events)
        self.optimizer = make_optimizer(tr, xp, self.params.flat.size, self.params.flat.dtype)
        self.feeder = ReplicaFeeder(open_data(cfg), cfg, p.dp, self.topo.dp_rank, self.first, self.last)
        self.last_grad_norm = 0.0
        self.last_stats = None

    def _feed(self, step: int) -> StepFeed:
        xs, ys = self.feeder.step(step)
        asarray = self.backend.xp.asarray
        return StepFeed([asarray(x) for x in xs], [asarray(y) for y in ys])

    def _update(self) -> None:
        """Clip by the global gradient norm (over all stages; replicas agree after the average), then step."""
        xp = self.backend.xp
        local = float(xp.vdot(self.params.grad, self.params.grad))
        norm = float(np.sqrt(self.comm.sum_over_pp(np.array([local]))[0]))
        self.last_grad_norm = norm
        factor = clip_factor(norm, self.config.train.grad_clip)
        if factor != 1.0:
            self.params.grad *= factor
        self.optimizer.step(self.params.flat, self.params.grad)

    def _run(self, step: int, update: bool) -> float:
        self.engine.optimizer_step = self._update if update else None
        stats = self.engine.run(self._feed(step))
        self.last_stats = stats
        total = self.comm.sum_over_world(np.array([stats.loss_sum]))[0]
        return float(total) / self.loss_norm

    def train_step(self, step: int) -> float:
        """Run one optimizer step on the given step's batch; return the global loss before the update."""
        return self._run(step, update=True)

    def compute_gradients(self, step: int = 0) -> float:
        """Forward and backward on a step's batch without updating; gradients stay in params.grad."""
        return self._run(step, update=False)

    def gather(self, what: str = "params", root: int = 0) -> dict[int, dict[str, np.ndarray]] | None:
        """Collect every layer's parameters or gradients by global index on world rank root (tests, export)."""
        local = self.params.export() if what == "params" else self.params.export_grads()
        mine = local if self.topo.dp_rank == 0 else {}
        parts = gather_to_root(self.topo.world, mine, root)
        if parts is None:
            return None
        merged: dict[int, dict[str, np.ndarray]] = {}
        for part in parts:
            merged.update(part)
        return merged

    def input_gradients(self) -> list[Any]:
        """dL/dx of the model input per micro-batch of this replica (first stage, keep_input_grads only)."""
        return [self.backend.to_host(self.engine.input_grads[m]) for m in sorted(self.engine.input_grads)]

    def close(self) -> None:
        """Free the communicators."""
        self.topo.free()
