"""Lowering: compute-only schedules -> full per-rank programs with SEND/RECV/ALLREDUCE/OPT_STEP.

``lower`` inserts, around every compute action, the point-to-point messages
it needs: a forward of stage s > 0 receives its input from the rank of stage
s - 1, a forward of a non-last stage sends its output to the rank of stage
s + 1, and backwards do the same in reverse; which rank owns a stage is the
schedule's placement (:func:`hpcpipe.schedules.stage_rank`), passed in.
Neighbouring stages on the same rank (pp = 1 with virtual stages, or the turn
of ZB-V's V on rank pp - 1) hand over locally and get no message.
Every program ends with ALLREDUCE (data-parallel gradient average) and
OPT_STEP.

``validate`` proves a lowered program set correct by executing it
symbolically: sends are non-blocking (the engine posts Isend and completes
it later), receives block, every message is matched in FIFO order on its
(source, destination, direction) channel, every compute action appears once
and after its dependencies, and no set of ranks can wait on each other
forever. Errors print the rank x step grid with ``<-- ERROR HERE``.

``validate_timeline`` proves the same of a schedule in array form (what
``validate(lower(timeline.actions()))`` proves) with whole-array operations,
for sizes where per-action Python is too slow (pp = 1024 x 8192 micro-batches).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from .errors import ScheduleError
from .schedules import (
    IDLE,
    Action,
    B,
    F,
    I,
    Timeline,
    W,
    chunk_stage,
    format_grid,
    rank_stages,
    stage_rank,
)


def lower(schedule: list[list[Action]], pp: int, n_stages: int, placement: str = "interleaved") -> list[list[Action]]:
    """Return the per-rank programs of a schedule with communication and step actions added.

    ``placement`` says which rank owns each stage (:func:`hpcpipe.schedules.stage_rank`); it must be the
    schedule's own (:func:`hpcpipe.schedules.placement_of`).
    """
    if len(schedule) != pp:
        raise ScheduleError(f"schedule has {len(schedule)} rank programs, expected pp = {pp}")
    programs = []
    for rank, compute in enumerate(schedule):
        prog: list[Action] = []
        for a in compute:
            if a.op == "F":
                prev = stage_rank(a.stage - 1, pp, placement)
                if a.stage > 0 and prev != rank:
                    prog.append(Action("RECV_F", a.stage, a.mb, prev))
                prog.append(a)
                nxt = stage_rank(a.stage + 1, pp, placement)
                if a.stage < n_stages - 1 and nxt != rank:
                    prog.append(Action("SEND_F", a.stage, a.mb, nxt))
            elif a.op in ("B", "I"):
                nxt = stage_rank(a.stage + 1, pp, placement)
                if a.stage < n_stages - 1 and nxt != rank:
                    prog.append(Action("RECV_B", a.stage, a.mb, nxt))
                prog.append(a)
                prev = stage_rank(a.stage - 1, pp, placement)
                if a.stage > 0 and prev != rank:
                    prog.append(Action("SEND_B", a.stage, a.mb, prev))
            elif a.op == "W":
                prog.append(a)
            else:
                raise ScheduleError(f"rank {rank}: {a} is not a compute action (F, B, I, W)")
        prog += [Action("ALLREDUCE"), Action("OPT_STEP")]
        programs.append(prog)
    return programs


def _fail(programs: list[list[Action]], message: str, mark: dict[int, int]) -> ScheduleError:
    return ScheduleError(f"{message}\n{format_grid(programs, mark)}")


def _check_compute(programs: list[list[Action]], pp: int, n_stages: int, n_micro: int, placement: str) -> None:
    """Every (stage, mb) has one F and one B (or one I then one W) on its owning rank, F first."""
    for rank, prog in enumerate(programs):
        seen: dict[tuple[str, int, int], int] = {}
        for i, a in enumerate(prog):
            if a.op not in ("F", "B", "I", "W"):
                continue
            if not (0 <= a.stage < n_stages and 0 <= a.mb < n_micro):
                raise _fail(programs, f"rank {rank}: {a} is outside stages 0..{n_stages - 1} "
                                      f"x micro-batches 0..{n_micro - 1}", {rank: i})
            owner = stage_rank(a.stage, pp, placement)
            if owner != rank:
                raise _fail(programs, f"rank {rank}: {a} belongs to rank {owner} ({placement} placement)",
                            {rank: i})
            key = (a.op, a.stage, a.mb)
            if key in seen:
                raise _fail(programs, f"rank {rank}: {a} appears twice", {rank: i})
            seen[key] = i
            if a.op != "F" and ("F", a.stage, a.mb) not in seen:
                raise _fail(programs, f"rank {rank}: {a} runs before its forward", {rank: i})
            if a.op == "W" and ("I", a.stage, a.mb) not in seen:
                raise _fail(programs, f"rank {rank}: {a} runs before its input-gradient I", {rank: i})
        for stage in rank_stages(rank, pp, n_stages, placement):
            for mb in range(n_micro):
                if ("F", stage, mb) not in seen:
                    raise _fail(programs, f"rank {rank}: forward of stage {stage} micro-batch {mb} is missing", {})
                split = ("I", stage, mb) in seen
                if split != (("W", stage, mb) in seen) or split == (("B", stage, mb) in seen):
                    raise _fail(programs, f"rank {rank}: stage {stage} micro-batch {mb} needs exactly one B, "
                                          f"or one I and one W", {})


def validate(programs: list[list[Action]], pp: int, n_stages: int, n_micro: int,
             placement: str = "interleaved") -> None:
    """Raise ScheduleError unless the lowered programs are complete, paired and deadlock-free under a placement."""
    if len(programs) != pp:
        raise ScheduleError(f"{len(programs)} rank programs for pp = {pp}")
    if n_stages % pp:
        raise ScheduleError(f"stages ({n_stages}) must be a multiple of pp ({pp})")
    _check_compute(programs, pp, n_stages, n_micro, placement)
    channels: dict[tuple[int, int, str], deque[tuple[int, int]]] = {}
    have: list[set[tuple[str, int, int]]] = [set() for _ in programs]  # data present on each rank
    pos = [0] * pp
    total = sum(len(p) for p in programs)
    done = 0
    while done < total:
        progressed = False
        for rank, prog in enumerate(programs):
            while pos[rank] < len(prog):
                a = prog[pos[rank]]
                if not _step(programs, rank, pos[rank], a, pp, n_stages, placement, channels, have[rank]):
                    break
                pos[rank] += 1
                done += 1
                progressed = True
        if not progressed:
            blocked = {r: pos[r] for r in range(pp) if pos[r] < len(programs[r])}
            raise _fail(programs, "deadlock: every unfinished rank waits on a message that is never sent", blocked)
    leftover = {k: list(v) for k, v in channels.items() if v}
    if leftover:
        (src, dst, kind), items = next(iter(leftover.items()))
        raise ScheduleError(f"unmatched {kind} send(s) from rank {src} to rank {dst}: (stage, mb) {items}\n"
                            f"{format_grid(programs)}")


def _step(programs, rank, index, a, pp, n_stages, placement, channels, have) -> bool:
    """Symbolically execute one action; False when it must wait; raise on an error."""
    op = a.op
    if op in ("SEND_F", "SEND_B"):
        kind = op[-1]
        need = ("F" if kind == "F" else "G", a.stage, a.mb)
        if need not in have:
            raise _fail(programs, f"rank {rank}: {a} sends data not yet computed", {rank: index})
        expected = stage_rank(a.stage + (1 if kind == "F" else -1), pp, placement)
        if a.peer != expected:
            raise _fail(programs, f"rank {rank}: {a} must go to rank {expected}", {rank: index})
        channels.setdefault((rank, a.peer, kind), deque()).append((a.stage, a.mb))
        return True
    if op in ("RECV_F", "RECV_B"):
        kind = op[-1]
        src_stage = a.stage - 1 if kind == "F" else a.stage + 1
        source = stage_rank(src_stage, pp, placement)
        if a.peer != source:
            raise _fail(programs, f"rank {rank}: {a} must come from rank {source}", {rank: index})
        queue = channels.get((a.peer, rank, kind))
        if not queue:
            return False
        if queue[0] != (src_stage, a.mb):
            raise _fail(programs, f"rank {rank}: {a} would match the message for (stage, mb) {queue[0]} "
                                  f"(messages on a channel arrive in order)", {rank: index})
        queue.popleft()
        have.add(("X" if kind == "F" else "D", a.stage, a.mb))
        return True
    if op == "F":
        if a.stage > 0 and ("X", a.stage, a.mb) not in have and ("F", a.stage - 1, a.mb) not in have:
            raise _fail(programs, f"rank {rank}: {a} has no input (no RECV_F before it)", {rank: index})
        have.add(("F", a.stage, a.mb))
        return True
    if op in ("B", "I"):
        last = a.stage == n_stages - 1
        if not last and ("D", a.stage, a.mb) not in have and ("G", a.stage + 1, a.mb) not in have:
            raise _fail(programs, f"rank {rank}: {a} has no output gradient (no RECV_B before it)", {rank: index})
        have.add(("G", a.stage, a.mb))
        return True
    if op in ("W", "ALLREDUCE", "OPT_STEP"):
        return True
    raise _fail(programs, f"rank {rank}: unknown op {op!r}", {rank: index})


# ----------------------------------------------------------------------- timelines (vectorised) ----

def validate_timeline(tl: Timeline, ranks_per_pass: int = 16) -> None:
    """Raise ScheduleError unless the timeline's programs are complete, paired and deadlock-free (vectorised).

    Proves what ``validate(lower(tl.actions()), ...)`` proves, and the promise
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
    version of them (:func:`_validate_v`); any other placement or chunk count
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
        _validate_v(tl, ranks_per_pass)
        return
    if tl.placement != "interleaved":
        _validate_per_action(tl)
        _check_ticks_any_placement(tl)
        return
    work = _Workspace(tl, min(ranks_per_pass, pp))
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
                _check_after(tl, bwd, w, split)
        if rank0 is None:
            rank0 = (fwd.row(0), bwd.row(0))
            _check_once(tl, rank0[0], "forward")
            _check_once(tl, rank0[1], "backward")
        if pp > 1:
            _check_neighbours(tl, work, fwd, prev[0] if prev else None, "forward", 1)
            _check_neighbours(tl, work, bwd, prev[1] if prev else None, "backward", -1)
        prev = (fwd.row(-1), bwd.row(-1))
    if pp == 1:
        _check_local_order(tl, *rank0)
    else:
        if v > 1:
            _check_wrap(tl, rank0[0], prev[0], "forward", 1)
            _check_wrap(tl, rank0[1], prev[1], "backward", -1)
        _check_last_stage(tl, *prev)
    if per_action:
        _validate_per_action(tl)


def _validate_per_action(tl: Timeline) -> None:
    validate(lower(tl.actions(), tl.pp, tl.n_stages, tl.placement), tl.pp, tl.n_stages, tl.n_micro, tl.placement)


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
            _order_error(tl, kind, src_rank, int(ranks[sel][k]), src_tick[k], ticks[sel][k])


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


class _Seq:
    """One kind of action of some consecutive ranks, in tick order: (chunk * m + mb) keys and ticks, rows x v*m."""

    def __init__(self, first_rank: int, keys: np.ndarray, ticks: np.ndarray, chunk: np.ndarray | None) -> None:
        self.first_rank, self.keys, self.ticks, self.chunk = first_rank, keys, ticks, chunk

    def row(self, i: int) -> _Seq:
        """A copy of one rank's sequence (i may be negative): the workspace's buffers are reused next pass."""
        i = i % len(self.keys)
        pick = slice(i, i + 1)
        return _Seq(self.first_rank + i, self.keys[pick].copy(), self.ticks[pick].copy(),
                    None if self.chunk is None else self.chunk[pick].copy())


class _Workspace:
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

    def sequence(self, slot: int, r0: int, ops: np.ndarray, kind: str, with_i: bool = True) -> _Seq:
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
            return _Seq(r0, mb.reshape(rows, n), ticks, None)
        chunk = np.take(np.ascontiguousarray(tl.chunk[r0:r0 + rows]).ravel(), pos, out=self.chunk[slot, :size])
        keys = np.multiply(chunk, np.int64(tl.n_micro), out=self.keys[slot, :size])   # (an int8 * 8192 would overflow)
        keys += mb
        return _Seq(r0, keys.reshape(rows, n), ticks, chunk.reshape(rows, n))


def _first(bad: np.ndarray) -> tuple[int, int] | None:
    """(row, column) of the first True of a 2-D mask, or None."""
    if not bad.any():
        return None
    i, k = np.argwhere(bad)[0].tolist()
    return i, k


def _check_neighbours(tl: Timeline, work: _Workspace, seq: _Seq, before: _Seq | None, name: str,
                      direction: int) -> None:
    """Rank r and r + 1 exchange all their actions of one kind: same order (FIFO), the receiver later.

    Checks the rank before this pass against the pass's first rank, then the pass's ranks among
    themselves; direction 1: rank r sends to r + 1 (forwards), -1: r + 1 sends to r (backwards).
    """
    if before is not None:
        _check_pairs(tl, work, name, direction, before.first_rank, before, slice(0, 1), seq, slice(0, 1))
    if len(seq.keys) > 1:
        _check_pairs(tl, work, name, direction, seq.first_rank, seq, slice(0, -1), seq, slice(1, None))


def _check_pairs(tl: Timeline, work: _Workspace, name: str, direction: int, top: int,
                 upper: _Seq, upper_rows: slice, lower: _Seq, lower_rows: slice) -> None:
    """Row i of upper[upper_rows] is rank top + i, row i of lower[lower_rows] rank top + i + 1."""
    up_keys, low_keys = upper.keys[upper_rows], lower.keys[lower_rows]
    up_ticks, low_ticks = upper.ticks[upper_rows], lower.ticks[lower_rows]
    diff = work.diff[:len(up_keys)]
    late = np.greater_equal if direction > 0 else np.less_equal     # the receiver is not later
    for error, hit in ((_fifo_error, _first(np.not_equal(up_keys, low_keys, out=diff))),
                       (_order_error, _first(late(up_ticks, low_ticks, out=diff)))):
        if hit is not None:
            i, k = hit
            ranks, ticks = (top + i, top + i + 1), (up_ticks[i, k], low_ticks[i, k])
            if direction < 0:
                ranks, ticks = ranks[::-1], ticks[::-1]
            error(tl, name, *ranks, *ticks, k)


def _check_wrap(tl: Timeline, first: _Seq, last: _Seq, name: str, direction: int) -> None:
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
        _fifo_error(tl, name, src, dst, src_ticks[k], dst_ticks[k], k)
    early = dst_ticks <= src_ticks
    if early.any():
        k = int(np.flatnonzero(early)[0])
        _order_error(tl, name, src, dst, src_ticks[k], dst_ticks[k], k)


def _check_last_stage(tl: Timeline, fwd: _Seq, bwd: _Seq) -> None:
    """The last stage's F and backward of a micro-batch are on one rank with no message between: F first."""
    m = tl.n_micro
    last = (tl.virtual - 1) * m                       # keys of chunk v - 1
    f_sel, b_sel = fwd.keys[0] >= last, bwd.keys[0] >= last
    f_tick, b_tick = np.empty(m, np.int64), np.empty(m, np.int64)
    f_tick[fwd.keys[0, f_sel] - last] = fwd.ticks[0, f_sel]
    b_tick[bwd.keys[0, b_sel] - last] = bwd.ticks[0, b_sel]
    _check_before(tl, tl.pp - 1, f_tick, b_tick, "runs before its forward")


def _check_before(tl: Timeline, rank: int, first: np.ndarray, then: np.ndarray, what: str) -> None:
    bad = then <= first
    if bad.any():
        tick = int(then[np.flatnonzero(bad)[0]])
        raise ScheduleError(f"{tl.name} timeline: rank {rank}: {_action(tl, rank, tick)} {what} (tick {tick})")


def _check_after(tl: Timeline, bwd: _Seq, w: _Seq, split: np.ndarray) -> None:
    """On splitting ranks the k-th W (same key as the k-th I) runs after it."""
    early = (w.ticks <= bwd.ticks) & split[:, None]
    if early.any():
        i, k = np.argwhere(early)[0].tolist()
        rank, tick = bwd.first_rank + i, int(w.ticks[i, k])
        raise ScheduleError(f"{tl.name} timeline: rank {rank}: {_action(tl, rank, tick)} runs before its "
                            f"input-gradient I (tick {tick})")


def _fifo_error(tl: Timeline, name: str, src: int, dst: int, t_src, t_dst, k: int) -> None:
    sent, got = _action(tl, src, int(t_src)), _action(tl, dst, int(t_dst))
    raise ScheduleError(f"{tl.name} timeline: rank {src} sends {name} messages to rank {dst} in the order of its "
                        f"{name}s, {sent} as number {k}, but rank {dst}'s {name} number {k} is {got} "
                        f"(messages on a channel arrive in order)")


def _order_error(tl: Timeline, name: str, src: int, dst: int, t_src, t_dst, k: int = 0) -> None:
    t_src, t_dst = int(t_src), int(t_dst)
    raise ScheduleError(f"{tl.name} timeline is not in dependency order: rank {dst} runs "
                        f"{_action(tl, dst, t_dst)} at tick {t_dst}, but its input comes from "
                        f"{_action(tl, src, t_src)} on rank {src} at tick {t_src}")


def _check_once(tl: Timeline, seq: _Seq, name: str) -> None:
    """A rank's keys are a permutation of chunk x micro-batch: each of its stages and micro-batches once."""
    rank = seq.first_rank
    seen = np.bincount(seq.keys[0], minlength=tl.virtual * tl.n_micro)
    if (seen != 1).any():
        key = int(np.flatnonzero(seen != 1)[0])
        chunk, mb = divmod(key, tl.n_micro)
        state = "is missing" if seen[key] == 0 else f"appears {int(seen[key])} times"
        raise ScheduleError(f"{tl.name} timeline: rank {rank}: the {name} of stage {chunk * tl.pp + rank} "
                            f"micro-batch {mb} {state}")


def _check_local_order(tl: Timeline, fwd: _Seq, bwd: _Seq) -> None:
    """One rank: stage s - 1 hands its output to stage s (and gradients back) locally, so they must come first."""
    m, n = tl.n_micro, tl.virtual * tl.n_micro
    f_tick, b_tick = np.empty(n, np.int64), np.empty(n, np.int64)
    f_tick[fwd.keys[0]] = fwd.ticks[0]
    b_tick[bwd.keys[0]] = bwd.ticks[0]
    _check_before(tl, 0, f_tick[:-m], f_tick[m:], "runs before the forward of the stage before it")
    _check_before(tl, 0, b_tick[m:], b_tick[:-m], "runs before the backward of the stage after it")
    _check_before(tl, 0, f_tick, b_tick, "runs before its forward")


# ------------------------------------------------------------------- the V placement (ZB-V) ----

def _validate_v(tl: Timeline, ranks_per_pass: int) -> None:
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
                w_seq = _Seq(r0, w_keys, w - starts, None)
                _check_after(tl, _Seq(r0, b_keys, b - starts, None), w_seq, split)
        if r0 == 0:
            for mb, _ in seqs:
                if (np.bincount(mb[0].astype(np.int64), minlength=m) != 1).any():
                    _structure_error(tl)
            _, fb, _, bb = seqs
            f_tick, b_tick = np.empty(m, np.int64), np.empty(m, np.int64)
            f_tick[fb[0][0]] = fb[1][0]
            b_tick[bb[0][0]] = bb[1][0]
            _check_before(tl, 0, f_tick, b_tick, "runs before its forward")      # the loss stage, 2p - 1
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
    _check_before(tl, turn, first, then, "runs before the forward of the stage before it")
    first[bb_mb[0]], then[ba_mb[0]] = bb_t[0], ba_t[0]
    _check_before(tl, turn, first, then, "runs before the backward of the stage after it")
    if per_action:
        _validate_per_action(tl)


def _structure_error(tl: Timeline) -> None:
    """A rank misses or repeats an action, which the per-action validator names (its verdict is certain)."""
    _validate_per_action(tl)
    raise ScheduleError(f"{tl.name} timeline: some rank does not run each of its stages' forward and backward "
                        f"once per micro-batch ({tl.n_micro} micro-batches)")


def _check_v_pairs(tl: Timeline, name: str, down: bool, top: int, mb: np.ndarray, ticks: np.ndarray) -> None:
    """Rows i and i + 1 (ranks top + i, top + i + 1) send one chunk's messages down (i -> i + 1) or up: FIFO, later."""
    if len(mb) < 2:
        return
    src, dst = (slice(0, -1), slice(1, None)) if down else (slice(1, None), slice(0, -1))
    for error, bad in ((_fifo_error, mb[src] != mb[dst]), (_order_error, ticks[dst] <= ticks[src])):
        hit = _first(bad)
        if hit is not None:
            i, k = hit
            ranks = (top + i, top + i + 1) if down else (top + i + 1, top + i)
            error(tl, name, *ranks, ticks[src][i, k], ticks[dst][i, k], k)
