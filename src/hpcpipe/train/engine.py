"""Engine: interprets one rank's lowered program for one training step through a dispatch table.

The engine owns no schedule logic: it runs whatever action list lowering
produced and validation accepted. Per step it keeps, keyed by
(stage, micro-batch): received inputs, stashed layer caches, outputs waiting
to be sent, and output gradients waiting for their backward.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hpcpipe.nn.memory import cache_bytes
from hpcpipe.nn.rank_parameters import RankParameters
from hpcpipe.runtime.comm import PipeComm
from hpcpipe.runtime.step_health import StepDecision
from hpcpipe.schedule.ir import Action, PipeShape


@dataclass
class StepFeed:
    """What one step feeds into this rank: inputs (first stage) and targets (last stage) per micro-batch."""

    x: list[Any] = field(default_factory=list)
    y: list[Any] = field(default_factory=list)


@dataclass
class StepStats:
    """What one step measured on this rank."""

    loss_sum: float = 0.0
    peak_stashed: int = 0          # most micro-batches whose activations were held at once
    peak_stash_bytes: int = 0
    peak_stashed_stage: dict[int, int] = field(default_factory=dict)   # per stage this rank owns
    peak_stash_bytes_stage: dict[int, int] = field(default_factory=dict)
    events: list[tuple[Action, float, float, float]] = field(default_factory=list)  # (action, start, end, cpu_s)
    decision: StepDecision | None = None   # what the optimizer step returned at OPT_STEP (None: no update ran)


@dataclass
class Recompute:
    """A micro-batch's stash under train.recompute = "stage": only the stage's input (forward re-runs later)."""

    x: Any


class Engine:
    """Runs one rank's action list: compute through the stage modules, messages through PipeComm."""

    def __init__(self, program: list[Action], params: RankParameters, comm: PipeComm, *,
                 shape: PipeShape, boundaries: list[tuple[tuple[int, ...], Any]],
                 loss_fn: Callable, loss_scale: float, keep_input_grads: bool = False,
                 record_events: bool = False, recompute: bool = False, shared: list[bool] | None = None,
                 sync: Any = None, ledger: Any = None):
        self.program = program
        self.params = params
        self.comm = comm
        self.shape = shape                    # which rank owns each stage: the schedule's (lowering used it too)
        self.n_stages, self.n_micro = shape.n_stages, shape.n_micro
        # boundaries[s] = (shape, dtype) of stage s's input activation; [-1] = the model's output
        self.boundaries = boundaries
        # shared[s]: stage s's input is the same on every tp rank, so it travels in shares (PipeComm)
        self.shared = shared or [False] * len(boundaries)
        self.loss_fn, self.loss_scale = loss_fn, loss_scale
        self.recompute = recompute
        self.keep_input_grads = keep_input_grads
        self.record_events = record_events
        self.xp = params.xp
        # an auxiliary loss's per-chunk statistics (RouterLedger), travelling beside activations and gradients
        self.ledger = ledger
        self.input_grads: dict[int, Any] = {}   # dL/dx of the model input per micro-batch (when kept)
        self.optimizer_step: Callable[[], StepDecision] | None = None   # the running step's: run()'s argument
        self.sync = sync     # the ALLREDUCE action's exchange (hpcpipe.train.zero: replicated or ZeRO-1)
        self.dispatch: dict[str, Callable[[Action], None]] = {
            "F": self._forward, "B": self._backward, "I": self._backward_input, "W": self._backward_weight,
            "SEND_F": self._send_f, "RECV_F": self._recv_f, "SEND_B": self._send_b, "RECV_B": self._recv_b,
            "ALLREDUCE": self._allreduce, "OPT_STEP": self._opt_step,
        }

    def run(self, feed: StepFeed, optimizer_step: Callable[[], StepDecision] | None = None) -> StepStats:
        """Execute the whole program once (one optimizer step) and return this rank's stats.

        ``optimizer_step`` runs at the program's OPT_STEP action (after the gradient allreduce) and its
        decision comes back as the stats' ``decision``; None runs forward and backward only.
        """
        self.feed, self.optimizer_step = feed, optimizer_step
        self.stats = StepStats()
        self.inputs: dict[tuple[int, int], Any] = {}
        self.stash: dict[tuple[int, int], list] = {}
        self.outputs: dict[tuple[int, int], Any] = {}
        self.out_grads: dict[tuple[int, int], Any] = {}
        self.in_grads: dict[tuple[int, int], Any] = {}
        self.split: dict[tuple[int, int], tuple[list, list]] = {}
        self.stash_bytes = 0
        self.held: dict[int, int] = {}
        self.held_bytes: dict[int, int] = {}
        self.params.grad[...] = 0
        if self.ledger is not None:
            self.ledger.reset()
        clock, cpu = time.perf_counter, time.process_time
        for action in self.program:
            if self.record_events:
                # wall time for the picture, CPU time for the simulator's costs (a rank that shares
                # its core with others takes longer in wall time, not in CPU time)
                start, cpu_start = clock(), cpu()
                self.dispatch[action.op](action)
                self.stats.events.append((action, start, clock(), cpu() - cpu_start))
            else:
                self.dispatch[action.op](action)
        return self.stats

    def evaluate(self, feed: StepFeed, program: list[Action]) -> float:
        """Run a forward-only program (F, SEND_F, RECV_F) over feed, keeping nothing for a backward; return this
        rank's summed loss (a last stage's; 0 elsewhere). Held-out evaluation: hpcpipe.train.evaluation."""
        self.feed, self.inputs, self.outputs = feed, {}, {}
        total = 0.0
        for a in program:
            if a.op != "F":
                self.dispatch[a.op](a)
                continue
            x = feed.x[a.mb] if a.stage == 0 else self.inputs.pop((a.stage, a.mb))
            y, _ = self.params.stages[a.stage].forward(x)
            if a.stage == self.n_stages - 1:
                total += self.loss_fn(self.xp, y, feed.y[a.mb], self.loss_scale)[0]
            elif self._local(a.stage, a.stage + 1):
                self.inputs[(a.stage + 1, a.mb)] = y
            else:
                self.outputs[(a.stage, a.mb)] = y
        self.comm.wait_sends()
        return total

    # compute -----------------------------------------------------------------------------------
    def _forward(self, a: Action) -> None:
        key = (a.stage, a.mb)
        x = self.feed.x[a.mb] if a.stage == 0 else self.inputs.pop(key)
        self._begin(key)
        y, caches = self.params.stages[a.stage].forward(x)
        if self.recompute:
            caches = Recompute(x)     # the forward's caches are dropped here and rebuilt before the backward
        self.stash[key] = caches
        nbytes = cache_bytes(caches.x if self.recompute else caches)
        self.stash_bytes += nbytes
        self.stats.peak_stashed = max(self.stats.peak_stashed, len(self.stash))
        held = self.held[a.stage] = self.held.get(a.stage, 0) + 1
        peaks = self.stats.peak_stashed_stage
        peaks[a.stage] = max(peaks.get(a.stage, 0), held)
        held_bytes = self.held_bytes[a.stage] = self.held_bytes.get(a.stage, 0) + nbytes
        peak_bytes = self.stats.peak_stash_bytes_stage
        peak_bytes[a.stage] = max(peak_bytes.get(a.stage, 0), held_bytes)
        self.stats.peak_stash_bytes = max(self.stats.peak_stash_bytes, self.stash_bytes)
        if a.stage == self.n_stages - 1:
            loss, grad = self.loss_fn(self.xp, y, self.feed.y[a.mb], self.loss_scale)
            self.stats.loss_sum += loss
            if self.ledger is not None:
                self.stats.loss_sum += self.ledger.finish(a.stage, a.mb)
            self.out_grads[key] = grad
        elif self._local(a.stage, a.stage + 1):
            self.inputs[(a.stage + 1, a.mb)] = y
            if self.ledger is not None:
                self.ledger.receive_forward(a.stage + 1, a.mb, self.ledger.forward_message(a.stage, a.mb))
        else:
            self.outputs[key] = y

    def _begin(self, key: tuple[int, int]) -> None:
        """Tell the auxiliary loss's ledger which (stage, micro-batch) the layers compute next."""
        if self.ledger is not None:
            self.ledger.begin(*key)

    def _release(self, key: tuple[int, int]) -> list:
        caches = self.stash.pop(key)
        nbytes = cache_bytes(caches.x if isinstance(caches, Recompute) else caches)
        self.held[key[0]] -= 1
        self.held_bytes[key[0]] -= nbytes
        self.stash_bytes -= nbytes
        if isinstance(caches, Recompute):
            caches = self.params.stages[key[0]].forward_caches(caches.x)
        return caches

    def _caches_for_split(self, key: tuple[int, int]) -> list:
        """Return a stash's caches for an input-gradient half; under recompute rebuild them and hold them until W."""
        caches = self.stash[key]
        if not isinstance(caches, Recompute):
            return caches
        rebuilt = self.params.stages[key[0]].forward_caches(caches.x)
        # between I and W the rebuilt caches are stashed in place of the input: account for the difference
        delta = cache_bytes(rebuilt) - cache_bytes(caches.x)
        self.stash[key] = rebuilt
        self.stash_bytes += delta
        self.held_bytes[key[0]] += delta
        peaks = self.stats.peak_stash_bytes_stage
        peaks[key[0]] = max(peaks.get(key[0], 0), self.held_bytes[key[0]])
        self.stats.peak_stash_bytes = max(self.stats.peak_stash_bytes, self.stash_bytes)
        return rebuilt

    def _hand_back(self, a: Action, gx: Any) -> None:
        """Route dL/dx of a stage: to the previous stage (locally or by message) or keep it."""
        if a.stage > 0:
            if self._local(a.stage, a.stage - 1):
                self.out_grads[(a.stage - 1, a.mb)] = gx
            else:
                self.in_grads[(a.stage, a.mb)] = gx
        elif self.keep_input_grads:
            self.input_grads[a.mb] = gx

    def _local(self, stage: int, other: int) -> bool:
        """Whether two stages live on the same rank (their hand-over needs no message)."""
        return self.shape.stage_rank(stage) == self.shape.stage_rank(other)

    def _needs_input_grad(self, stage: int) -> bool:
        return stage > 0 or self.keep_input_grads

    def _backward(self, a: Action) -> None:
        key = (a.stage, a.mb)
        self._begin(key)
        caches = self._release(key)
        gx = self.params.stages[a.stage].backward(caches, self.out_grads.pop(key), self._needs_input_grad(a.stage))
        self._hand_back(a, gx)

    def _backward_input(self, a: Action) -> None:
        key = (a.stage, a.mb)
        self._begin(key)
        caches = self._caches_for_split(key)
        gx, dzs = self.params.stages[a.stage].backward_input(caches, self.out_grads.pop(key),
                                                            self._needs_input_grad(a.stage))
        self.split[key] = (caches, dzs)
        self._hand_back(a, gx)

    def _backward_weight(self, a: Action) -> None:
        key = (a.stage, a.mb)
        caches, dzs = self.split.pop(key)
        self._release(key)
        self.params.stages[a.stage].backward_weight(caches, dzs)

    # communication -----------------------------------------------------------------------------
    def _send_f(self, a: Action) -> None:
        self.comm.isend(self.outputs.pop((a.stage, a.mb)), a.peer, self.comm.tag(0, a.stage, a.mb, self.n_micro),
                        self.shared[a.stage + 1])
        if self.ledger is not None:
            self.comm.isend(self.xp.asarray(self.ledger.forward_message(a.stage, a.mb)), a.peer,
                            self.comm.tag(2, a.stage, a.mb, self.n_micro))

    def _recv_f(self, a: Action) -> None:
        shape, dtype = self.boundaries[a.stage]
        self.inputs[(a.stage, a.mb)] = self.comm.recv(shape, dtype, a.peer,
                                                      self.comm.tag(0, a.stage - 1, a.mb, self.n_micro),
                                                      self.shared[a.stage])
        if self.ledger is not None:
            sums = self.comm.recv((self.ledger.forward_size,), np.float64, a.peer,
                                  self.comm.tag(2, a.stage - 1, a.mb, self.n_micro))
            self.ledger.receive_forward(a.stage, a.mb, sums)

    def _send_b(self, a: Action) -> None:
        self.comm.isend(self.in_grads.pop((a.stage, a.mb)), a.peer, self.comm.tag(1, a.stage, a.mb, self.n_micro),
                        self.shared[a.stage])
        if self.ledger is not None:
            self.comm.isend(self.xp.asarray(self.ledger.backward_message(a.mb)), a.peer,
                            self.comm.tag(3, a.stage, a.mb, self.n_micro))

    def _recv_b(self, a: Action) -> None:
        shape, dtype = self.boundaries[a.stage + 1]
        self.out_grads[(a.stage, a.mb)] = self.comm.recv(shape, dtype, a.peer,
                                                         self.comm.tag(1, a.stage + 1, a.mb, self.n_micro),
                                                         self.shared[a.stage + 1])
        if self.ledger is not None:
            grad = self.comm.recv((self.ledger.n_experts,), np.float64, a.peer,
                                  self.comm.tag(3, a.stage + 1, a.mb, self.n_micro))
            self.ledger.receive_backward(a.mb, grad)

    def _allreduce(self, a: Action) -> None:
        self.comm.wait_sends()
        self.params.reduce_shared()      # parts several tp ranks hold: their gradients summed first
        self.sync.reduce()               # over the replicas (and a tied embedding's two ends)

    def _opt_step(self, a: Action) -> None:
        if self.optimizer_step is not None:
            self.stats.decision = self.optimizer_step()


def tied_peer(params: RankParameters, shape: PipeShape, pp_rank: int) -> int | None:
    """The pipeline rank holding the other end of a tied embedding whose gradient trains, when it is not this rank."""
    if not params.model.tied or not params.tied_trains:
        return None
    first, last = shape.stage_rank(0), shape.stage_rank(shape.n_stages - 1)
    if first == last:
        return None           # pp = 1 or zb-v: both ends share one table on this rank
    return last if pp_rank == first else first if pp_rank == last else None
