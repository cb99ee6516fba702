"""Zero-bubble schedules (split backward): ZB-H1 and ZB-V, greedy list schedules on unit costs."""

from __future__ import annotations

import numpy as np

from hpcpipe.errors import ScheduleError
from hpcpipe.schedule.ir import IDLE, Action, F, I, Timeline, W, _check_sizes, _index_dtype, _timeline


def zero_bubble_h1_timeline(pp: int, n_micro: int, virtual: int = 1) -> Timeline:
    """ZB-H1's timeline: the greedy list schedule's own ticks (rules in :func:`zero_bubble_h1`)."""
    _check_sizes("zb-h1", pp, n_micro, virtual)
    if virtual != 1:
        raise ScheduleError(f"zb-h1 runs one stage per rank (virtual stages: {virtual})")
    return _greedy_split(pp, n_micro)


def zero_bubble_h1(pp: int, n_micro: int, virtual: int = 1) -> list[list[Action]]:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): split B into I and W, fill bubbles with W.

    The input-gradient half I is all the previous stage waits for, and the
    weight-gradient half W has no consumer, so W can fill what would be idle
    time. The order comes from a greedy list schedule on unit costs
    (F = I = W = 1, free messages): when a rank is free it runs the next F if
    its input has arrived, it is at most pp - r ahead of I (1F1B's warm-up)
    and fewer than min(p, m) micro-batches wait for their W; else an I whose
    gradient has arrived; else the oldest pending W. Timeline for pp = 4,
    m = 6 (from the simulator's ``--ascii``)::

        rank 0  F0 F1 F2 F3 .  .  .  I0 W0 F4 I1 W1 F5 I2 W2 I3 W3 I4 W4 I5 W5
        rank 1  .  F0 F1 F2 .  .  I0 F3 I1 W0 F4 I2 W1 F5 I3 W2 I4 W3 I5 W4 W5
        rank 2  .  .  F0 F1 .  I0 F2 I1 F3 I2 W0 F4 I3 W1 F5 I4 W2 I5 W3 W4 W5
        rank 3  .  .  .  F0 I0 F1 I1 F2 I2 F3 I3 W0 F4 I4 W1 F5 I5 W2 W3 W4 W5

    Idle time per rank (p - 1)(F + I - W) instead of 1F1B's (p - 1)(F + B):
    a third of it when F = I = W. Every rank holds at most min(p, m)
    micro-batches between F and W: the peak of 1F1B's first rank (Qi et
    al.'s "same peak memory as 1F1B"), now on every rank. Read off
    :func:`zero_bubble_h1_timeline`.
    """
    return zero_bubble_h1_timeline(pp, n_micro, virtual).actions()


_PERIOD_PROBE = 64      # _greedy_split looks for its steady state every this many ticks


def _steady_repeats(n_micro: int, mark: tuple, nf: np.ndarray, ni: np.ndarray, nw: np.ndarray) -> int:
    """How many more times the greedy provably repeats its last 3 ticks, each time one micro-batch further.

    ``mark`` holds (nf, ni, nw) at the start of tick t - 3; the arrays are
    the counters at the start of tick t. The greedy's choice at a tick is a
    function of the counters that depends only on their differences, except
    rank 0's "input has arrived", m > nf[0]. So if every counter of every rank
    is exactly one more at t than at t - 3, ticks t, t + 1, t + 2 make the
    choices of t - 3, t - 2, t - 1, one micro-batch further, and so on by
    induction, as long as rank 0's test keeps its value: nf[0] at the start
    of the window's ticks is at most nf[0] at t, so q repeats are exact while
    nf[0](t) + q <= m - 1. Returns 0 when the counters are not periodic.
    """
    for now, then in zip((nf, ni, nw), mark, strict=True):
        if not np.array_equal(now, then + 1):
            return 0
    return max(int(n_micro - 1 - nf[0]), 0)


def _greedy_split(pp: int, n_micro: int, fast_forward: bool = True) -> Timeline:
    """Unit-cost greedy list schedule of F / I / W on one stage per rank, all ranks one tick at a time.

    Once every rank has settled into its steady state (one F, one I and one W
    every 3 ticks) ``fast_forward`` writes the repeats of that period at once
    (:func:`_steady_repeats` says why that is the greedy's own result) and
    the greedy resumes for the drain; ``fast_forward=False`` runs every tick
    (the reference the tests compare against).
    """
    ahead = pp - np.arange(pp)        # 1F1B's warm-up: F may run while f - i < pp - r
    hold = min(pp, n_micro)           # ... and while fewer than min(p, m) micro-batches wait for their W
    nf, ni, nw = (np.zeros(pp, np.int64) for _ in range(3))   # next F, I, W micro-batch per rank
    f_src, i_src, gap = (np.empty(pp, np.int64) for _ in range(3))
    f_src[0] = n_micro                # rank 0 has every input from the start
    run_f, run_i, run_w, ok = (np.empty(pp, bool) for _ in range(4))
    # tick-major while running (a tick writes one contiguous row), transposed once at the end; the
    # greedy needs about 3m + p ticks (about 5p when it fast-forwards), and the buffers double if short
    rows = 3 * n_micro + 2 * pp if not fast_forward else min(3 * n_micro + 2 * pp, 6 * pp + 2 * _PERIOD_PROBE)
    ops = np.full((rows, pp), IDLE, np.int8)
    mb = np.zeros(ops.shape, _index_dtype(n_micro))
    remaining, row = 3 * pp * n_micro, 0      # row: next buffer row (the tick, less the skipped ticks)
    mark, jump = None, None                   # jump: (buffer row, repeats) of the fast-forward
    while remaining:
        # A rank runs its F's and I's in micro-batch order, so "the producer finished micro-batch j at
        # an earlier tick" is "the producer's counter at the start of this tick is past j": the input
        # of F(j) on rank r comes from rank r - 1's F's, the gradient of I(j) from rank r + 1's I's
        # (on the last rank from its own F(j)).
        f_src[1:] = nf[:-1]
        i_src[:-1] = ni[1:]
        i_src[-1] = nf[-1]
        np.greater(f_src, nf, out=run_f)
        run_f &= np.less(np.subtract(nf, ni, out=gap), ahead, out=ok)
        run_f &= np.less(np.subtract(nf, nw, out=gap), hold, out=ok)
        np.greater(i_src, ni, out=run_i)
        run_i &= np.less(ni, nf, out=ok)
        run_i &= np.logical_not(run_f, out=ok)
        np.less(nw, ni, out=run_w)
        run_w &= np.logical_not(np.logical_or(run_f, run_i, out=ok), out=ok)
        done = int(np.count_nonzero(run_f) + np.count_nonzero(run_i) + np.count_nonzero(run_w))
        if not done:
            # nothing ran, so nothing new becomes available: every later tick would be the same
            raise ScheduleError(f"zb-h1 list schedule made no progress (pp: {pp}, micro-batches: {n_micro})")
        if row == len(ops):
            ops = np.concatenate([ops, np.full_like(ops, IDLE)])
            mb = np.concatenate([mb, np.zeros_like(mb)])
        for run, op, counter in ((run_f, F, nf), (run_i, I, ni), (run_w, W, nw)):
            np.copyto(ops[row], op, where=run)
            np.copyto(mb[row], counter, where=run)
            counter += run
        remaining -= done
        row += 1
        if not fast_forward or jump is not None:
            continue
        if row % _PERIOD_PROBE == 0:
            mark = nf.copy(), ni.copy(), nw.copy()
        elif mark is not None and row % _PERIOD_PROBE == 3:
            repeats = _steady_repeats(n_micro, mark, nf, ni, nw)
            if repeats:
                jump = row, repeats
                for counter in (nf, ni, nw):
                    counter += repeats
                remaining -= repeats * int(np.count_nonzero(ops[row - 3:row] != IDLE))
            mark = None
    return _timeline("zb-h1", pp, n_micro, 1, *_rank_major(ops[:row], mb[:row], jump), None, "interleaved")


def _rank_major(ops: np.ndarray, mb: np.ndarray, jump: tuple[int, int] | None, period: int = 3,
                chunk: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
    """The greedy's tick-major buffers as (pp, ticks) arrays, the skipped periods written in at the jump.

    Returns (ops, mb), or (ops, mb, chunk) when ``chunk`` is given; a repeat keeps the window's chunks.
    """
    if jump is None:
        out = (np.ascontiguousarray(ops.T), np.ascontiguousarray(mb.T))
        return out if chunk is None else (*out, np.ascontiguousarray(chunk.T))
    at, repeats = jump
    pp, span = ops.shape[1], period * repeats
    n_ticks = len(ops) + span
    out_ops = np.empty((pp, n_ticks), ops.dtype)
    out_mb = np.empty((pp, n_ticks), mb.dtype)
    out_chunk = None if chunk is None else np.empty((pp, n_ticks), chunk.dtype)
    for out, buf in ((out_ops, ops), (out_mb, mb), (out_chunk, chunk)):
        if out is not None:
            out[:, :at] = buf[:at].T
            out[:, at + span:] = buf[at:].T
    shift = np.arange(1, repeats + 1, dtype=mb.dtype)    # repeat q runs the window's micro-batches + q
    # one window tick at a time, so that NumPy's inner loop runs along the repeats, not over a few cells
    for i in range(period):
        ticks = slice(at + i, at + span, period)
        out_ops[:, ticks] = ops[at - period + i][:, None]
        if out_chunk is not None:
            out_chunk[:, ticks] = chunk[at - period + i][:, None]
        np.add(mb[at - period + i][:, None], shift, out=out_mb[:, ticks])
        idle = np.flatnonzero(ops[at - period + i] == IDLE)
        if idle.size:
            out_mb[idle, ticks] = 0      # idle cells keep micro-batch 0
    return (out_ops, out_mb) if chunk is None else (out_ops, out_mb, out_chunk)


def zero_bubble_v_timeline(pp: int, n_micro: int, virtual: int = 2) -> Timeline:
    """ZB-V's timeline: the V-placed greedy list schedule's own ticks (rules in :func:`zero_bubble_v`)."""
    _check_sizes("zb-v", pp, n_micro, virtual)
    if virtual != 2:
        raise ScheduleError(f"zb-v runs two model chunks per rank in a V (virtual stages must be 2, got {virtual})")
    return _greedy_v(pp, n_micro)


def zero_bubble_v(pp: int, n_micro: int, virtual: int = 2) -> list[list[Action]]:
    """ZB-V (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory"): two chunks per rank in a V, split B.

    Rank r owns stages r and 2p-1-r (placement ``"v"``): forwards go down
    ranks 0..p-1 through chunk a (stages 0..p-1), turn on rank p-1 without a
    message, and come back up through chunk b (stages p..2p-1), so rank 0 holds
    both the first and the loss stage and every rank has work from both ends
    of the pipeline. Backward is split into I and W as in ZB-H1. The order is
    a greedy list schedule on unit costs (F = I = W = 1 per chunk, free
    messages): a free rank runs, in this order of preference, the next chunk-b
    forward, then the next chunk-a forward, if its input has arrived and the
    rank holds fewer than 2p chunk activations (F to W); else a chunk-a I, then
    a chunk-b I, whose gradient has arrived; else the oldest pending W. When a
    chunk-b forward is ready but the rank is at the cap, the oldest W runs
    first to make room. Each chunk runs its F's and I's in micro-batch order,
    so every channel is FIFO.
    Timeline for pp = 4, m = 8 (``python -m hpcpipe.simulate --schedule zb-v
    --pp 4 --micro-batches 8 --virtual-stages 2 --ascii``; a = stages 0..3, b =
    stages 4..7; ``b`` on rank r is stage 7 - r)::

        rank 0  F0a F1a F2a F3a F4a F5a F6a F0b I0b W0b F1b I1b W1b F2b I2b W2b F3b I0a I3b W0a F7a W3b F4b I1a I4b W1a W4b F5b I2a I5b W2a W5b F6b I3a I6b W3a W6b F7b I7b I4a W7b I5a W4a I6a W5a I7a W6a W7a .   .   .
        rank 1  .   F0a F1a F2a F3a F4a F0b F5a F1b I0b W0b F2b I1b W1b F3b I0a I2b W0a F6a W2b F4b I1a I3b W1a F7a W3b F5b I2a I4b W2a I5b F6b I3a W4b W5b I6b F7b W3a I4a I7b I5a W6b I6a W4a I7a W7b W5a W6a W7a .   .
        rank 2  .   .   F0a F1a F2a F0b F3a F1b F4a F2b I0b W0b F3b I0a I1b W0a F5a W1b F4b I1a I2b W1a F6a W2b F5b I2a I3b W2a F7a W3b F6b I3a I4b I5b W3a F7b I6b I4a W4b I5a I7b I6a W5b I7a W6b W4a W5a W7b W6a W7a .
        rank 3  .   .   .   F0a F0b F1a F1b F2a F2b F3a F3b I0b I0a W0b F4a W0a F4b I1b I1a W1b F5a W1a F5b I2b I2a W2b F6a W2a F6b I3b I3a W3b F7a W3a F7b I4b I4a I5b I5a I6b I6a I7b I7a W4b W4a W5b W5a W6b W6a W7b W7a

    Bubble (F = I = W): with pp = 4, m = 8 the step is 51 chunk ticks for 48
    ticks of work per rank (idle 5.9 %), against ZB-H1's 27 and 1F1B's 33
    stage ticks for 24 (11 % and 27 %); with pp = 8, m = 32: 3.5 % against
    6.8 % and 18 %; at most 0.6 of ZB-H1's bubble whenever m >= p, for
    p = 2..8, m up to 32 (the simulator's numbers, checked in the tests). Memory: at
    most 2p chunk activations per rank, i.e. p stages' worth, 1F1B's first-rank
    peak, on every rank (min(2p, 2m)). Requires virtual stages = 2. Read off
    :func:`zero_bubble_v_timeline`.
    """
    return zero_bubble_v_timeline(pp, n_micro, virtual).actions()


_V_PERIOD = 6           # ZB-V's steady state: every rank runs F, I and W of both chunks every 6 ticks


def _v_steady_repeats(n_micro: int, mark: tuple, now: tuple, i_chunk: np.ndarray, i_mb: np.ndarray) -> int:
    """How many more times ZB-V's greedy provably repeats its last 6 ticks, each time one micro-batch further.

    ``mark`` and ``now`` hold (nf, ni, nw) at the start of ticks t - 6 and t.
    The greedy's choice at a tick depends on the counters only through
    their differences (inputs arrived: a producer's counter past the
    consumer's; the memory cap: nf[a] + nf[b] - nw; a pending W: nw below
    ni[a] + ni[b]), on which I the oldest pending W belongs to (the rank's
    queue of I's without their W, ``i_chunk`` / ``i_mb`` from index nw), and
    on rank 0's chunk-a test "input has arrived", m > nf[a][0]. So if every
    F and I counter of every rank is one more at t than at t - 6, every nw
    two more (one W per chunk), and every rank's pending queue at t is its
    queue at t - 6 with each micro-batch + 1, ticks t..t + 5 repeat
    t - 6..t - 1 one micro-batch further and leave the same relation, and
    so on by induction while rank 0's test keeps its value: nf[a][0] in the
    window is at most its value at t, so q repeats are exact while
    nf[a][0](t) + q <= m - 1. Returns 0 when the state is not periodic.
    """
    (nf0, ni0, nw0), (nf, ni, nw) = mark, now
    if not (np.array_equal(nf, nf0 + 1) and np.array_equal(ni, ni0 + 1) and np.array_equal(nw, nw0 + 2)):
        return 0
    queue = ni.sum(axis=0) - nw                      # the same length at t - 6 (ni + 1 per chunk, nw + 2)
    depth = int(queue.max())
    if depth:
        j = np.arange(depth)
        inside = j < queue[:, None]
        rows = np.arange(len(nw))[:, None]
        then_at, now_at = np.where(inside, nw0[:, None] + j, 0), np.where(inside, nw[:, None] + j, 0)
        if (i_chunk[rows, now_at] != i_chunk[rows, then_at])[inside].any() or \
                (i_mb[rows, now_at] != i_mb[rows, then_at] + 1)[inside].any():
            return 0
    return max(int(n_micro - 1 - nf[0, 0]), 0)


def _greedy_v(pp: int, n_micro: int, fast_forward: bool = True) -> Timeline:
    """Unit-cost greedy list schedule of F / I / W on two V-placed chunks per rank, all ranks one tick at a time.

    Once every rank has settled into its steady state (F, I and W of each
    chunk every 6 ticks) ``fast_forward`` writes the repeats of that period
    at once (:func:`_v_steady_repeats` says why that is the greedy's own
    result) and the greedy resumes for the drain; ``fast_forward=False`` runs
    every tick (the reference the tests compare against).
    """
    cap = 2 * pp                        # chunk activations a rank may hold (F to W): p stages, 1F1B's rank 0
    nf, ni = np.zeros((2, pp), np.int64), np.zeros((2, pp), np.int64)   # next F / I micro-batch per chunk
    nw = np.zeros(pp, np.int64)         # W's done; the k-th W is the k-th I (i_chunk, i_mb record them)
    i_chunk = np.zeros((pp, 2 * n_micro), np.int8)
    i_mb = np.zeros((pp, 2 * n_micro), _index_dtype(n_micro))
    ranks = np.arange(pp)
    f_src, i_src = np.empty((2, pp), np.int64), np.empty((2, pp), np.int64)
    # tick-major while running, as _greedy_split; about 6m + 4p ticks (far fewer rows when it fast-forwards),
    # and the buffers double if short
    rows = 6 * n_micro + 4 * pp
    if fast_forward:
        rows = min(rows, 16 * pp + 2 * _PERIOD_PROBE)
    ops = np.full((rows, pp), IDLE, np.int8)
    chunk = np.zeros(ops.shape, np.int8)
    mb = np.zeros(ops.shape, _index_dtype(n_micro))
    remaining, tick = 6 * pp * n_micro, 0       # tick: next buffer row (the tick, less the skipped ticks)
    mark, jump = None, None                     # jump: (buffer row, repeats) of the fast-forward
    held, done_i = np.zeros(pp, np.int64), np.zeros(pp, np.int64)   # nf[a] + nf[b] - nw, and ni[a] + ni[b]
    room, pending_w, busy, ok = (np.empty(pp, bool) for _ in range(4))
    runs = np.empty((4, pp), bool)
    while remaining:
        # the producer of each input, read from the counters at the start of the tick (so it ran earlier):
        # chunk a's F from the rank above (rank 0: the data), chunk b's F from the rank below (rank p-1: its
        # own chunk a); chunk b's I from the rank above (rank 0: its own loss F), chunk a's I from the rank
        # below (rank p-1: its own chunk b's I)
        f_src[0, 0], f_src[0, 1:] = n_micro, nf[0, :-1]
        f_src[1, -1], f_src[1, :-1] = nf[0, -1], nf[1, 1:]
        i_src[1, 0], i_src[1, 1:] = nf[1, 0], ni[1, :-1]
        i_src[0, -1], i_src[0, :-1] = ni[1, -1], ni[0, 1:]
        np.less(held, cap, out=room)
        np.less(nw, done_i, out=pending_w)
        # a chunk-b forward held back only by the memory cap: free a chunk with the oldest W first, or the
        # last micro-batches' chains wait for W's the greedy would run last (p = 8, m = 9: 67 ticks, not 61)
        np.greater(f_src[1], nf[1], out=runs[0])
        run_w = runs[0] & ~room & pending_w            # free_first, then every W of the tick
        np.copyto(busy, run_w)
        for k, (op, c) in enumerate(((F, 1), (F, 0), (I, 0), (I, 1))):
            if k:
                np.greater(f_src[c] if op == F else i_src[c], nf[c] if op == F else ni[c], out=runs[k])
            r = runs[k]
            r &= np.logical_not(busy, out=ok)
            if op == F:
                r &= room
            busy |= r
        run_w |= pending_w & ~busy
        busy |= run_w
        if not busy.any():
            raise ScheduleError(f"zb-v list schedule made no progress (pp: {pp}, micro-batches: {n_micro})")
        if tick == len(ops):
            ops = np.concatenate([ops, np.full_like(ops, IDLE)])
            chunk = np.concatenate([chunk, np.zeros_like(chunk)])
            mb = np.concatenate([mb, np.zeros_like(mb)])
        for k, (op, c) in enumerate(((F, 1), (F, 0), (I, 0), (I, 1))):
            r = runs[k]
            np.copyto(ops[tick], op, where=r)
            np.copyto(chunk[tick], c, where=r)
            counter = nf[c] if op == F else ni[c]
            np.copyto(mb[tick], counter, where=r)
            if op == I:
                at = ranks[r]
                i_chunk[at, done_i[r]], i_mb[at, done_i[r]] = c, counter[r]
                done_i += r
            else:
                held += r
            counter += r
        w_ranks = ranks[run_w]
        ops[tick, run_w] = W
        chunk[tick, run_w] = i_chunk[w_ranks, nw[run_w]]
        mb[tick, run_w] = i_mb[w_ranks, nw[run_w]]
        nw += run_w
        held -= run_w
        remaining -= int(busy.sum())
        tick += 1
        if not fast_forward or jump is not None:
            continue
        if tick % _PERIOD_PROBE == 0:
            mark = nf.copy(), ni.copy(), nw.copy()
        elif mark is not None and tick % _PERIOD_PROBE == _V_PERIOD:
            repeats = _v_steady_repeats(n_micro, mark, (nf, ni, nw), i_chunk, i_mb)
            if repeats:
                jump = tick, repeats
                # the skipped I's, for the W's after the jump: each repeat appends the window's two I's
                # per rank (queue indices k - 2, k - 1) one micro-batch further
                shift = np.arange(1, repeats + 1, dtype=i_mb.dtype)[:, None]
                # rank by rank: each rank's entries are one contiguous run (an index array over all ranks
                # would cost more than the greedy's ticks)
                for r, k in enumerate(done_i.tolist()):
                    i_chunk[r, k:k + 2 * repeats].reshape(repeats, 2)[:] = i_chunk[r, k - 2:k]
                    np.add(i_mb[r, k - 2:k], shift, out=i_mb[r, k:k + 2 * repeats].reshape(repeats, 2))
                nf += repeats
                ni += repeats
                nw += 2 * repeats
                done_i += 2 * repeats
                remaining -= repeats * int(np.count_nonzero(ops[tick - _V_PERIOD:tick] != IDLE))
            mark = None
    out_ops, out_mb, out_chunk = _rank_major(ops[:tick], mb[:tick], jump, _V_PERIOD, chunk[:tick])
    return _timeline("zb-v", pp, n_micro, 2, out_ops, out_mb, out_chunk, placement="v")
