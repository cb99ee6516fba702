"""Validate a schedule in array form (what validate_programs(lower(actions)) proves) with whole-array operations."""

from __future__ import annotations

import numpy as np

from hpcpipe.errors import ScheduleError
from hpcpipe.schedule import timeline_proofs as proofs
from hpcpipe.schedule.ir import IDLE, B, F, I, Timeline, W, chunk_stage, stage_rank
from hpcpipe.schedule.timeline_proofs import (
    Workspace,
    check_after,
    check_last_stage,
    check_local_order,
    check_neighbours,
    check_once,
    check_timeline_values,
    check_wrap,
    order_error,
)
from hpcpipe.schedule.validate_timeline_v import validate_timeline_v


def validate_timeline(tl: Timeline, ranks_per_pass: int = 16) -> None:
    """Raise ScheduleError unless the timeline's programs are complete, paired and deadlock-free (vectorised).

    Proves what ``validate_programs(lower(tl.actions()), ...)`` proves, and the promise
    of a Timeline (each message's producer at an earlier tick than its
    consumer), with whole-array operations over a few ranks at a time:

    1. op codes, chunks (0..v-1) and micro-batches (0..m-1) are in range;
       stages are on their rank by construction (stage = chunk * pp + rank);
    2. every rank runs v * m forwards and v * m backwards (B or I);
    3. each channel delivers in order: a rank sends all its forwards to the
       next rank, which receives all of its own, so neighbouring ranks must
       run their forwards in the same (chunk, micro-batch) order, and likewise
       their backwards; with virtual stages the channel from the last rank to
       rank 0 carries chunk c to chunk c + 1;
    4. rank 0's forwards and backwards are each a permutation of
       (chunk, micro-batch), so by 3 every rank runs each exactly once;
    5. the k-th message of a channel is received at a later tick than it is
       sent, and the last stage runs each micro-batch's F before its backward.
       A stage's F then precedes its backward (F(s) -> ... -> F(last) ->
       B(last) -> ... -> B(s) is a chain of increasing ticks), and running the
       ticks in order never waits for a message not yet sent: no deadlock;
    6. split backwards: a rank that splits runs its W's in the order of its
       I's, each after its I.

    With one rank (no messages) the same facts are checked on the local
    hand-overs. Where 6 does not apply (a rank mixing B and I, or W's in
    another order than the I's) the per-action validator decides, after 1-5.

    Steps 3-5 are written for the interleaved placement (rank r's chunk c is
    stage c * pp + r). ZB-V's ``"v"`` placement with two chunks has its own
    version of them (:func:`validate_timeline_v`); any other placement or chunk count
    is checked for 1, proved by the per-action validator on its lowered
    programs with its placement, and then checked to keep the Timeline
    promise (every message's producer at an earlier tick): the same verdict,
    at per-action speed.
    """
    pp, v, m = tl.pp, tl.virtual, tl.n_micro
    if ranks_per_pass < 1:
        raise ScheduleError(f"ranks_per_pass must be a positive integer, got {ranks_per_pass}")
    check_timeline_values(tl)
    if tl.placement == "v" and v == 2:
        validate_timeline_v(tl, ranks_per_pass)
        return
    if tl.placement != "interleaved":
        proofs.validate_per_action(tl)
        _check_ticks_any_placement(tl)
        return
    work = Workspace(tl, min(ranks_per_pass, pp))
    rank0 = prev = None          # (forward, backward) sequences of rank 0 and of the rank before this pass
    per_action = False           # some rank's W's are outside 6: prove them per action at the end
    for r0 in range(0, pp, ranks_per_pass):
        ops = np.ascontiguousarray(tl.ops[r0:r0 + ranks_per_pass])
        fwd = work.sequence(0, r0, ops, "forwards")
        n_i, n_w = work.count(ops, I), work.count(ops, W)
        # without I's in the pass a backward is a B: one comparison instead of B, I and their union
        bwd = work.sequence(1, r0, ops, "backwards", with_i=bool(n_i.any()))
        if not (((n_i == 0) | (n_i == v * m)) & (n_w == n_i)).all():
            per_action = True    # a rank mixing B and I, or W's without their I's
        elif n_i.any():
            w = work.sequence(2, r0, ops, "weight-gradient halves (W)")
            split = n_i > 0
            if (w.keys[split] != bwd.keys[split]).any():
                per_action = True                # W's in another order than the I's: may be valid
            else:
                check_after(tl, bwd, w, split)
        if rank0 is None:
            rank0 = (fwd.row(0), bwd.row(0))
            check_once(tl, rank0[0], "forward")
            check_once(tl, rank0[1], "backward")
        if pp > 1:
            check_neighbours(tl, work, fwd, prev[0] if prev else None, "forward", 1)
            check_neighbours(tl, work, bwd, prev[1] if prev else None, "backward", -1)
        prev = (fwd.row(-1), bwd.row(-1))
    if pp == 1:
        check_local_order(tl, *rank0)
    else:
        if v > 1:
            check_wrap(tl, rank0[0], prev[0], "forward", 1)
            check_wrap(tl, rank0[1], prev[1], "backward", -1)
        check_last_stage(tl, *prev)
    if per_action:
        proofs.validate_per_action(tl)


def _check_ticks_any_placement(tl: Timeline) -> None:
    """Each F's input and each backward's output gradient was produced at an earlier tick (any placement).

    Run after the per-action validator, so every (stage, micro-batch) has exactly one F and one backward.
    """
    ranks, ticks = np.nonzero(tl.ops != IDLE)
    ops = tl.ops[ranks, ticks]
    stage = chunk_stage(tl.chunk[ranks, ticks].astype(np.int64), ranks, tl.pp, tl.placement)
    mb = tl.mb[ranks, ticks].astype(np.int64)
    done = {}                        # op kind -> tick of (stage, mb): forwards, backwards (B or I)
    for kind, sel in (("forward", ops == F), ("backward", (ops == B) | (ops == I))):
        table = np.full((tl.n_stages, tl.n_micro), -1, np.int64)
        table[stage[sel], mb[sel]] = ticks[sel]
        done[kind] = (sel, table)
    for kind, step in (("forward", -1), ("backward", 1)):
        sel, table = done[kind]
        src = stage[sel] + step
        inside = (src >= 0) & (src < tl.n_stages)
        src_tick = np.where(inside, table[np.clip(src, 0, tl.n_stages - 1), mb[sel]], -1)
        late = np.flatnonzero(src_tick >= ticks[sel])
        if late.size:
            k = int(late[0])
            src_rank = stage_rank(int(src[k]), tl.pp, tl.placement)
            order_error(tl, kind, src_rank, int(ranks[sel][k]), src_tick[k], ticks[sel][k])
