"""Simulator: runs the lowered action lists of a schedule on a cost model.

    python -m hpcpipe.simulate --schedule 1f1b --pp 8 --micro-batches 32 [--costs F,B,W,comm]
    python -m hpcpipe.simulate --schedule zb-h1 --pp 4 --micro-batches 8 --plot timeline.png
    python -m hpcpipe.simulate --schedule 1f1b --pp 2 --micro-batches 16 --calibrate trace.json
    python -m hpcpipe.simulate --schedule zb-h1 --pp 4 --micro-batches 16 --calibrate trace.json --cores 2
    python -m hpcpipe.simulate --measured trace.json --plot measured.png

It executes exactly the programs the engine executes (``lower`` of the
schedule), with the engine's semantics: compute takes its cost, a send is
non-blocking and its message arrives ``comm`` later, a receive blocks until
its message has arrived, and ALLREDUCE / OPT_STEP take a fixed time. It
reports the step time, the bubble (idle share of rank time), and the peak
number of micro-batches whose activations each rank and stage holds (from F
until B, or until W for split backwards).

Costs are per action kind, optionally per stage; ``costs_from_trace`` takes
them from the Chrome trace a training run writes (``log.trace``), so that
the prediction can be compared with the measured step time.

Two paths give the same numbers: ``simulate`` runs the lowered action lists
one action at a time and records every action's start and end (for
``--ascii`` and ``--plot``, and for cores shared between ranks), and
``simulate_timeline`` sweeps a schedule's timeline arrays tick by tick with
all ranks as one NumPy vector (the command's default: pp = 1024 x 8192
micro-batches in a fraction of a second).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict, deque
from dataclasses import dataclass, field

import numpy as np

from .errors import ScheduleError
from .lowering import check_timeline_values, lower, validate, validate_timeline
from .schedules import (
    COMPUTE_OPS,
    IDLE,
    SCHEDULES,
    Action,
    B,
    F,
    Timeline,
    W,
    build_schedule,
    build_timeline,
    chunk_stage,
    placement_of,
    stage_rank,
)

COMPUTE = ("F", "B", "I", "W")


@dataclass(frozen=True)
class Costs:
    """Seconds (or any unit) per action: F, full B, W (I = B - W), per message, per step end.

    ``per_stage`` overrides the uniform costs: {(op, stage): cost} for op in F, B, I, W.
    """

    forward: float = 1.0
    backward: float = 2.0
    weight: float = 1.0
    comm: float = 0.0
    step: float = 0.0                       # ALLREDUCE + OPT_STEP per rank
    per_stage: dict = field(default_factory=dict)

    def of(self, op: str, stage: int) -> float:
        """Return the cost of a compute op on a stage."""
        hit = self.per_stage.get((op, stage))
        if hit is not None:
            return hit
        if op == "F":
            return self.forward
        if op == "B":
            return self.backward
        if op == "W":
            return self.weight
        return self.backward - self.weight   # I

    def scaled(self, factor: float) -> Costs:
        """Return the uniform compute costs multiplied by factor (a stage cut into virtual chunks)."""
        return Costs(self.forward * factor, self.backward * factor, self.weight * factor, self.comm,
                     self.step, dict(self.per_stage))


@dataclass
class SimResult:
    """What a simulated step did."""

    step_time: float
    bubble: float                       # idle share of pp x step_time
    busy: list[float]                   # compute time per rank
    peak_stashed: list[int]             # per rank: micro-batch activations held at once (all its stages)
    peak_stashed_stage: dict[int, int]  # per stage
    # per rank: (action, start, end), waits are gaps; None from the vectorised path (simulate_timeline)
    events: list[list[tuple[Action, float, float]]] | None

    @property
    def bubble_over_compute(self) -> float:
        """Idle time relative to compute time (the form of the interleaved closed form)."""
        busy = sum(self.busy)
        return (len(self.busy) * self.step_time - busy) / busy if busy else 0.0


def simulate(programs: list[list[Action]], pp: int, n_stages: int, costs: Costs,
             cores: int | None = None) -> SimResult:
    """Run lowered per-rank programs on the cost model; raise ScheduleError on a deadlock.

    ``cores`` (fewer than the ranks) shares that many cores among the ranks
    that are computing at any moment (processor sharing), as when an 8-rank
    job runs on 2 cores; by default every rank has a core of its own.
    """
    if cores is not None and cores < 1:
        raise ScheduleError(f"cores must be >= 1, got {cores}")
    if cores is not None and cores < pp:
        return _simulate_shared(programs, pp, costs, cores)
    clock = [0.0] * pp
    pos = [0] * pp
    busy = [0.0] * pp
    channels: dict[tuple[int, int, str], deque] = defaultdict(deque)
    events: list[list[tuple[Action, float, float]]] = [[] for _ in range(pp)]
    held = [0] * pp
    peak = [0] * pp
    held_stage: dict[int, int] = defaultdict(int)
    peak_stage: dict[int, int] = defaultdict(int)
    remaining = sum(len(p) for p in programs)
    while remaining:
        progressed = False
        for r in range(pp):
            prog, i, t = programs[r], pos[r], clock[r]
            ev = events[r]
            while i < len(prog):
                a = prog[i]
                op = a.op
                if op == "RECV_F" or op == "RECV_B":
                    queue = channels.get((a.peer, r, op[-1]))
                    if not queue:
                        break
                    arrival = queue.popleft()
                    end = max(t, arrival)
                    ev.append((a, t, end))
                    t = end
                elif op == "SEND_F" or op == "SEND_B":
                    channels[(r, a.peer, op[-1])].append(t + costs.comm)
                    ev.append((a, t, t))
                elif op in COMPUTE:
                    c = costs.of(op, a.stage)
                    ev.append((a, t, t + c))
                    t += c
                    busy[r] += c
                    if op == "F":
                        held[r] += 1
                        held_stage[a.stage] += 1
                        peak[r] = max(peak[r], held[r])
                        peak_stage[a.stage] = max(peak_stage[a.stage], held_stage[a.stage])
                    elif op != "I":
                        held[r] -= 1
                        held_stage[a.stage] -= 1
                else:   # ALLREDUCE, OPT_STEP: split the per-step cost between them
                    c = costs.step / 2
                    ev.append((a, t, t + c))
                    t += c
                i += 1
                remaining -= 1
                progressed = True
            pos[r], clock[r] = i, t
        if not progressed:
            blocked = ", ".join(f"rank {r} at {programs[r][pos[r]]}" for r in range(pp) if pos[r] < len(programs[r]))
            raise ScheduleError(f"simulation deadlocked: {blocked}")
    step_time = max(clock) if clock else 0.0
    idle = pp * step_time - sum(busy)
    return SimResult(step_time, idle / (pp * step_time) if step_time else 0.0, busy, peak,
                     dict(peak_stage), events)


def simulate_schedule(name: str, pp: int, n_micro: int, virtual: int = 1, costs: Costs | None = None,
                      check: bool = True, cores: int | None = None, per_rank_costs: bool = True,
                      events: bool = True) -> SimResult:
    """Build, lower, (validate) and simulate a named schedule.

    With ``per_rank_costs`` uniform costs describe a rank's whole share of the
    model, and with virtual stages each chunk costs 1/virtual of it; otherwise
    (costs from :func:`calibrated_costs`) they are per stage already.

    ``events=False`` means the caller needs no per-action events (no ASCII
    timeline, no plot): the schedule is then validated and simulated from its
    array form (:func:`validate_timeline`, :func:`simulate_timeline`), with the
    same numbers, in a time that grows with the timeline's length rather than
    with the number of actions. Shared cores (``cores`` < pp) and non-finite
    costs always take the per-action path.
    """
    costs = costs or Costs()
    n_stages = pp * virtual
    if per_rank_costs and virtual > 1:
        costs = costs.scaled(1.0 / virtual)
    if not events and (cores is None or cores >= pp) and _finite(costs):
        timeline = build_timeline(name, pp, n_micro, virtual)
        if check:
            validate_timeline(timeline)
        return simulate_timeline(timeline, costs)
    placement = placement_of(name)
    programs = lower(build_schedule(name, pp, n_micro, virtual), pp, n_stages, placement)
    if check:
        validate(programs, pp, n_stages, n_micro, placement)
    return simulate(programs, pp, n_stages, costs, cores)


def _finite(costs: Costs) -> bool:
    uniform = (costs.forward, costs.backward, costs.weight, costs.comm, costs.step)
    return all(math.isfinite(c) for c in uniform) and all(math.isfinite(c) for c in costs.per_stage.values())


# -------------------------------------------------------------------- vectorised (timeline) path ----

def simulate_timeline(timeline: Timeline, costs: Costs, block: int = 64) -> SimResult:
    """Simulate a schedule from its timeline arrays: what simulate(lower(actions)) gives, vectorised over ranks.

    Step time, bubble, busy time and peak stash are those :func:`simulate`
    computes for the lowered action lists (each end time by the same
    floating-point operations, so they are bit-identical); ``events`` is None.
    Messages are matched by (stage, micro-batch), which is the order of each
    channel for any timeline that passes :func:`validate_timeline`. Costs must
    be finite.

    An action ends at max(end of its rank's previous action, end of the
    action whose output it receives + comm) + its cost: a longest path over
    the ranks' chains and the message edges. The timeline's ticks order that
    graph (a message's producer has an earlier tick than its consumer), so one
    sweep over the ticks, with the ranks as one NumPy vector, computes every
    end time: at each tick every rank reads its input's end time from an
    array indexed by (producer stage, micro-batch), takes the max with its own
    clock, adds its cost and writes its own end time. That is a handful of
    vector operations per tick (2(m + p - 1) ticks for GPipe and 1F1B),
    whatever the number of actions. The array starts at +inf, so an input
    read before it was written poisons its rank's clock: a timeline out of
    dependency order raises ScheduleError instead of returning a wrong number.
    """
    if not _finite(costs):
        raise ScheduleError(f"simulate_timeline needs finite costs, got {costs}")
    if block < 1:
        raise ScheduleError(f"block must be a positive number of ticks, got {block}")
    check_timeline_values(timeline)     # an out-of-range micro-batch would read another row's cell
    sweep = _Sweep(timeline, costs)
    if not sweep.run(block):
        sweep.run(block, find_error=True)   # raises, naming the first action that read an unwritten input
        raise ScheduleError(f"{timeline.name} timeline is not in dependency order")   # (not reached)
    pp = timeline.pp
    busy = sweep.busy.tolist()
    clock = sweep.clock + costs.step / 2    # ALLREDUCE, then OPT_STEP, as simulate() adds them
    clock += costs.step / 2
    step_time = max(clock.tolist())
    idle = pp * step_time - sum(busy)
    peak, peak_stage = timeline_peaks(timeline)
    return SimResult(step_time, idle / (pp * step_time) if step_time else 0.0, busy, peak, peak_stage, None)


def timeline_peaks(timeline: Timeline, ranks_per_pass: int = 16) -> tuple[list[int], dict[int, int]]:
    """Peak number of micro-batches whose activations each rank and each stage holds (F takes, B and W release).

    Only the order of each rank's actions matters, so this is a running sum
    along the tick axis, a few ranks at a time into reused buffers.
    """
    pp, v = timeline.pp, timeline.virtual
    if ranks_per_pass < 1:
        raise ScheduleError(f"ranks_per_pass must be a positive integer, got {ranks_per_pass}")
    ranks = np.arange(pp)
    rows = min(ranks_per_pass, pp)
    shape = (rows, timeline.n_ticks)
    is_op, delta, mine = np.empty(shape, bool), np.empty(shape, np.int8), np.empty(shape, np.int8)
    running, mine_running = np.empty(shape, np.int32), np.empty(shape, np.int32) if v > 1 else None
    peak = np.zeros(pp, np.int32)
    peak_stage = np.zeros((v, pp), np.int32)
    for r0 in range(0, pp, rows):
        ops = timeline.ops[r0:r0 + rows]
        n = len(ops)
        d, on, run = delta[:n], is_op[:n], running[:n]
        np.equal(ops, F, out=d, casting="unsafe")
        d -= np.equal(ops, B, out=on)
        d -= np.equal(ops, W, out=on)
        np.cumsum(d, axis=1, out=run).max(axis=1, out=peak[r0:r0 + n])
        if v > 1:
            chunk = timeline.chunk[r0:r0 + rows]
            mine_run = mine_running[:n]
            for c in range(v - 1):
                np.multiply(d, np.equal(chunk, c, out=on), out=mine[:n])
                np.cumsum(mine[:n], axis=1, out=mine_run).max(axis=1, out=peak_stage[c, r0:r0 + n])
                run -= mine_run
            # what is left of the rank's running sum is the last chunk's (integers: exact), one cumsum fewer
            run.max(axis=1, out=peak_stage[v - 1, r0:r0 + n])
    if v == 1:
        peak_stage[0] = peak
    stages = [chunk_stage(c, ranks, pp, timeline.placement).tolist() for c in range(v)]
    return peak.tolist(), {s: int(n) for c in range(v) for s, n in zip(stages[c], peak_stage[c].tolist(), strict=True)}


class _Sweep:
    """The tick-by-tick sweep of simulate_timeline and the tables it reads (one instance per simulation)."""

    def __init__(self, timeline: Timeline, costs: Costs) -> None:
        self.tl = timeline
        self.comm = costs.comm
        pp, v, n_micro = timeline.pp, timeline.virtual, timeline.n_micro
        n_stages = pp * v
        # End times live in one flat array of rows of n_micro cells: F of stage s in row n_stages - 1 - s,
        # B or I of stage s in row n_stages + 1 + s, so an action's input is always the next row (the
        # same cell of it). Rows n_stages and 2 n_stages + 1 are the -inf "inputs" of stage 0's F and the
        # last stage's B; W's and idle ticks write into row `sink`, whose next row is -inf as well. A row
        # is padded to an odd number of 64-byte lines so that the ranks' rows spread over the cache sets.
        self.row = n_micro + (8 - n_micro) % 16
        sink = 2 * n_stages + 2
        # Per-rank lookup tables by code = (op + 1) * v + chunk (IDLE -> 0), flattened with rank * width.
        width = 5 * v
        ranks = np.arange(pp)
        self.code_base = ranks * width + v
        keys = np.full((pp, width), sink * self.row, np.intp)
        cost = np.zeros((pp, width))
        # comm per (rank, code): 0 where the input comes from the same rank (the V's turn on rank pp - 1),
        # as simulate() adds no message there; needed only when some but not all hand-overs are local
        self.comm_of = np.full((pp, width), self.comm) if self.comm else None
        for c in range(v):
            stage = chunk_stage(c, ranks, pp, timeline.placement)
            keys[:, v + c] = (n_stages - 1 - stage) * self.row
            keys[:, 2 * v + c] = keys[:, 3 * v + c] = (n_stages + 1 + stage) * self.row
            for op in range(4):
                cost[:, (op + 1) * v + c] = [costs.of(COMPUTE_OPS[op], s) for s in stage.tolist()]
            if self.comm_of is not None:
                src_f = [stage_rank(s - 1, pp, timeline.placement) if s > 0 else -1 for s in stage.tolist()]
                src_b = [stage_rank(s + 1, pp, timeline.placement) if s < n_stages - 1 else -1
                         for s in stage.tolist()]
                self.comm_of[:, v + c] = np.where(np.array(src_f) == ranks, 0.0, self.comm)
                self.comm_of[:, 2 * v + c] = self.comm_of[:, 3 * v + c] = np.where(np.array(src_b) == ranks, 0.0,
                                                                                      self.comm)
        self.local = self.comm_of is not None and bool((self.comm_of == 0).any())
        self.keys, self.cost = keys, cost
        self.n_rows = 2 * n_stages + 4
        self.minus_inf_rows = (n_stages, 2 * n_stages + 1, sink + 1)
        self.clock = np.zeros(pp)
        self.busy = np.zeros(pp)
        self.narrow = np.int16 if width < 2 ** 15 else np.intp     # holds op * v + chunk, -v .. 4v - 1

    def run(self, block: int, find_error: bool = False) -> bool:
        """Sweep all ticks; False if some rank read an input that no earlier tick wrote."""
        tl = self.tl
        pp, v = tl.pp, tl.virtual
        row, comm = self.row, self.comm
        end = np.full(self.n_rows * row, np.inf)     # +inf: not computed yet
        for r in self.minus_inf_rows:
            end[r * row:(r + 1) * row] = -np.inf
        inputs = end[row:]                       # inputs[k] is end[k + row], the input of the cell at k
        clock, nxt = np.zeros(pp), np.empty(pp)
        messages = pp > 1                        # with one rank every stage hands over locally
        # reused every block (fresh temporaries would page-fault every block). A block's tables are
        # computed in the timeline's own (rank, tick) layout, where every read is contiguous, and only
        # the two the sweep reads, key and cost, are transposed to a row per tick: transposed reads of
        # the narrow ops / chunk / micro-batch arrays cost more than all the arithmetic
        base = self.code_base[:, None]
        local_buf = np.empty((pp, block), self.narrow)
        code_buf = np.empty((pp, block), np.intp)
        key_rm, cost_rm = np.empty((pp, block), np.intp), np.empty((pp, block))
        comm_rm = np.empty((pp, block)) if self.local else None
        key_buf = np.empty((block, pp), np.intp)
        cost_buf = np.empty((block, pp))
        comm_buf = np.empty((block, pp)) if self.local else None
        busy = np.zeros(pp)
        for t0 in range(0, tl.n_ticks, block):
            cols = slice(t0, t0 + block)
            n = min(block, tl.n_ticks - t0)
            code = code_buf[:, :n]
            if v > 1:
                local = np.multiply(tl.ops[:, cols], self.narrow(v), out=local_buf[:, :n])
                local += tl.chunk[:, cols]
                np.add(local, base, out=code)
            else:
                np.add(tl.ops[:, cols], base, out=code)
            # "wrap" skips numpy's buffered bounds check; simulate_timeline checked every value's range
            key = self.keys.take(code, out=key_rm[:, :n], mode="wrap")
            key += tl.mb[:, cols]
            key = key_buf[:n]
            key[...] = key_rm[:, :n].T
            cost = cost_buf[:n]
            cost[...] = self.cost.take(code, out=cost_rm[:, :n], mode="wrap").T
            if comm_buf is not None:
                comm_buf[:n] = self.comm_of.take(code, out=comm_rm[:, :n], mode="wrap").T
            for t in range(n):
                if messages:
                    k = key[t]
                    inputs.take(k, out=nxt, mode="wrap")
                    if comm_buf is not None:
                        nxt += comm_buf[t]
                    elif comm:
                        nxt += comm
                    np.maximum(nxt, clock, out=nxt)
                    nxt += cost[t]
                    end[k] = nxt
                else:
                    np.add(clock, cost[t], out=nxt)
                busy += cost[t]                  # simulate()'s busy += cost, in the same order
                clock, nxt = nxt, clock
                if find_error and not np.isfinite(clock).all():
                    self._raise_unready(t0 + t, int(np.flatnonzero(~np.isfinite(clock))[0]))
            if not np.isfinite(clock).all():
                return False
        self.clock, self.busy = clock, busy
        return True

    def _raise_unready(self, tick: int, rank: int) -> None:
        tl = self.tl
        op = COMPUTE_OPS[int(tl.ops[rank, tick])] if tl.ops[rank, tick] != IDLE else "IDLE"
        stage = int(chunk_stage(int(tl.chunk[rank, tick]), rank, tl.pp, tl.placement))
        action = Action(op, stage, int(tl.mb[rank, tick]))
        source = stage_rank(stage - 1 if op == "F" else stage + 1, tl.pp, tl.placement)
        raise ScheduleError(f"{tl.name} timeline is not in dependency order: rank {rank} runs {action} at "
                            f"tick {tick}, but its input from rank {source} is not computed at an earlier "
                            f"tick (or at all)")


def _advance_idle(r, prog, t, pos, computing, remaining, started, blocked_until, channels, events, busy,
                  costs) -> bool:
    """Run rank r's zero-time actions at time t until it starts computing or must wait; True if it moved."""
    moved = False
    while not computing[r] and pos[r] < len(prog):
        a = prog[pos[r]]
        op = a.op
        if op == "RECV_F" or op == "RECV_B":
            queue = channels.get((a.peer, r, op[-1]))
            if not queue:
                blocked_until[r] = float("inf")
                return moved
            if queue[0] > t + 1e-15:
                blocked_until[r] = queue[0]
                return moved
            queue.popleft()
            blocked_until[r] = 0.0
            events[r].append((a, t, t))
        elif op == "SEND_F" or op == "SEND_B":
            channels[(r, a.peer, op[-1])].append(t + costs.comm)
            events[r].append((a, t, t))
        else:
            work = costs.of(op, a.stage) if op in COMPUTE else costs.step / 2
            computing[r], remaining[r], started[r] = True, work, t
            if op in COMPUTE:
                busy[r] += work
            return True
        pos[r] += 1
        moved = True
    return moved


def _simulate_shared(programs: list[list[Action]], pp: int, costs: Costs, cores: int) -> SimResult:
    """Time-ordered simulation where the computing ranks share ``cores`` cores equally."""
    pos = [0] * pp
    remaining = [0.0] * pp            # work left of the current compute action (0 = not computing)
    started = [0.0] * pp
    blocked_until = [0.0] * pp        # arrival time of the message a receive waits for
    channels: dict[tuple[int, int, str], deque] = defaultdict(deque)
    events: list[list[tuple[Action, float, float]]] = [[] for _ in range(pp)]
    busy = [0.0] * pp
    held, peak = [0] * pp, [0] * pp
    held_stage: dict[int, int] = defaultdict(int)
    peak_stage: dict[int, int] = defaultdict(int)
    computing = [False] * pp
    t = 0.0
    while True:
        # let every idle rank run its zero-time actions until it computes or waits; repeat while a
        # send makes a message available to a rank visited earlier in the pass
        moved = True
        while moved:
            moved = False
            for r in range(pp):
                moved |= _advance_idle(r, programs[r], t, pos, computing, remaining, started, blocked_until,
                                       channels, events, busy, costs)
        active = [r for r in range(pp) if computing[r]]
        waiting = [blocked_until[r] for r in range(pp) if not computing[r] and pos[r] < len(programs[r])
                   and blocked_until[r] != float("inf")]
        if not active and not waiting:
            if any(pos[r] < len(programs[r]) for r in range(pp)):
                blocked = ", ".join(f"rank {r} at {programs[r][pos[r]]}" for r in range(pp)
                                    if pos[r] < len(programs[r]))
                raise ScheduleError(f"simulation deadlocked: {blocked}")
            break
        rate = min(1.0, cores / len(active)) if active else 0.0
        dt = min([remaining[r] / rate for r in active] + [w - t for w in waiting])
        dt = max(dt, 0.0)
        t += dt
        for r in range(pp):
            blocked_until[r] = 0.0 if blocked_until[r] <= t + 1e-15 else blocked_until[r]
        for r in active:
            remaining[r] -= dt * rate
            if remaining[r] <= 1e-12 * max(1.0, t):
                a = programs[r][pos[r]]
                events[r].append((a, started[r], t))
                computing[r] = False
                pos[r] += 1
                if a.op == "F":
                    held[r] += 1
                    held_stage[a.stage] += 1
                    peak[r] = max(peak[r], held[r])
                    peak_stage[a.stage] = max(peak_stage[a.stage], held_stage[a.stage])
                elif a.op in ("B", "W"):
                    held[r] -= 1
                    held_stage[a.stage] -= 1
    idle = pp * t - sum(busy)
    return SimResult(t, idle / (pp * t) if t else 0.0, busy, peak, dict(peak_stage), events)


# ----------------------------------------------------------------------------------- traces ----

def load_trace(path: str) -> list[dict]:
    """Return the complete ('X') events of a Chrome trace written by hpcpipe (times in microseconds)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ScheduleError(f"cannot read trace {path!r}: {exc}") from None
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X"]


def costs_from_trace(path: str, stage_costs: bool = True) -> Costs:
    """Calibrate a cost model from a training trace: mean duration per (op, stage), message and step costs.

    Compute costs are the CPU time of each action when the trace has it (wall
    time otherwise), so that a trace taken with more ranks than cores still
    measures the work, and ``cores`` in the simulation adds the sharing back.

    A message's cost is estimated as the shortest receive wait seen (the
    transfer of a message that was already on its way), step cost as the
    mean ALLREDUCE + OPT_STEP time per rank and step.
    """
    events = load_trace(path)
    sums: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0.0, 0])
    step_total, step_count, recv_min = 0.0, set(), None
    for e in events:
        op, args = e.get("cat", ""), e.get("args", {})
        dur = e["dur"] * 1e-6
        if op in COMPUTE:
            # CPU time is the work itself; wall time also holds time the core served other processes
            dur = args.get("cpu_us", e["dur"]) * 1e-6
            entry = sums[(op, args.get("stage", -1))]
            entry[0] += dur
            entry[1] += 1
        elif op in ("ALLREDUCE", "OPT_STEP"):
            step_total += args.get("cpu_us", e["dur"]) * 1e-6
            step_count.add((e.get("tid"), args.get("step")))
        elif op in ("RECV_F", "RECV_B"):
            recv_min = dur if recv_min is None else min(recv_min, dur)
    if not sums:
        raise ScheduleError(f"trace {path!r} holds no compute events (F, B, I, W)")
    means = {key: total / n for key, (total, n) in sums.items()}

    def overall(op: str) -> float:
        vals = [(v, sums[k][1]) for k, v in means.items() if k[0] == op]
        n = sum(c for _, c in vals)
        return sum(v * c for v, c in vals) / n if n else 0.0

    f, b, w = overall("F"), overall("B"), overall("W")
    if not b:   # a split-backward run: B = I + W
        b = overall("I") + w
    if not w and b:
        w = b / 2
    return Costs(f, b, w, recv_min or 0.0, step_total / max(len(step_count), 1),
                 means if stage_costs else {})


def trace_stages(path: str) -> int:
    """Number of pipeline stages in a trace (largest stage index seen + 1)."""
    return 1 + max((e.get("args", {}).get("stage", -1) for e in load_trace(path)), default=-1)


def calibrated_costs(path: str, pp: int, virtual: int = 1) -> Costs:
    """Per-stage costs for simulating pp x virtual stages, from a trace of the same model at any layout.

    When the trace has the same number of stages its per-stage means are used
    as they are; otherwise the mean costs are rescaled by the ratio of stage
    counts (balanced stages: a stage's work is the model's over the stage count).
    """
    target = pp * virtual
    have = trace_stages(path)
    costs = costs_from_trace(path, stage_costs=have == target)
    if have == target:
        return costs
    return Costs(costs.forward * have / target, costs.backward * have / target, costs.weight * have / target,
                 costs.comm, costs.step)


def measured_events(path: str, step: int | None = None) -> list[list[tuple[str, float, float]]]:
    """Return per-rank (name, start, end) of one step of a trace (the last one when step is None), seconds."""
    events = load_trace(path)
    steps = sorted({e.get("args", {}).get("step", 0) for e in events})
    chosen = steps[-1] if step is None else step
    picked = [e for e in events if e.get("args", {}).get("step", 0) == chosen]
    if not picked:
        raise ScheduleError(f"trace {path!r} has no events for step {chosen} (steps: {steps})")
    ranks = sorted({e["tid"] for e in picked})
    t0 = min(e["ts"] for e in picked)
    out = []
    for r in ranks:
        mine = sorted((e for e in picked if e["tid"] == r), key=lambda e: e["ts"])
        out.append([(e["cat"] if e["cat"] not in COMPUTE else e["name"], (e["ts"] - t0) * 1e-6,
                     (e["ts"] + e["dur"] - t0) * 1e-6) for e in mine])
    return out


# ----------------------------------------------------------------------------------- pictures --

def _events(result: SimResult) -> list[list[tuple[Action, float, float]]]:
    if result.events is None:
        raise ScheduleError("this result has no per-action events (vectorised simulation); "
                            "simulate with events=True to draw it")
    return result.events


def ascii_timeline(result: SimResult, tick: float | None = None) -> str:
    """Render a simulated step as text, one row per rank, one column per tick (default: smallest F)."""
    events = _events(result)
    computes = [(a, s, e) for ev in events for a, s, e in ev if a.op in COMPUTE and e > s]
    if not computes:
        return ""
    tick = tick or min(e - s for _, s, e in computes)
    pp = len(events)
    chunked = any(a.stage >= pp for a, _, _ in computes)

    def label(a: Action) -> str:
        # with virtual stages, a letter names the chunk: a = stages 0..pp-1, b = the next pp, ...
        return f"{a.op}{a.mb}{chr(ord('a') + a.stage // pp)}" if chunked else f"{a.op}{a.mb}"

    width = max(len(label(a)) for a, _, _ in computes) + 1
    lines = []
    for r, ev in enumerate(events):
        cells: dict[int, str] = {}
        for a, s, e in ev:
            if a.op in COMPUTE:
                for k in range(round(s / tick), round(e / tick)):
                    cells[k] = label(a)
        n = round(result.step_time / tick)
        lines.append(f"rank {r}  " + "".join(cells.get(k, ".").ljust(width) for k in range(n)).rstrip())
    return "\n".join(lines)


_COLOURS = {"F": "#4c72b0", "B": "#dd8452", "I": "#c44e52", "W": "#55a868", "ALLREDUCE": "#8172b3",
            "OPT_STEP": "#937860"}


def plot_timeline(rows: list[list[tuple[str, float, float]]], path: str, title: str,
                  xlabel: str = "time (s)") -> None:
    """Draw a rank x time chart of (name, start, end) boxes with matplotlib and save it to path."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ScheduleError("--plot needs matplotlib (pip install matplotlib)") from None
    fig, ax = plt.subplots(figsize=(12, 0.5 * len(rows) + 1.5))
    end = max((e for row in rows for _, _, e in row), default=1.0)
    for r, row in enumerate(rows):
        for name, s, e in row:
            kind = name if name in _COLOURS else name.lstrip("s0123456789")[:1]
            if kind not in _COLOURS or e <= s:
                continue
            ax.broken_barh([(s, e - s)], (r - 0.4, 0.8), facecolors=_COLOURS[kind], edgecolor="white",
                           linewidth=0.3)
            if (e - s) / end > 0.015 and kind in COMPUTE:
                ax.text((s + e) / 2, r, name.split(kind)[-1] if kind in COMPUTE else "", ha="center",
                        va="center", fontsize=6, color="white")
    ax.set_yticks(range(len(rows)), [f"rank {r}" for r in range(len(rows))])
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLOURS.values()]
    ax.legend(handles, list(_COLOURS), loc="lower center", bbox_to_anchor=(0.5, 1.08), fontsize=7, ncol=6,
              frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def sim_rows(result: SimResult) -> list[list[tuple[str, float, float]]]:
    """Return a simulated step as (name, start, end) rows for plot_timeline."""
    return [[(a.op if a.op not in COMPUTE else f"{a.op}{a.mb}", s, e) for a, s, e in ev] for ev in _events(result)]


# ----------------------------------------------------------------------------------- CLI -------

def _parse_costs(text: str) -> Costs:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise ScheduleError(f"--costs expects numbers F,B[,W[,comm]], got {text!r}") from None
    if not 2 <= len(values) <= 4 or min(values) < 0:
        raise ScheduleError(f"--costs expects 2 to 4 non-negative numbers F,B[,W[,comm]], got {text!r}")
    f, b = values[0], values[1]
    w = values[2] if len(values) > 2 else b / 2
    comm = values[3] if len(values) > 3 else 0.0
    if w > b:
        raise ScheduleError(f"--costs: W ({w}) cannot exceed the full backward B ({b})")
    return Costs(f, b, w, comm)


def _listing(items: list[str], edge: int = 8) -> str:
    """Join per-rank entries; for hundreds of ranks show the first and last `edge` (a line per rank is unreadable)."""
    if len(items) <= 3 * edge:
        return " ".join(items)
    return " ".join(items[:edge]) + f" ... ({len(items) - 2 * edge} more) ... " + " ".join(items[-edge:])


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m hpcpipe.simulate``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m hpcpipe.simulate", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedule", default="1f1b", help=f"one of {', '.join(SCHEDULES)} (default 1f1b)")
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--virtual-stages", type=int, default=1)
    parser.add_argument("--costs", default="1,2,1,0", help="F,B[,W[,comm]] per whole stage (default 1,2,1,0)")
    parser.add_argument("--calibrate", metavar="TRACE",
                        help="take costs from a training trace (log.trace) of the same model, any layout")
    parser.add_argument("--cores", type=int, default=None,
                        help="cores shared by the ranks (default: one per rank)")
    parser.add_argument("--measured", metavar="TRACE", help="draw/print a measured trace instead of simulating")
    parser.add_argument("--plot", metavar="PNG", help="draw the rank x time chart with matplotlib")
    parser.add_argument("--ascii", action="store_true", help="print the timeline as text")
    parser.add_argument("--no-validate", action="store_true",
                        help="skip the validator (the output then says the schedule was not checked)")
    parser.add_argument("--per-action", action="store_true",
                        help="simulate action by action, the reference path (--ascii and --plot imply it; "
                             "otherwise the schedule's timeline arrays are simulated, same numbers, much faster)")
    args = parser.parse_args(argv)
    if args.plot:   # say it before a simulation that may take seconds, not after printing its results
        try:
            import matplotlib  # noqa: F401
        except ImportError as exc:
            print(f"hpcpipe.simulate: error: --plot needs matplotlib ({exc}): pip install matplotlib "
                  f"(or, in the source tree, pip install \".[plot]\")", file=sys.stderr)
            return 2
    try:
        if args.measured:
            rows = measured_events(args.measured)
            end = max(e for row in rows for _, _, e in row)
            print(f"measured step: {end * 1e3:.2f} ms on {len(rows)} ranks")
            if args.plot:
                plot_timeline(rows, args.plot, f"measured: {args.measured}")
                print(f"wrote {args.plot}")
            return 0
        if args.calibrate:
            costs = calibrated_costs(args.calibrate, args.pp, args.virtual_stages)
        else:
            costs = _parse_costs(args.costs)
        result = simulate_schedule(args.schedule, args.pp, args.micro_batches, args.virtual_stages,
                                   costs, check=not args.no_validate, cores=args.cores,
                                   per_rank_costs=not args.calibrate,
                                   events=bool(args.per_action or args.ascii or args.plot))
    except ScheduleError as exc:
        print(f"hpcpipe.simulate: error: {exc}", file=sys.stderr)
        return 2
    print(f"schedule {args.schedule}  pp={args.pp}  micro-batches={args.micro_batches}  "
          f"virtual stages={args.virtual_stages}")
    print(f"step time        {result.step_time:.6g}")
    print(f"bubble           {result.bubble:.4f} of rank time ({result.bubble_over_compute:.4f} of compute)")
    print("peak stashed     " + _listing([f"r{r}:{n}" for r, n in enumerate(result.peak_stashed)])
          + ("  (micro-batches per rank)" if args.virtual_stages == 1 else
             f"  (stage activations per rank; each is 1/{args.virtual_stages} of a rank's layers)"))
    if args.virtual_stages > 1:
        print("per stage        " + _listing([f"s{s}:{n}" for s, n in sorted(result.peak_stashed_stage.items())]))
    vectorised = result.events is None
    print("simulator        " + ("vectorised over the schedule's timeline arrays" if vectorised else "per action"))
    if args.no_validate:
        print("validation       SKIPPED (--no-validate): the schedule was not checked")
    else:
        how = "vectorised (validate_timeline)" if vectorised else "per action (validate)"
        print(f"validation       {how}: complete, channels in order, deadlock-free")
    if args.ascii:
        print(ascii_timeline(result))
    if args.plot:
        try:
            plot_timeline(sim_rows(result), args.plot,
                          f"{args.schedule} pp={args.pp} m={args.micro_batches} v={args.virtual_stages} "
                          f"(simulated, bubble {result.bubble:.1%})",
                          "time (s)" if args.calibrate else "time (cost units)")
        except ScheduleError as exc:
            print(f"hpcpipe.simulate: error: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
