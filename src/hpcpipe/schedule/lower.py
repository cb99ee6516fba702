"""Lowering: compute-only schedules -> full per-rank programs with SEND/RECV/ALLREDUCE/OPT_STEP.

``lower`` inserts, around every compute action, the point-to-point messages
it needs: a forward of stage s > 0 receives its input from the rank of stage
s - 1, a forward of a non-last stage sends its output to the rank of stage
s + 1, and backwards do the same in reverse; which rank owns a stage is the
schedule's placement (:class:`hpcpipe.schedule.ir.PipeShape`), passed in.
Neighbouring stages on the same rank (pp = 1 with virtual stages, or the turn
of ZB-V's V on rank pp - 1) hand over locally and get no message.
Every program ends with ALLREDUCE (data-parallel gradient average) and
OPT_STEP.

``validate_programs`` proves a lowered program set correct by executing it
symbolically: sends are non-blocking (the engine posts Isend and completes
it later), receives block, every message is matched in FIFO order on its
(source, destination, direction) channel, every compute action appears once
and after its dependencies, and no set of ranks can wait on each other
forever. Errors print the rank x step grid with ``<-- ERROR HERE``.

``validate_timeline`` proves the same of a schedule in array form (what
``validate_programs(lower(timeline.actions()))`` proves) with whole-array operations,
for sizes where per-action Python is too slow (pp = 1024 x 8192 micro-batches).
"""

from __future__ import annotations

from hpcpipe.errors import ScheduleError
from hpcpipe.schedule.ir import Action, PipeShape, stage_rank


def lower(schedule: list[list[Action]], shape: PipeShape) -> list[list[Action]]:
    """Return the per-rank programs of a schedule with communication and step actions added.

    ``shape.placement`` says which rank owns each stage; it must be the schedule's own
    (:func:`hpcpipe.schedule.registry.shape_of` builds the right shape from a schedule name).
    """
    pp, n_stages, placement = shape.pp, shape.n_stages, shape.placement
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
