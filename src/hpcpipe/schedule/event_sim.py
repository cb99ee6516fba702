"""Discrete-event simulation of a schedule: runs its lowered action lists on a cost model, action by action.

``python -m hpcpipe.simulate`` (:mod:`hpcpipe.simulate`) is its command line.

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

from collections import defaultdict, deque

from hpcpipe.errors import ScheduleError
from hpcpipe.schedule.costs import COMPUTE, Costs, SimResult, finite
from hpcpipe.schedule.ir import Action, PipeShape
from hpcpipe.schedule.lower import lower
from hpcpipe.schedule.registry import build_schedule, build_timeline, shape_of
from hpcpipe.schedule.sweep import simulate_timeline
from hpcpipe.schedule.validate_programs import validate_programs
from hpcpipe.schedule.validate_timeline import validate_timeline


def simulate(programs: list[list[Action]], shape: PipeShape, costs: Costs, cores: int | None = None) -> SimResult:
    """Run lowered per-rank programs of a pipeline on the cost model; raise ScheduleError on a deadlock.

    ``cores`` (fewer than the ranks) shares that many cores among the ranks
    that are computing at any moment (processor sharing), as when an 8-rank
    job runs on 2 cores; by default every rank has a core of its own.
    """
    pp = shape.pp
    if len(programs) != pp:
        raise ScheduleError(f"{len(programs)} rank programs for pp = {pp}")
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
    if per_rank_costs and virtual > 1:
        costs = costs.scaled(1.0 / virtual)
    if not events and (cores is None or cores >= pp) and finite(costs):
        timeline = build_timeline(name, pp, n_micro, virtual)
        if check:
            validate_timeline(timeline)
        return simulate_timeline(timeline, costs)
    shape = shape_of(name, pp, n_micro, virtual)
    programs = lower(build_schedule(name, pp, n_micro, virtual), shape)
    if check:
        validate_programs(programs, shape)
    return simulate(programs, shape, costs, cores)


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
