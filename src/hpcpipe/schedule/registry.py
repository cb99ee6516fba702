"""The one registry of schedules: name -> (action lists, timeline builder, stage placement)."""

from __future__ import annotations

from collections.abc import Callable

from hpcpipe.errors import ScheduleError
from hpcpipe.schedule.classic import (
    gpipe,
    gpipe_timeline,
    interleaved_1f1b,
    interleaved_1f1b_timeline,
    one_f_one_b,
    one_f_one_b_timeline,
)
from hpcpipe.schedule.ir import Action, Timeline
from hpcpipe.schedule.zero_bubble import (
    zero_bubble_h1,
    zero_bubble_h1_timeline,
    zero_bubble_v,
    zero_bubble_v_timeline,
)

ScheduleFn = Callable[[int, int, int], list[list[Action]]]
TimelineFn = Callable[[int, int, int], Timeline]

SCHEDULES: dict[str, ScheduleFn] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved_1f1b,
    "zb-h1": zero_bubble_h1,
    "zb-v": zero_bubble_v,
}

TIMELINES: dict[str, TimelineFn] = {
    "gpipe": gpipe_timeline,
    "1f1b": one_f_one_b_timeline,
    "interleaved-1f1b": interleaved_1f1b_timeline,
    "zb-h1": zero_bubble_h1_timeline,
    "zb-v": zero_bubble_v_timeline,
}

# where each schedule puts its stages (stage_rank's placement); schedules not listed are interleaved
SCHEDULE_PLACEMENT: dict[str, str] = {"zb-v": "v"}


def placement_of(name: str) -> str:
    """Return the stage placement a named schedule needs ("interleaved" or "v")."""
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r} (known: {', '.join(SCHEDULES)})")
    return SCHEDULE_PLACEMENT.get(name, "interleaved")


def build_schedule(name: str, pp: int, n_micro: int, virtual: int = 1) -> list[list[Action]]:
    """Return the compute action list of every pipeline rank for a named schedule."""
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r} (known: {', '.join(SCHEDULES)})")
    return SCHEDULES[name](pp, n_micro, virtual)


def build_timeline(name: str, pp: int, n_micro: int, virtual: int = 1) -> Timeline:
    """Return a named schedule in array form (the form the vectorised validator and simulator take)."""
    if name not in TIMELINES:
        raise ScheduleError(f"unknown schedule {name!r} (known: {', '.join(TIMELINES)})")
    return TIMELINES[name](pp, n_micro, virtual)
