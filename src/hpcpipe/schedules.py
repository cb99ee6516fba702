"""Pipeline schedules as pure data: (pp, micro-batches, virtual stages) -> per-rank action lists.

A schedule says only which compute action each pipeline rank runs in which
order; :mod:`hpcpipe.lowering` adds the communication and proves the result
deadlock-free, and the engine, the simulator and the tests all consume the
same lists. This module imports nothing but the standard library.

Compute actions (the IR, after PyTorch's pipelining):

    F   forward of one micro-batch through one stage
    B   full backward (input gradient and weight gradient together)
    I   input-gradient half of a split backward (zero-bubble schedules)
    W   weight-gradient half of a split backward

Stages are global virtual-stage indices: with ``pp`` ranks and ``v`` virtual
stages per rank there are ``pp * v`` stages and stage ``s`` lives on pipeline
rank ``s % pp`` (Megatron's interleaved placement; ``v = 1`` is the plain one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .errors import ScheduleError

COMPUTE_OPS = ("F", "B", "I", "W")
COMM_OPS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
STEP_OPS = ("ALLREDUCE", "OPT_STEP")


@dataclass(frozen=True, slots=True)
class Action:
    """One instruction of a rank's program: an op on (stage, micro-batch), with a peer rank for comm."""

    op: str
    stage: int = -1
    mb: int = -1
    peer: int = -1

    def __str__(self) -> str:
        if self.op in STEP_OPS:
            return self.op
        text = f"s{self.stage}{self.op}{self.mb}"
        return f"{text}@{self.peer}" if self.peer >= 0 else text


def stage_rank(stage: int, pp: int) -> int:
    """Return the pipeline rank that owns a global (virtual) stage."""
    return stage % pp


def _check_sizes(name: str, pp: int, n_micro: int, virtual: int) -> None:
    for label, value in (("pp", pp), ("micro-batches", n_micro), ("virtual stages", virtual)):
        if not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name}: {label} must be a positive integer, got {value!r}")


def gpipe(pp: int, n_micro: int, virtual: int = 1) -> list[list[Action]]:
    """GPipe (Huang et al. 2019): all forwards, then all backwards.

    Timeline for pp = 4, m = 4 (one tick per action, F then B)::

        rank 0  F0 F1 F2 F3 .  .  .  .  .  .  B0 B1 B2 B3
        rank 1  .  F0 F1 F2 F3 .  .  .  .  B0 B1 B2 B3 .
        rank 2  .  .  F0 F1 F2 F3 .  .  B0 B1 B2 B3 .  .
        rank 3  .  .  .  F0 F1 F2 F3 B0 B1 B2 B3 .  .  .

    Bubble fraction (p - 1) / (m + p - 1); every stage stashes the activations
    of all m micro-batches before the first backward (peak m).
    """
    _check_sizes("gpipe", pp, n_micro, virtual)
    if virtual != 1:
        raise ScheduleError(f"gpipe runs one stage per rank (virtual stages: {virtual}); "
                            f"use an interleaved schedule for virtual_stages > 1")
    return [[Action("F", r, m) for m in range(n_micro)] + [Action("B", r, m) for m in range(n_micro)]
            for r in range(pp)]


ScheduleFn = Callable[[int, int, int], list[list[Action]]]

SCHEDULES: dict[str, ScheduleFn] = {
    "gpipe": gpipe,
}


def build_schedule(name: str, pp: int, n_micro: int, virtual: int = 1) -> list[list[Action]]:
    """Return the compute action list of every pipeline rank for a named schedule."""
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r} (known: {', '.join(SCHEDULES)})")
    return SCHEDULES[name](pp, n_micro, virtual)


def format_grid(programs: list[list[Action]], mark: dict[int, int] | None = None) -> str:
    """Render per-rank programs as a rank x step grid; mark {rank: index} adds '<-- ERROR HERE'."""
    mark = mark or {}
    width = max([len(str(a)) for prog in programs for a in prog] + [6]) + 2
    lines = ["step  " + "".join(f"rank {r}".ljust(width) for r in range(len(programs)))]
    for i in range(max((len(p) for p in programs), default=0)):
        cells = []
        for r, prog in enumerate(programs):
            text = str(prog[i]) if i < len(prog) else ""
            cells.append(("*" + text if mark.get(r) == i else text).ljust(width))
        flag = "  <-- ERROR HERE" if i in mark.values() else ""
        lines.append(f"{i:<6}" + "".join(cells).rstrip() + flag)
    return "\n".join(lines)
