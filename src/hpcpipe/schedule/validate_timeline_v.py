"""validate_timeline for the V placement (ZB-V): four one-chunk channels per neighbour pair."""

from __future__ import annotations

import numpy as np

from hpcpipe.errors import ScheduleError
from hpcpipe.schedule import timeline_proofs as proofs
from hpcpipe.schedule.ir import B, F, I, Timeline, W
from hpcpipe.schedule.timeline_proofs import Seq, check_after, check_before, fifo_error, first_bad, order_error


def validate_timeline_v(tl: Timeline, ranks_per_pass: int) -> None:
    """validate_timeline's steps 2-6 for the V placement with two chunks (rank r owns stages r and 2p-1-r).

    Every message between neighbouring ranks travels on one of four
    channels, each carrying one chunk's messages only: chunk a's forwards
    r -> r + 1 and its backwards r + 1 -> r, chunk b's forwards r + 1 -> r and
    its backwards r -> r + 1. So the proof of the interleaved placement holds
    chunk by chunk: neighbours run each chunk's forwards (and backwards) in
    the same micro-batch order, the receiver at a later tick; rank 0's four
    sequences are permutations of the micro-batches (so, by the chains, every
    rank's are); and the two hand-overs without a message come after what
    they need: on rank p - 1 the turn (chunk b's F after chunk a's F of the
    micro-batch, chunk a's backward after chunk b's), on rank 0 the loss
    stage (chunk b's backward after its F). Each micro-batch then runs
    F(0) -> ... -> F(2p - 1) -> B(2p - 1) -> ... -> B(0) at increasing ticks,
    which gives F before backward on every stage and no deadlock, as in
    step 5. A rank missing or repeating an action is named by the per-action
    validator (only on that error path); W's outside step 6 are proved per
    action, as for the interleaved placement.
    """
    pp, m = tl.pp, tl.n_micro
    rows = min(ranks_per_pass, pp)
    mask = np.empty((rows, tl.n_ticks), bool)
    mask2 = np.empty((rows, tl.n_ticks), bool)
    row_start = np.arange(rows)[:, None] * tl.n_ticks
    prev = None                  # the four (mb, ticks) sequences of the rank before this pass
    per_action = False
    for r0 in range(0, pp, ranks_per_pass):
        n = min(ranks_per_pass, pp - r0)
        ops = np.ascontiguousarray(tl.ops[r0:r0 + n])
        chunk = np.ascontiguousarray(tl.chunk[r0:r0 + n]).ravel()
        mbs = np.ascontiguousarray(tl.mb[r0:r0 + n]).ravel()
        starts = row_start[:n]
        n_i = np.count_nonzero(np.equal(ops, I, out=mask[:n]), axis=1)
        n_w = np.count_nonzero(np.equal(ops, W, out=mask[:n]), axis=1)
        seqs = []                # (mb, ticks) of chunk a's and b's forwards, then their backwards, n x m each
        flat = []
        for backward in (False, True):
            kind = np.equal(ops, F, out=mask[:n]) if not backward else \
                np.logical_or(np.equal(ops, B, out=mask[:n]), np.equal(ops, I, out=mask2[:n]), out=mask[:n])
            if (np.count_nonzero(kind, axis=1) != 2 * m).any():
                _structure_error(tl)
            pos = np.flatnonzero(kind)
            flat.append(pos)
            pos = pos.reshape(n, 2 * m)
            is_b = chunk[pos].astype(bool)
            if (np.count_nonzero(is_b, axis=1) != m).any():
                _structure_error(tl)
            for sel in (~is_b, is_b):
                at = pos[sel].reshape(n, m)
                seqs.append((mbs[at], at - starts))
        if not (((n_i == 0) | (n_i == 2 * m)) & (n_w == n_i)).all() or 0 < np.count_nonzero(n_i) < n:
            per_action = True    # a rank mixing B and I, W's without their I's, or split and unsplit ranks
        elif n_i.any():
            w = np.flatnonzero(np.equal(ops, W, out=mask[:n])).reshape(n, 2 * m)
            b = flat[1].reshape(n, 2 * m)
            split = np.ones(n, bool)
            w_keys = chunk[w].astype(np.int64) * m + mbs[w]
            b_keys = chunk[b].astype(np.int64) * m + mbs[b]
            if (w_keys != b_keys).any():
                per_action = True                # W's in another order than the I's: may be valid
            else:
                w_seq = Seq(r0, w_keys, w - starts, None)
                check_after(tl, Seq(r0, b_keys, b - starts, None), w_seq, split)
        if r0 == 0:
            for mb, _ in seqs:
                if (np.bincount(mb[0].astype(np.int64), minlength=m) != 1).any():
                    _structure_error(tl)
            _, fb, _, bb = seqs
            f_tick, b_tick = np.empty(m, np.int64), np.empty(m, np.int64)
            f_tick[fb[0][0]] = fb[1][0]
            b_tick[bb[0][0]] = bb[1][0]
            check_before(tl, 0, f_tick, b_tick, "runs before its forward")      # the loss stage, 2p - 1
        top = r0
        if prev is not None:
            seqs = [(np.concatenate([p_mb, mb]), np.concatenate([p_t, t])) for (p_mb, p_t), (mb, t)
                    in zip(prev, seqs, strict=True)]
            top = r0 - 1
        # chunk a forwards and chunk b backwards go down the ranks, the other two up
        for (mb, ticks), name, down in zip(seqs, ("forward", "forward", "backward", "backward"),
                                           (True, False, False, True), strict=True):
            _check_v_pairs(tl, name, down, top, mb, ticks)
        prev = [(mb[-1:].copy(), ticks[-1:].copy()) for mb, ticks in seqs]
    (fa_mb, fa_t), (fb_mb, fb_t), (ba_mb, ba_t), (bb_mb, bb_t) = prev
    turn = pp - 1
    first, then = np.empty(m, np.int64), np.empty(m, np.int64)
    first[fa_mb[0]], then[fb_mb[0]] = fa_t[0], fb_t[0]
    check_before(tl, turn, first, then, "runs before the forward of the stage before it")
    first[bb_mb[0]], then[ba_mb[0]] = bb_t[0], ba_t[0]
    check_before(tl, turn, first, then, "runs before the backward of the stage after it")
    if per_action:
        proofs.validate_per_action(tl)


def _structure_error(tl: Timeline) -> None:
    """A rank misses or repeats an action, which the per-action validator names (its verdict is certain)."""
    proofs.validate_per_action(tl)
    raise ScheduleError(f"{tl.name} timeline: some rank does not run each of its stages' forward and backward "
                        f"once per micro-batch ({tl.n_micro} micro-batches)")


def _check_v_pairs(tl: Timeline, name: str, down: bool, top: int, mb: np.ndarray, ticks: np.ndarray) -> None:
    """Rows i and i + 1 (ranks top + i, top + i + 1) send one chunk's messages down (i -> i + 1) or up: FIFO, later."""
    if len(mb) < 2:
        return
    src, dst = (slice(0, -1), slice(1, None)) if down else (slice(1, None), slice(0, -1))
    for error, bad in ((fifo_error, mb[src] != mb[dst]), (order_error, ticks[dst] <= ticks[src])):
        hit = first_bad(bad)
        if hit is not None:
            i, k = hit
            ranks = (top + i, top + i + 1) if down else (top + i + 1, top + i)
            error(tl, name, *ranks, ticks[src][i, k], ticks[dst][i, k], k)
