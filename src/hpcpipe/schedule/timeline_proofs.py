"""The vectorised checks validate_timeline is built from: per-channel sequences, FIFO and order proofs."""

from __future__ import annotations

import numpy as np

from hpcpipe.errors import ScheduleError
from hpcpipe.schedule.ir import IDLE, Action, B, F, I, Timeline, W, chunk_stage
from hpcpipe.schedule.lower import lower
from hpcpipe.schedule.validate_programs import validate_programs


class Seq:
    """One kind of action of some consecutive ranks, in tick order: (chunk * m + mb) keys and ticks, rows x v*m."""

    def __init__(self, first_rank: int, keys: np.ndarray, ticks: np.ndarray, chunk: np.ndarray | None) -> None:
        self.first_rank, self.keys, self.ticks, self.chunk = first_rank, keys, ticks, chunk

    def row(self, i: int) -> Seq:
        """A copy of one rank's sequence (i may be negative): the workspace's buffers are reused next pass."""
        i = i % len(self.keys)
        pick = slice(i, i + 1)
        return Seq(self.first_rank + i, self.keys[pick].copy(), self.ticks[pick].copy(),
                    None if self.chunk is None else self.chunk[pick].copy())


class Workspace:
    """Buffers every pass of validate_timeline reuses: fresh temporaries per pass would cost more in page
    faults than the checks themselves (17 M cells at pp = 1024)."""

    def __init__(self, tl: Timeline, rows: int) -> None:
        self.tl = tl
        n_ticks, n = tl.n_ticks, tl.virtual * tl.n_micro
        self.mask = np.empty((rows, n_ticks), bool)
        self.mask2 = np.empty((rows, n_ticks), bool)
        self.row_start = np.arange(rows)[:, None] * n_ticks
        self.mb = np.empty((3, rows * n), tl.mb.dtype)
        self.chunk = np.empty((3, rows * n), tl.chunk.dtype)
        self.keys = np.empty((3, rows * n), np.int64) if tl.virtual > 1 else None
        self.ticks = np.empty((3, rows, n), np.intp)
        self.diff = np.empty((rows, n), bool)

    def count(self, ops: np.ndarray, code: int) -> np.ndarray:
        """Actions with this op code on each of the pass's ranks."""
        return np.count_nonzero(np.equal(ops, code, out=self.mask[:len(ops)]), axis=1)

    def sequence(self, slot: int, r0: int, ops: np.ndarray, kind: str, with_i: bool = True) -> Seq:
        """Each rank's forwards, backwards (B or I; B alone if not ``with_i``) or W's in tick order, v * m each."""
        tl = self.tl
        rows = len(ops)
        n = tl.virtual * tl.n_micro
        mask = self.mask[:rows]
        if kind == "backwards" and with_i:
            np.logical_or(np.equal(ops, B, out=mask), np.equal(ops, I, out=self.mask2[:rows]), out=mask)
        else:
            np.equal(ops, {"forwards": F, "backwards": B}.get(kind, W), out=mask)
        counts = np.count_nonzero(mask, axis=1)
        if (counts != n).any():
            rank = r0 + int(np.flatnonzero(counts != n)[0])
            raise ScheduleError(f"{tl.name} timeline: rank {rank} runs {int(counts[rank - r0])} {kind}, expected "
                                f"{n} (one per stage and micro-batch: {tl.virtual} stage(s) x {tl.n_micro} "
                                f"micro-batches)")
        size = rows * n
        pos = np.flatnonzero(mask)      # (np.compress(..., out=) would allocate and fault on every pass)
        mb = np.take(np.ascontiguousarray(tl.mb[r0:r0 + rows]).ravel(), pos, out=self.mb[slot, :size])
        ticks = np.subtract(pos.reshape(rows, n), self.row_start[:rows], out=self.ticks[slot, :rows])
        if tl.virtual == 1:
            return Seq(r0, mb.reshape(rows, n), ticks, None)
        chunk = np.take(np.ascontiguousarray(tl.chunk[r0:r0 + rows]).ravel(), pos, out=self.chunk[slot, :size])
        keys = np.multiply(chunk, np.int64(tl.n_micro), out=self.keys[slot, :size])   # (an int8 * 8192 would overflow)
        keys += mb
        return Seq(r0, keys.reshape(rows, n), ticks, chunk.reshape(rows, n))


def first_bad(bad: np.ndarray) -> tuple[int, int] | None:
    """(row, column) of the first True of a 2-D mask, or None."""
    if not bad.any():
        return None
    i, k = np.argwhere(bad)[0].tolist()
    return i, k


def check_neighbours(tl: Timeline, work: Workspace, seq: Seq, before: Seq | None, name: str,
                      direction: int) -> None:
    """Rank r and r + 1 exchange all their actions of one kind: same order (FIFO), the receiver later.

    Checks the rank before this pass against the pass's first rank, then the pass's ranks among
    themselves; direction 1: rank r sends to r + 1 (forwards), -1: r + 1 sends to r (backwards).
    """
    if before is not None:
        check_pairs(tl, work, name, direction, before.first_rank, before, slice(0, 1), seq, slice(0, 1))
    if len(seq.keys) > 1:
        check_pairs(tl, work, name, direction, seq.first_rank, seq, slice(0, -1), seq, slice(1, None))


def check_pairs(tl: Timeline, work: Workspace, name: str, direction: int, top: int,
                 upper: Seq, upper_rows: slice, lower: Seq, lower_rows: slice) -> None:
    """Row i of upper[upper_rows] is rank top + i, row i of lower[lower_rows] rank top + i + 1."""
    up_keys, low_keys = upper.keys[upper_rows], lower.keys[lower_rows]
    up_ticks, low_ticks = upper.ticks[upper_rows], lower.ticks[lower_rows]
    diff = work.diff[:len(up_keys)]
    late = np.greater_equal if direction > 0 else np.less_equal     # the receiver is not later
    for error, hit in ((fifo_error, first_bad(np.not_equal(up_keys, low_keys, out=diff))),
                       (order_error, first_bad(late(up_ticks, low_ticks, out=diff)))):
        if hit is not None:
            i, k = hit
            ranks, ticks = (top + i, top + i + 1), (up_ticks[i, k], low_ticks[i, k])
            if direction < 0:
                ranks, ticks = ranks[::-1], ticks[::-1]
            error(tl, name, *ranks, *ticks, k)


def check_wrap(tl: Timeline, first: Seq, last: Seq, name: str, direction: int) -> None:
    """With virtual stages the last rank's chunk c and rank 0's chunk c + 1 are neighbouring stages."""
    v, m = tl.virtual, tl.n_micro
    last_pos = np.flatnonzero(last.chunk[0] < v - 1)
    first_pos = np.flatnonzero(first.chunk[0] > 0)
    last_keys = last.keys[0, last_pos] + m            # as the key of the stage after it, on rank 0
    first_keys = first.keys[0, first_pos]
    last_ticks, first_ticks = last.ticks[0, last_pos], first.ticks[0, first_pos]
    src, dst = (tl.pp - 1, 0) if direction > 0 else (0, tl.pp - 1)
    src_ticks, dst_ticks = (last_ticks, first_ticks) if direction > 0 else (first_ticks, last_ticks)
    bad = last_keys != first_keys
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        fifo_error(tl, name, src, dst, src_ticks[k], dst_ticks[k], k)
    early = dst_ticks <= src_ticks
    if early.any():
        k = int(np.flatnonzero(early)[0])
        order_error(tl, name, src, dst, src_ticks[k], dst_ticks[k], k)


def check_last_stage(tl: Timeline, fwd: Seq, bwd: Seq) -> None:
    """The last stage's F and backward of a micro-batch are on one rank with no message between: F first."""
    m = tl.n_micro
    last = (tl.virtual - 1) * m                       # keys of chunk v - 1
    f_sel, b_sel = fwd.keys[0] >= last, bwd.keys[0] >= last
    f_tick, b_tick = np.empty(m, np.int64), np.empty(m, np.int64)
    f_tick[fwd.keys[0, f_sel] - last] = fwd.ticks[0, f_sel]
    b_tick[bwd.keys[0, b_sel] - last] = bwd.ticks[0, b_sel]
    check_before(tl, tl.pp - 1, f_tick, b_tick, "runs before its forward")


def check_before(tl: Timeline, rank: int, first: np.ndarray, then: np.ndarray, what: str) -> None:
    bad = then <= first
    if bad.any():
        tick = int(then[np.flatnonzero(bad)[0]])
        raise ScheduleError(f"{tl.name} timeline: rank {rank}: {_action(tl, rank, tick)} {what} (tick {tick})")


def check_after(tl: Timeline, bwd: Seq, w: Seq, split: np.ndarray) -> None:
    """On splitting ranks the k-th W (same key as the k-th I) runs after it."""
    early = (w.ticks <= bwd.ticks) & split[:, None]
    if early.any():
        i, k = np.argwhere(early)[0].tolist()
        rank, tick = bwd.first_rank + i, int(w.ticks[i, k])
        raise ScheduleError(f"{tl.name} timeline: rank {rank}: {_action(tl, rank, tick)} runs before its "
                            f"input-gradient I (tick {tick})")


def fifo_error(tl: Timeline, name: str, src: int, dst: int, t_src, t_dst, k: int) -> None:
    sent, got = _action(tl, src, int(t_src)), _action(tl, dst, int(t_dst))
    raise ScheduleError(f"{tl.name} timeline: rank {src} sends {name} messages to rank {dst} in the order of its "
                        f"{name}s, {sent} as number {k}, but rank {dst}'s {name} number {k} is {got} "
                        f"(messages on a channel arrive in order)")


def order_error(tl: Timeline, name: str, src: int, dst: int, t_src, t_dst, k: int = 0) -> None:
    t_src, t_dst = int(t_src), int(t_dst)
    raise ScheduleError(f"{tl.name} timeline is not in dependency order: rank {dst} runs "
                        f"{_action(tl, dst, t_dst)} at tick {t_dst}, but its input comes from "
                        f"{_action(tl, src, t_src)} on rank {src} at tick {t_src}")


def check_once(tl: Timeline, seq: Seq, name: str) -> None:
    """A rank's keys are a permutation of chunk x micro-batch: each of its stages and micro-batches once."""
    rank = seq.first_rank
    seen = np.bincount(seq.keys[0], minlength=tl.virtual * tl.n_micro)
    if (seen != 1).any():
        key = int(np.flatnonzero(seen != 1)[0])
        chunk, mb = divmod(key, tl.n_micro)
        state = "is missing" if seen[key] == 0 else f"appears {int(seen[key])} times"
        raise ScheduleError(f"{tl.name} timeline: rank {rank}: the {name} of stage {chunk * tl.pp + rank} "
                            f"micro-batch {mb} {state}")


def check_local_order(tl: Timeline, fwd: Seq, bwd: Seq) -> None:
    """One rank: stage s - 1 hands its output to stage s (and gradients back) locally, so they must come first."""
    m, n = tl.n_micro, tl.virtual * tl.n_micro
    f_tick, b_tick = np.empty(n, np.int64), np.empty(n, np.int64)
    f_tick[fwd.keys[0]] = fwd.ticks[0]
    b_tick[bwd.keys[0]] = bwd.ticks[0]
    check_before(tl, 0, f_tick[:-m], f_tick[m:], "runs before the forward of the stage before it")
    check_before(tl, 0, b_tick[m:], b_tick[:-m], "runs before the backward of the stage after it")
    check_before(tl, 0, f_tick, b_tick, "runs before its forward")


def _action(tl: Timeline, rank: int, tick: int) -> Action:
    code = int(tl.ops[rank, tick])
    op = ("F", "B", "I", "W")[code] if code != IDLE else "IDLE"
    return Action(op, int(chunk_stage(int(tl.chunk[rank, tick]), rank, tl.pp, tl.placement)), int(tl.mb[rank, tick]))


def check_timeline_values(tl: Timeline) -> None:
    """Raise ScheduleError unless every op code, chunk and micro-batch of the timeline is in range."""
    for label, arr, low, high in (("op code", tl.ops, IDLE, W), ("chunk", tl.chunk, 0, tl.virtual - 1),
                                  ("micro-batch", tl.mb, 0, tl.n_micro - 1)):
        if arr.size and (arr.min() < low or arr.max() > high):
            rank, tick = np.argwhere((arr < low) | (arr > high))[0].tolist()
            raise ScheduleError(f"{tl.name} timeline: rank {rank} tick {tick} has {label} {int(arr[rank, tick])}, "
                                f"outside {low}..{high}")


def validate_per_action(tl: Timeline) -> None:
    """The reference path: validate_programs(lower(actions)) one action at a time (small timelines, any placement)."""
    validate_programs(lower(tl.actions(), tl.shape), tl.shape)
