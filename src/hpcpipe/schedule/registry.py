"""The one registry of schedules: name -> (action lists, timeline builder, stage placement)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hpcpipe.errors import ScheduleError
from hpcpipe.schedule.classic import gpipe_timeline, interleaved_1f1b_timeline, one_f_one_b_timeline
from hpcpipe.schedule.ir import Action, PipeShape, Timeline
from hpcpipe.schedule.zero_bubble import zero_bubble_h1_timeline, zero_bubble_v_timeline

TimelineFn = Callable[[int, int, int], Timeline]


@dataclass(frozen=True)
class ScheduleSpec:
    """A registered schedule: its timeline builder (pp, micro-batches, virtual stages) and its stage placement."""

    timeline: TimelineFn
    placement: str


# The one registry. The action lists are read off the timeline (Timeline.actions); the
# documented functions (gpipe, one_f_one_b, ...) carry each schedule's picture and bounds.
REGISTRY: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec(gpipe_timeline, "interleaved"),
    "1f1b": ScheduleSpec(one_f_one_b_timeline, "interleaved"),
    "interleaved-1f1b": ScheduleSpec(interleaved_1f1b_timeline, "interleaved"),
    "zb-h1": ScheduleSpec(zero_bubble_h1_timeline, "interleaved"),
    "zb-v": ScheduleSpec(zero_bubble_v_timeline, "v"),
}
SCHEDULES: tuple[str, ...] = tuple(REGISTRY)


def _spec(name: str) -> ScheduleSpec:
    if name not in REGISTRY:
        raise ScheduleError(f"unknown schedule {name!r} (known: {', '.join(SCHEDULES)})")
    return REGISTRY[name]


def placement_of(name: str) -> str:
    """Return the stage placement a named schedule needs ("interleaved" or "v")."""
    return _spec(name).placement


def shape_of(name: str, pp: int, n_micro: int, virtual: int = 1) -> PipeShape:
    """Return the pipeline shape a named schedule runs on: pp ranks, pp x virtual stages, its placement."""
    return PipeShape(pp, pp * virtual, n_micro, placement_of(name))


def build_timeline(name: str, pp: int, n_micro: int, virtual: int = 1) -> Timeline:
    """Return a named schedule in array form (the form the vectorised validator and simulator take)."""
    return _spec(name).timeline(pp, n_micro, virtual)


def build_schedule(name: str, pp: int, n_micro: int, virtual: int = 1) -> list[list[Action]]:
    """Return the compute action list of every pipeline rank for a named schedule."""
    return build_timeline(name, pp, n_micro, virtual).actions()
