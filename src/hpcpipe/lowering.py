"""Lowering: compute-only schedules -> full per-rank programs with SEND/RECV/ALLREDUCE/OPT_STEP.

``lower`` inserts, around every compute action, the point-to-point messages
it needs: a forward of stage s > 0 receives its input from the rank of stage
s - 1, a forward of a non-last stage sends its output to the rank of stage
s + 1, and backwards do the same in reverse. Neighbouring stages on the same
rank (pp = 1 with virtual stages) hand over locally and get no message.
Every program ends with ALLREDUCE (data-parallel gradient average) and
OPT_STEP.

``validate`` proves a lowered program set correct by executing it
symbolically: sends are non-blocking (the engine posts Isend and completes
it later), receives block, every message is matched in FIFO order on its
(source, destination, direction) channel, every compute action appears once
and after its dependencies, and no set of ranks can wait on each other
forever. Errors print the rank x step grid with ``<-- ERROR HERE``.
"""

from __future__ import annotations

from collections import deque

from .errors import ScheduleError
from .schedules import Action, format_grid, stage_rank


def lower(schedule: list[list[Action]], pp: int, n_stages: int) -> list[list[Action]]:
    """Return the per-rank programs of a schedule with communication and step actions added."""
    if len(schedule) != pp:
        raise ScheduleError(f"schedule has {len(schedule)} rank programs, expected pp = {pp}")
    programs = []
    for rank, compute in enumerate(schedule):
        prog: list[Action] = []
        for a in compute:
            if a.op == "F":
                prev = stage_rank(a.stage - 1, pp)
                if a.stage > 0 and prev != rank:
                    prog.append(Action("RECV_F", a.stage, a.mb, prev))
                prog.append(a)
                nxt = stage_rank(a.stage + 1, pp)
                if a.stage < n_stages - 1 and nxt != rank:
                    prog.append(Action("SEND_F", a.stage, a.mb, nxt))
            elif a.op in ("B", "I"):
                nxt = stage_rank(a.stage + 1, pp)
                if a.stage < n_stages - 1 and nxt != rank:
                    prog.append(Action("RECV_B", a.stage, a.mb, nxt))
                prog.append(a)
                prev = stage_rank(a.stage - 1, pp)
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


def _check_compute(programs: list[list[Action]], pp: int, n_stages: int, n_micro: int) -> None:
    """Every (stage, mb) has one F and one B (or one I then one W) on its owning rank, F first."""
    for rank, prog in enumerate(programs):
        seen: dict[tuple[str, int, int], int] = {}
        for i, a in enumerate(prog):
            if a.op not in ("F", "B", "I", "W"):
                continue
            if not (0 <= a.stage < n_stages and 0 <= a.mb < n_micro):
                raise _fail(programs, f"rank {rank}: {a} is outside stages 0..{n_stages - 1} "
                                      f"x micro-batches 0..{n_micro - 1}", {rank: i})
            if stage_rank(a.stage, pp) != rank:
                raise _fail(programs, f"rank {rank}: {a} belongs to rank {stage_rank(a.stage, pp)}", {rank: i})
            key = (a.op, a.stage, a.mb)
            if key in seen:
                raise _fail(programs, f"rank {rank}: {a} appears twice", {rank: i})
            seen[key] = i
            if a.op != "F" and ("F", a.stage, a.mb) not in seen:
                raise _fail(programs, f"rank {rank}: {a} runs before its forward", {rank: i})
            if a.op == "W" and ("I", a.stage, a.mb) not in seen:
                raise _fail(programs, f"rank {rank}: {a} runs before its input-gradient I", {rank: i})
        for stage in range(rank, n_stages, pp):
            for mb in range(n_micro):
                if ("F", stage, mb) not in seen:
                    raise _fail(programs, f"rank {rank}: forward of stage {stage} micro-batch {mb} is missing", {})
                split = ("I", stage, mb) in seen
                if split != (("W", stage, mb) in seen) or split == (("B", stage, mb) in seen):
                    raise _fail(programs, f"rank {rank}: stage {stage} micro-batch {mb} needs exactly one B, "
                                          f"or one I and one W", {})


def validate(programs: list[list[Action]], pp: int, n_stages: int, n_micro: int) -> None:
    """Raise ScheduleError unless the lowered programs are complete, paired and deadlock-free."""
    if len(programs) != pp:
        raise ScheduleError(f"{len(programs)} rank programs for pp = {pp}")
    if n_stages % pp:
        raise ScheduleError(f"stages ({n_stages}) must be a multiple of pp ({pp})")
    _check_compute(programs, pp, n_stages, n_micro)
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
                if not _step(programs, rank, pos[rank], a, pp, n_stages, channels, have[rank]):
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


def _step(programs, rank, index, a, pp, n_stages, channels, have) -> bool:
    """Symbolically execute one action; False when it must wait; raise on an error."""
    op = a.op
    if op in ("SEND_F", "SEND_B"):
        kind = op[-1]
        need = ("F" if kind == "F" else "G", a.stage, a.mb)
        if need not in have:
            raise _fail(programs, f"rank {rank}: {a} sends data not yet computed", {rank: index})
        expected = stage_rank(a.stage + (1 if kind == "F" else -1), pp)
        if a.peer != expected:
            raise _fail(programs, f"rank {rank}: {a} must go to rank {expected}", {rank: index})
        channels.setdefault((rank, a.peer, kind), deque()).append((a.stage, a.mb))
        return True
    if op in ("RECV_F", "RECV_B"):
        kind = op[-1]
        src_stage = a.stage - 1 if kind == "F" else a.stage + 1
        if a.peer != stage_rank(src_stage, pp):
            raise _fail(programs, f"rank {rank}: {a} must come from rank {stage_rank(src_stage, pp)}", {rank: index})
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
