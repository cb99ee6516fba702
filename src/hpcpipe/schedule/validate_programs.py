"""Validate lowered programs by executing them symbolically: complete, paired, FIFO, deadlock-free."""

from __future__ import annotations

from collections import deque

from hpcpipe.errors import ScheduleError
from hpcpipe.schedule.ir import Action, PipeShape, rank_stages, stage_rank
from hpcpipe.schedule.render import format_grid


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


def validate_programs(programs: list[list[Action]], shape: PipeShape) -> None:
    """Raise ScheduleError unless the lowered programs are complete, paired and deadlock-free for a pipeline shape."""
    pp, n_stages, n_micro, placement = shape.pp, shape.n_stages, shape.n_micro, shape.placement
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
