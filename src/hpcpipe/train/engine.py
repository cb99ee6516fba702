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

from hpcpipe.nn.model import RankParameters
from hpcpipe.runtime.comm import PipeComm
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


def _cache_bytes(caches: list) -> int:
    """Bytes of the distinct arrays a stage keeps for its backward (a layer's output is the next one's input)."""
    seen: dict[int, int] = {}
    for x, saved in caches:
        for arr in (x, *(saved if isinstance(saved, tuple) else (saved,))):
            if arr is not None and hasattr(arr, "nbytes"):
                seen[id(arr)] = arr.nbytes
    return sum(seen.values())


class Engine:
    """Runs one rank's action list: compute through the stage modules, messages through PipeComm."""

    def __init__(self, program: list[Action], params: RankParameters, comm: PipeComm, *,
                 shape: PipeShape, widths: list[int], micro_batch_size: int,
                 loss_fn: Callable, loss_scale: float, dtype: Any, keep_input_grads: bool = False,
                 record_events: bool = False):
        self.program = program
        self.params = params
        self.comm = comm
        self.shape = shape                    # which rank owns each stage: the schedule's (lowering used it too)
        self.n_stages, self.n_micro = shape.n_stages, shape.n_micro
        self.widths = widths                  # widths[s] = input width of stage s; widths[-1] = output width
        self.batch = micro_batch_size
        self.loss_fn, self.loss_scale = loss_fn, loss_scale
        self.dtype = dtype
        self.keep_input_grads = keep_input_grads
        self.record_events = record_events
        self.xp = params.xp
        self.input_grads: dict[int, Any] = {}   # dL/dx of the model input per micro-batch (when kept)
        self.optimizer_step: Callable[[], None] | None = None
        self.dispatch: dict[str, Callable[[Action], None]] = {
            "F": self._forward, "B": self._backward, "I": self._backward_input, "W": self._backward_weight,
            "SEND_F": self._send_f, "RECV_F": self._recv_f, "SEND_B": self._send_b, "RECV_B": self._recv_b,
            "ALLREDUCE": self._allreduce, "OPT_STEP": self._opt_step,
        }

    def run(self, feed: StepFeed) -> StepStats:
        """Execute the whole program once (one optimizer step) and return this rank's stats."""
        self.feed = feed
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

    # compute -----------------------------------------------------------------------------------
    def _forward(self, a: Action) -> None:
        key = (a.stage, a.mb)
        x = self.feed.x[a.mb] if a.stage == 0 else self.inputs.pop(key)
        y, caches = self.params.stages[a.stage].forward(x)
        self.stash[key] = caches
        nbytes = _cache_bytes(caches)
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
            self.out_grads[key] = grad
        elif self._local(a.stage, a.stage + 1):
            self.inputs[(a.stage + 1, a.mb)] = y
        else:
            self.outputs[key] = y

    def _release(self, key: tuple[int, int]) -> list:
        caches = self.stash.pop(key)
        nbytes = _cache_bytes(caches)
        self.held[key[0]] -= 1
        self.held_bytes[key[0]] -= nbytes
        self.stash_bytes -= nbytes
        return caches

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
        caches = self._release(key)
        gx = self.params.stages[a.stage].backward(caches, self.out_grads.pop(key), self._needs_input_grad(a.stage))
        self._hand_back(a, gx)

    def _backward_input(self, a: Action) -> None:
        key = (a.stage, a.mb)
        caches = self.stash[key]
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
        self.comm.isend(self.outputs.pop((a.stage, a.mb)), a.peer, self.comm.tag(0, a.stage, a.mb, self.n_micro))

    def _recv_f(self, a: Action) -> None:
        shape = (self.batch, self.widths[a.stage])
        self.inputs[(a.stage, a.mb)] = self.comm.recv(shape, self.dtype, a.peer,
                                                      self.comm.tag(0, a.stage - 1, a.mb, self.n_micro))

    def _send_b(self, a: Action) -> None:
        self.comm.isend(self.in_grads.pop((a.stage, a.mb)), a.peer, self.comm.tag(1, a.stage, a.mb, self.n_micro))

    def _recv_b(self, a: Action) -> None:
        shape = (self.batch, self.widths[a.stage + 1])
        self.out_grads[(a.stage, a.mb)] = self.comm.recv(shape, self.dtype, a.peer,
                                                         self.comm.tag(1, a.stage + 1, a.mb, self.n_micro))

    def _allreduce(self, a: Action) -> None:
        self.comm.wait_sends()
        self.comm.average_over_dp(self.params.grad)

    def _opt_step(self, a: Action) -> None:
        if self.optimizer_step is not None:
            self.optimizer_step()
