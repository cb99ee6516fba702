"""Trainer: wires config, topology, backend, model, schedule, engine, optimizer and data for one rank.

Construction is in two phases so that a bad configuration never reaches a
collective: :func:`hpcpipe.train.setup.prepare` checks everything that can be
checked locally (identically on every rank) and raises ConfigError;
:class:`Trainer` then builds communicators and runs steps.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hpcpipe.errors import EXIT_CONFIG, AgreedError, ConfigError
from hpcpipe.nn.rank_parameters import RankParameters
from hpcpipe.nn.registry import model_def
from hpcpipe.runtime.backend import select_backend
from hpcpipe.runtime.comm import PipeComm, Poller, barrier, gather_to_root, together
from hpcpipe.runtime.expert_comm import ExpertGroup
from hpcpipe.runtime.faults import nan_injection
from hpcpipe.runtime.nodes import check_shared_directory, gather_nodes
from hpcpipe.runtime.step_health import StepDecision, decide, local_decision
from hpcpipe.runtime.topology import make_topology
from hpcpipe.runtime.tp_group import TPGroup
from hpcpipe.runtime.wire import WireBytes
from hpcpipe.state import collective as checkpoint_mpi
from hpcpipe.state.peft import read_arrays
from hpcpipe.state.run_lock import RunLock
from hpcpipe.train import shuffle
from hpcpipe.train.data import ReplicaFeeder, open_data
from hpcpipe.train.engine import Engine, StepFeed, StepStats, tied_peer
from hpcpipe.train.evaluation import Evaluator
from hpcpipe.train.lr_schedule import lr_at
from hpcpipe.train.setup import TrainSetup
from hpcpipe.train.zero import make_sync

if TYPE_CHECKING:
    from mpi4py.MPI import Comm


@dataclass(frozen=True)
class StepResult:
    """What one step gives back: the loss and the agreed decision (the same on every rank), this rank's measures."""

    loss: float                      # the global loss, before the update
    decision: StepDecision | None    # skip, stop, gradient norm (None: gradients only, no update ran)
    stats: StepStats                 # this rank's stash peaks and timed actions
    host_device_bytes: int           # arrays copied between host and GPU in the step (0 on NumPy)
    lr: float | None = None          # the learning rate the step's update used (None: no update ran)


class Trainer:
    """One rank's share of pipeline-parallel training."""

    def __init__(self, p: TrainSetup, world: Comm, keep_input_grads: bool = False, record_events: bool = False):
        cfg = p.config
        self.setup, self.config = p, cfg
        self.topo = make_topology(world, p.dp, p.pp, cfg.parallel.tp, cfg.parallel.ep)
        self.backend = select_backend(cfg.run.backend, tf32=cfg.run.tf32)
        if world.Get_rank() == 0:
            for note in self.backend.notes:
                print(f"hpcpipe: note: {note}", file=sys.stderr, flush=True)
        xp = self.backend.xp
        self.poller = Poller(cfg.run.poll_min_us, cfg.run.poll_max_us)
        # every rank's node: the bytes that leave a node are counted (metrics' link_bytes), shared paths checked
        self.nodes = gather_nodes(world)
        self.wire = WireBytes(self.nodes)
        self.comm = PipeComm(self.topo.pp_comm, self.topo.dp_comm, world, self.backend, self.poller,
                             tp_comm=self.topo.tp_comm, expert_dp_comm=self.topo.expert_dp_comm, wire=self.wire)
        self.tp = TPGroup(self.topo.tp_comm, self.backend, self.poller, self.wire) if self.topo.tp > 1 else None
        self.ep = ExpertGroup(self.topo.ep_comm, self.backend, self.poller, self.wire) if self.topo.ep > 1 \
            else None
        pp_rank = self.topo.pp_rank
        self.my_stages = {s: p.stage_ranges[s] for s in p.shape.rank_stages(pp_rank)}
        self.model = model = model_def(cfg)
        self.specs = model.specs
        tr = cfg.train
        # before the layers are built: a mixture's load-balancing loss, per (replica, micro-batch) chunk
        ledger = model.router_ledger(tr.micro_batches, model.samples_norm(tr.micro_batch_size))
        self.params = RankParameters(model, self.my_stages, xp, cfg.model.dtype, tp=self.tp, ep=self.ep)
        self.global_batch = p.dp * tr.micro_batches * tr.micro_batch_size
        self.loss_norm = model.samples_norm(self.global_batch)
        replica_norm = model.samples_norm(tr.micro_batches * tr.micro_batch_size)
        dtype = np.dtype(cfg.model.dtype)
        starts = [r.start for r in p.stage_ranges] + [model.n_layers]
        boundaries = [model.boundary(i, tr.micro_batch_size, self.topo.tp, self.topo.tp_rank) for i in starts]
        boundaries = [(shape, np.dtype(kind) if kind else dtype) for shape, kind in boundaries]
        shared = [self.topo.tp > 1 and model.boundary_shared(i) for i in starts]
        # the gradient exchange over the replicas and the update (train.zero: replicated or ZeRO-1 sharded)
        self.sync = make_sync(tr, self.params, self.comm, self.topo.dp_rank, tied_peer(self.params, p.shape, pp_rank))
        self.first = 0 in self.my_stages
        self.last = p.n_stages - 1 in self.my_stages
        self.engine = Engine(p.programs[pp_rank], self.params, self.comm, shape=p.shape, boundaries=boundaries,
                             loss_fn=model.tp_loss(self.tp), loss_scale=1.0 / replica_norm,
                             keep_input_grads=keep_input_grads, record_events=record_events,
                             recompute=tr.recompute == "stage", shared=shared, sync=self.sync, ledger=ledger)
        self.feeder = ReplicaFeeder(open_data(cfg), cfg, p.dp, self.topo.dp_rank, self.first, self.last)
        self.evaluator = Evaluator(self) if p.eval_rows else None    # data.eval_path's held-out loss
        # the last step's measures, for callers of train_step / compute_gradients (tests, benchmarks)
        self.last_stats: StepStats | None = None
        self.last_host_device_bytes = 0   # arrays copied between host and GPU in the last step (0 on NumPy)
        self.last_lr: float | None = None  # the learning rate of the last update
        self.start_step = 0
        # the run directory under checkpoint.dir this run saves into: the resumed checkpoint's,
        # or (a fresh run) made by its first save
        self.run_dir: Path | None = p.resume.path.parent if p.resume is not None else None
        self.run_lock: RunLock | None = None
        try:
            if cfg.checkpoint.dir:     # before step 0: a node-local directory would fail the first save
                check_shared_directory(world, self.poller, self.nodes, cfg.checkpoint.dir, "checkpoint.dir")
            if self.run_dir is not None:
                self._lock_run(world)
            self._load_initial_state(world)
        except AgreedError:
            self.topo.free()   # every rank raises it together after the load agreement, so freeing is safe
            raise

    def _lock_run(self, world: Comm) -> None:
        """World rank 0 takes the run directory's lock, before anything there is read or cleaned (collective)."""
        barrier(world, self.poller)   # every rank probed the lock in prepare(): none may find this run's own
        with together(world, self.poller, EXIT_CONFIG):
            if world.Get_rank() == 0:
                self.run_lock = RunLock.acquire(self.run_dir)

    def _load_initial_state(self, world: Comm) -> None:
        """Fill parameters (and on resume optimizer state, step, data position); all ranks agree first."""
        cfg, indices = self.config, self.params.read_indices()
        source = self.setup.resume or self.setup.init
        if source is None:
            self.params.load(self._start_adapters(world, self.model.init_arrays(indices, cfg.model.seed,
                                                                                 cfg.model.dtype), indices))
            return
        resuming = source is self.setup.resume
        try:
            # tensor (expert) parallelism: each rank reads only its parts of the tensors (its experts)
            shards = self.params.read_shards if self.params.cut_any else None
            state = checkpoint_mpi.load(world, self.poller, source, indices, with_optimizer=resuming,
                                        clean_root=self.run_dir if resuming else None, shards=shards)
        except AgreedError as exc:
            if resuming:
                raise
            raise AgreedError(f"model.init: {exc}", exc.code) from None   # say which key named the bad file
        if not resuming:
            self.params.load(self._start_adapters(world, state.arrays, indices))
            return
        self.params.load(state.arrays)
        self.sync.load_state({name: {i: state.optimizer[i][name] for i in indices} for name in self.optimizer.state})
        self.optimizer.steps = int(source.manifest["optimizer"]["steps"])
        self.start_step = source.step
        self.feeder.offset = int(source.manifest["data"]["samples_seen"]) - source.step * self.global_batch
        saved_order = source.manifest["data"].get("order", "of an older hpcpipe")
        if cfg.data.shuffle and saved_order != shuffle.ORDER and world.Get_rank() == 0:
            # nothing is lost, but the rest of the current epoch is drawn in another order
            print(f"hpcpipe: warning: {source.describe()} was taken with the sample order {saved_order!r}; this "
                  f"run shuffles with {shuffle.ORDER!r}, so until the current epoch ends some samples may repeat "
                  f"and others be skipped (later epochs are unaffected)", file=sys.stderr, flush=True)

    def _start_adapters(self, world: Comm, arrays: dict[int, dict[str, Any]], indices: list[int]) -> dict:
        """A fresh LoRA run's adapters in ``arrays``: model.adapter's (a PEFT directory), else PEFT's initial values
        (A uniform, B zero); ``arrays`` as they are without LoRA."""
        model, cfg = self.model, self.config
        if not hasattr(model, "adapter_arrays"):
            return arrays
        adapter = self.setup.adapter
        if adapter is None:
            start = model.adapter_arrays(indices, cfg.model.seed, cfg.model.dtype)
        else:
            start = {}
            with together(world, self.poller, EXIT_CONFIG, lambda e: f"model.adapter: cannot read "
                                                                       f"{adapter.describe()}: {e}"):
                start = read_arrays(adapter, cfg.model.kind, cfg.to_dict()["model"], model.specs, indices,
                                    cfg.model.dtype)
        for i, group in start.items():
            arrays[i].update(group)
        return arrays

    def save_checkpoint(self, step: int) -> Any:
        """Write a checkpoint of `step` completed steps into this run's directory (collective); return it."""
        cfg, p = self.config, self.setup
        layout = {"dp": p.dp, "pp": p.pp, "tp": cfg.parallel.tp, "ep": cfg.parallel.ep,
                  "schedule": cfg.parallel.schedule,
                  "virtual_stages": cfg.parallel.virtual_stages,
                  "stage_layers": [list(r) for r in p.stage_ranges]}
        info = checkpoint_mpi.SaveInfo(layout, cfg.to_dict(), self.feeder.position(step), self.global_batch,
                                       shuffle.ORDER if cfg.data.shuffle else "file", p.tokenizer)
        final = checkpoint_mpi.save(self.topo.world, self.poller, cfg.checkpoint.dir, step, run_dir=self.run_dir,
                                    dp_rank=self.topo.dp_rank, pp_rank=self.topo.pp_rank, params=self.params,
                                    optimizer=self.sync.saved_optimizer(), n_layers=len(self.specs), info=info,
                                    keep=cfg.checkpoint.keep)
        if self.run_lock is None and self.topo.world.Get_rank() == 0:
            # a fresh run's first save made its directory: hold it as a resumed run would
            try:
                self.run_lock = RunLock.acquire(final.parent)
            except ConfigError as exc:
                print(f"hpcpipe: warning: {exc}", file=sys.stderr, flush=True)
        self.run_dir = final.parent
        return final

    def _feed(self, step: int) -> tuple[StepFeed, int]:
        """The step's micro-batches on this rank's device, and the bytes that copying them there moved."""
        xs, ys = self.feeder.step(step)
        asarray = self.backend.xp.asarray
        moved = sum(a.nbytes for a in (*xs, *ys)) if self.backend.on_gpu else 0
        return StepFeed([asarray(x) for x in xs], [asarray(y) for y in ys]), moved

    def _staged_bytes(self) -> int:
        """Bytes staged between GPU and host by the pipeline and tensor-parallel exchanges so far (0 on NumPy)."""
        return self.comm.host_device_bytes + int(getattr(self.tp, "host_device_bytes", 0))

    def _update(self, step: int, stop_requested: Callable[[], bool]) -> StepDecision:
        """Agree on the step (one world allreduce), then clip by the global gradient norm and step, or skip.

        The one allreduce carries the squared gradient norm (counted once per stage),
        the loss, a not-finite flag and a stop-signal flag (``stop_requested()``, asked
        here so that a signal during the step's compute still counts), so every rank
        takes the same decision, which is returned: a non-finite loss or gradient on any
        rank skips the update (parameters and optimizer state untouched) everywhere.
        """
        poison = nan_injection(self.topo.world.Get_rank(), step)
        if poison == "grad":
            self.sync.grad[...] = float("nan")
        elif poison == "loss":
            self.engine.stats.loss_sum = float("nan")
        # every parameter counted once: a tied head's copy of tok_emb and a tp-replicated tensor are not repeated;
        # experts (ep) on each rank of the first ep group, the rest on the first replica
        local = self.sync.norm_sq()
        mine = local_decision(local, self._loss_term(), self.sync.counts_norm, stop_requested())
        decision = decide(self.comm.sum_over_world(mine))
        if decision.skip:
            return decision
        self.last_lr = lr_at(self.config.train, step)
        self.sync.step(decision.grad_norm, self.config.train.grad_clip, self.last_lr)
        return decision

    @property
    def optimizer(self) -> Any:
        """This rank's optimizer (its state: this replica's blocks under train.zero = 1)."""
        return self.sync.optimizer

    def memory_bytes(self) -> tuple[int, int]:
        """(parameter and gradient bytes, optimizer state bytes) this rank holds."""
        held = [self.params.flat, self.params.grad, self.params.frozen, getattr(self.sync, "share", None)]
        return sum(int(a.nbytes) for a in held if a is not None), self.sync.state_bytes()

    def _run(self, step: int, optimizer_step: Callable[[], StepDecision] | None) -> StepResult:
        """Run the step's program (``optimizer_step`` at its OPT_STEP, None: gradients only); return its result."""
        before = self._staged_bytes()
        feed, fed = self._feed(step)
        self.last_lr = None
        stats = self.last_stats = self.engine.run(feed, optimizer_step)
        # arrays only: the loss and norm scalars that come back each micro-batch / step (8 bytes each) are not counted
        moved = self.last_host_device_bytes = fed + self._staged_bytes() - before
        if stats.decision is not None:   # the step decision already summed the loss
            return StepResult(stats.decision.loss_sum / self.loss_norm, stats.decision, stats, moved, self.last_lr)
        total = self.comm.sum_over_world(np.array([self._loss_term()]))[0]
        return StepResult(float(total) / self.loss_norm, None, stats, moved)

    def _loss_term(self) -> float:
        """This rank's term of the world's loss sum: every tp rank of a last stage knows the loss; tp rank 0 adds it."""
        return self.engine.stats.loss_sum if self.topo.tp_rank == 0 else 0.0

    def run_step(self, step: int, stop_requested: Callable[[], bool] | None = None) -> StepResult:
        """Run one optimizer step on the given step's batch; return its loss (before the update) and decision.

        ``stop_requested()`` says whether a stop signal arrived on this rank (None: never); it is
        asked once, at the step's agreement. The decision says whether the update was skipped
        (non-finite values) and whether any rank asked to stop; both are identical on every rank.
        """
        asked = stop_requested or (lambda: False)
        return self._run(step, lambda: self._update(step, asked))

    def train_step(self, step: int) -> float:
        """Run one optimizer step (:meth:`run_step`, never asked to stop); return the global loss before it."""
        return self.run_step(step).loss

    def compute_gradients(self, step: int = 0) -> float:
        """Forward and backward on a step's batch without updating; gradients stay in params.grad."""
        return self._run(step, None).loss

    def gather(self, what: str = "params", root: int = 0) -> dict[int, dict[str, Any]] | None:
        """Collect every layer's parameters, gradients or optimizer state by global index on world rank root."""
        if what not in ("params", "grads", "optimizer"):
            raise ValueError(f"gather: what must be params, grads or optimizer, got {what!r}")
        if what == "optimizer":
            saved = self.sync.saved_optimizer()          # whole on dp rank 0 (collective over dp under zero = 1)
            # with ep the first ep group's replicas gather their experts together (collective over them)
            first = self.topo.dp_rank < (self.params.ep.size if self.params.ep else 1)
            local = self.params.whole_states(checkpoint_mpi.optimizer_arrays(self.params, saved)) if first else None
        else:
            if what == "grads":
                self.sync.gather_grads()                 # under zero = 1 each replica holds its block only
            local = self.params.whole(self.params.export() if what == "params" else self.params.export_grads())
        mine = local if self.topo.dp_rank == 0 and local is not None else {}   # tp (ep) rank 0 holds the whole
        parts = gather_to_root(self.topo.world, mine, root)
        if parts is None:
            return None
        merged: dict[int, dict[str, np.ndarray]] = {}
        for part in parts:
            merged.update(part)
        return merged

    def input_gradients(self) -> list[Any]:
        """dL/dx of the global loss w.r.t. this replica's inputs, per micro-batch (keep_input_grads only).

        Each replica differentiates its own mean loss and parameter gradients are averaged over
        dp, so the global loss's gradient w.r.t. one replica's inputs is the local one over dp.
        """
        grads = self.engine.input_grads
        return [self.backend.to_host(grads[m]) / self.setup.dp for m in sorted(grads)]

    def close(self) -> None:
        """Free the run directory and the communicators (collective: every rank returns after the lock is gone)."""
        if self.run_lock is not None:
            self.run_lock.release()
            self.run_lock = None
        # a run started next in this process probes the lock on every rank: a rank ahead of rank 0 found this one's
        barrier(self.topo.world, self.poller)
        self.topo.free()
