"""Gradient exchange and update over the data-parallel replicas: replicated (train.zero = 0) or ZeRO-1 (= 1).

zero = 0 (:class:`Replicated`): every replica averages the whole gradient (one allreduce), clips and
updates every parameter with a whole copy of the optimizer state.

zero = 1 (:class:`Sharded`, ZeRO stage 1 / Megatron's distributed optimizer): the flat buffer is cut into
dp near-equal blocks; replica r owns block r, its optimizer state and its update. Roughly::

    grad_share = reduce_scatter(grad) / dp          # block r of the replicas' summed gradient, nothing else
    grad_share[tied] += peer's grad_share[tied]     # a tied embedding's two ends, block against block
    norm^2 = world sum of |grad_share|^2             # each replica counts its own block
    flat[block r] -= update(grad_share, state_r)    # state_r: 1/dp of the optimizer state
    flat = allgather(flat[block r] of every r)       # in place: every replica has every parameter again

A rank holding one end of a tied embedding whose other end lives on another pipeline rank cuts the
table as its own segment (each segment is cut into dp blocks), so both ends cut it the same way and
sum the same blocks: the two copies stay bit-identical, as under zero = 0. The sums are the same
additions as the allreduce's where the MPI library keeps their order (always at dp = 2); else equal
to the float32 rounding. Checkpoints stay layout-free: the writer of each stage gathers the whole
state for the save (:meth:`Sharded.saved_optimizer`), and a load keeps only this replica's blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from hpcpipe.nn.optim import Optimizer, clip_factor, make_optimizer
from hpcpipe.nn.rank_parameters import TIED, RankParameters
from hpcpipe.runtime.comm import PipeComm


@dataclass
class SavedOptimizer:
    """What a checkpoint save reads of an optimizer: ``state`` (whole buffers laid out like the parameters) and
    ``steps``; ZeRO-1's whole state exists on data-parallel rank 0 only (``state`` is empty elsewhere)."""

    steps: int
    state: dict[str, Any] = field(default_factory=dict)


class Replicated:
    """train.zero = 0: the whole gradient averaged over the replicas, every replica updates everything."""

    def __init__(self, params: RankParameters, comm: PipeComm, train: Any, dp_rank: int, tied_peer: int | None):
        self.params, self.comm, self.tied_peer = params, comm, tied_peer
        self.counts_norm = dp_rank == 0        # every replica holds the same averaged gradient: count it once
        self.optimizer: Optimizer = make_optimizer(train, params.xp, params.flat.size, params.flat.dtype)

    @property
    def grad(self) -> Any:
        """The gradient the update reads (after :meth:`reduce`)."""
        return self.params.grad

    def reduce(self) -> None:
        """Average the gradient over the replicas; sum a tied embedding's two ends."""
        self.comm.average_over_dp(self.params.grad)
        if self.tied_peer is not None:
            # after the dp average, so both ends add the same two arrays (a + b == b + a bit for bit) and
            # their copies of the table stay identical through every optimizer step
            self.comm.sum_with_pp_peer(self.params.tied_grad(), self.tied_peer)

    def norm_sq(self) -> float:
        """This rank's term of the squared global gradient norm."""
        return self.params.norm_sq()

    def step(self, grad_norm: float, max_norm: float, lr: float) -> None:
        """Clip by the global norm and update every parameter."""
        factor = clip_factor(grad_norm, max_norm)
        if factor != 1.0:
            self.params.grad *= factor
        self.optimizer.step(self.params.flat, self.params.grad, lr)

    def saved_optimizer(self) -> Any:
        """The optimizer as a checkpoint save reads it (collective under zero = 1)."""
        return self.optimizer

    def load_state(self, states: dict[str, dict[int, dict[str, Any]]]) -> None:
        """Fill the optimizer state from per-layer host arrays {state: {layer: {name: array}}}."""
        for name, buf in self.optimizer.state.items():
            self.params.load_state(buf, states[name])

    def gather_grads(self) -> None:
        """Make params.grad the averaged whole gradient (it is already)."""

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds."""
        return sum(int(buf.nbytes) for buf in self.optimizer.state.values())


def blocks(n: int, dp: int) -> list[int]:
    """Near-equal block sizes of n elements over dp replicas (the first ones one longer)."""
    return [n * (r + 1) // dp - n * r // dp for r in range(dp)]


class Sharded(Replicated):
    """train.zero = 1: gradient reduce-scatter, this replica's block of the update, parameter allgather."""

    def __init__(self, params: RankParameters, comm: PipeComm, train: Any, dp_rank: int, tied_peer: int | None):
        self.params, self.comm, self.tied_peer = params, comm, tied_peer
        self.dp, self.dp_rank = comm.dp_comm.Get_size(), dp_rank
        self.counts_norm = True               # each replica's block is counted by its owner
        size = params.flat.size
        tied = _tied_range(params) if tied_peer is not None else None
        cuts = sorted({0, size} | (set(tied) if tied else set()))
        # (start, stop, counts) per segment; this rank's block of segment k is
        # [start + sum(counts[:r]), + counts[r]) of the flat buffer and [share_at[k], + counts[r]) of the share
        self.segments = [(lo, hi, blocks(hi - lo, self.dp)) for lo, hi in zip(cuts, cuts[1:], strict=False)]
        self.mine: list[tuple[int, int, int]] = []       # (flat start, flat stop, share start)
        at = 0
        for lo, _, counts in self.segments:
            start = lo + sum(counts[:dp_rank])
            self.mine.append((start, start + counts[dp_rank], at))
            at += counts[dp_rank]
        self.tied_share = None
        if tied is not None:
            k = next(k for k, (lo, _, _) in enumerate(self.segments) if lo == tied[0])
            self.tied_share = (self.mine[k][2], self.mine[k][2] + self.segments[k][2][dp_rank])
        self.share = params.xp.zeros(at, dtype=params.grad.dtype)
        self.counted = _share_ranges(_counted_ranges(params), self.mine)
        self.optimizer = make_optimizer(train, params.xp, at, params.flat.dtype)

    @property
    def grad(self) -> Any:
        """This replica's block of the averaged gradient (after :meth:`reduce`)."""
        return self.share

    def _share_of(self, flat_start: int, flat_stop: int, share_start: int) -> Any:
        return self.share[share_start:share_start + flat_stop - flat_start]

    def reduce(self) -> None:
        """Sum the gradient over the replicas into this replica's blocks; average; sum a tied table's ends."""
        grad = self.params.grad
        self.comm.reduce_scatter_dp([(grad[lo:hi], self._share_of(*mine), counts)
                                     for (lo, hi, counts), mine in zip(self.segments, self.mine, strict=True)])
        if self.dp > 1:
            self.share /= self.dp
        if self.tied_share is not None:
            self.comm.sum_with_pp_peer(self.share[self.tied_share[0]:self.tied_share[1]], self.tied_peer)

    def norm_sq(self) -> float:
        """The squared norm of the counted parameters' part of this replica's block."""
        xp = self.params.xp
        terms = [xp.vdot(self.share[a:b], self.share[a:b]) for a, b in self.counted]
        return sum(xp.stack(terms).astype("float64").tolist()) if terms else 0.0

    def step(self, grad_norm: float, max_norm: float, lr: float) -> None:
        """Clip, update this replica's blocks, then give every replica every block (allgather)."""
        factor = clip_factor(grad_norm, max_norm)
        if factor != 1.0:
            self.share *= factor
        flat = self.params.flat
        self.optimizer.step_parts([(flat[a:b], self._share_of(a, b, s)) for a, b, s in self.mine], lr)
        self.comm.allgather_dp([(flat[lo:hi], counts) for lo, hi, counts in self.segments])

    def saved_optimizer(self) -> SavedOptimizer:
        """The whole optimizer state on data-parallel rank 0, gathered from every replica's blocks (collective)."""
        root = self.dp_rank == 0
        out = SavedOptimizer(self.optimizer.steps)
        for name, share in self.optimizer.state.items():
            whole = self.params.xp.zeros(self.params.flat.size, dtype=share.dtype) if root else None
            self.comm.gather_dp([(share[s:s + b - a], None if whole is None else whole[lo:hi], counts)
                                 for (a, b, s), (lo, hi, counts) in zip(self.mine, self.segments, strict=True)])
            if root:
                out.state[name] = whole
        return out

    def load_state(self, states: dict[str, dict[int, dict[str, Any]]]) -> None:
        """Fill this replica's blocks of the optimizer state from per-layer host arrays (a whole buffer at a time)."""
        for name, share in self.optimizer.state.items():
            whole = self.params.xp.zeros(self.params.flat.size, dtype=share.dtype)
            self.params.load_state(whole, states[name])
            for a, b, s in self.mine:
                share[s:s + b - a] = whole[a:b]

    def gather_grads(self) -> None:
        """Write every replica's block of the averaged gradient into params.grad (collective; tests, tools)."""
        grad = self.params.grad
        for a, b, s in self.mine:
            grad[a:b] = self.share[s:s + b - a]
        self.comm.allgather_dp([(grad[lo:hi], counts) for lo, hi, counts in self.segments])


def make_sync(train: Any, params: RankParameters, comm: PipeComm, dp_rank: int, tied_peer: int | None) -> Replicated:
    """The exchange train.zero asks for."""
    cls = Sharded if train.zero else Replicated
    return cls(params, comm, train, dp_rank, tied_peer)


def _tied_range(params: RankParameters) -> tuple[int, int]:
    """Flat offsets [start, stop) of the tied embedding table this rank holds (its own or the head's copy)."""
    key = TIED if params.tied_copy else 0
    offset, shape = params.views[key]["tok_emb"]
    return offset, offset + math.prod(shape)


def _counted_ranges(params: RankParameters) -> list[tuple[int, int]]:
    """Flat ranges of the parameters a global norm counts on this rank (as RankParameters.norm_sq counts)."""
    out = []
    for i in params.layer_indices():           # never the tied copy: the embedding's gradient is the same sum
        for name, (offset, shape) in params.views[i].items():
            if params.tp is None or params.shards[i][name].counts_on(params.tp.rank):
                out.append((offset, offset + math.prod(shape)))
    return out


def _share_ranges(ranges: list[tuple[int, int]], mine: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """The parts of flat ranges inside this replica's blocks, in share coordinates, adjacent ones merged."""
    out: list[tuple[int, int]] = []
    for lo, hi in ranges:
        for a, b, s in mine:
            start, stop = max(lo, a), min(hi, b)
            if start < stop:
                if out and out[-1][1] == s + start - a:
                    out[-1] = (out[-1][0], s + stop - a)
                else:
                    out.append((s + start - a, s + stop - a))
    return out
