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

    Timeline for pp = 4, m = 4 (F = 1 tick, B = 2 ticks; ``python -m hpcpipe.simulate
    --schedule gpipe --pp 4 --micro-batches 4 --ascii``)::

        rank 0  F0 F1 F2 F3 .  .  .  .  .  .  .  .  .  B0 B0 B1 B1 B2 B2 B3 B3
        rank 1  .  F0 F1 F2 F3 .  .  .  .  .  .  B0 B0 B1 B1 B2 B2 B3 B3 .  .
        rank 2  .  .  F0 F1 F2 F3 .  .  .  B0 B0 B1 B1 B2 B2 B3 B3 .  .  .  .
        rank 3  .  .  .  F0 F1 F2 F3 B0 B0 B1 B1 B2 B2 B3 B3 .  .  .  .  .  .

    Bubble fraction (p - 1) / (m + p - 1); every stage stashes the activations
    of all m micro-batches before the first backward (peak m).
    """
    _check_sizes("gpipe", pp, n_micro, virtual)
    if virtual != 1:
        raise ScheduleError(f"gpipe runs one stage per rank (virtual stages: {virtual}); "
                            f"use an interleaved schedule for virtual_stages > 1")
    return [[Action("F", r, m) for m in range(n_micro)] + [Action("B", r, m) for m in range(n_micro)]
            for r in range(pp)]


def one_f_one_b(pp: int, n_micro: int, virtual: int = 1) -> list[list[Action]]:
    """1F1B / PipeDream-flush (Narayanan et al. 2019): warm up, then alternate one F with one B.

    Rank r runs w = min(pp - r - 1, m) warm-up forwards, then m - w (F, B)
    pairs, then the last w backwards. Timeline for pp = 4, m = 6 (F = 1 tick,
    B = 2 ticks; from the simulator's ``--ascii``)::

        rank 0  F0 F1 F2 F3 .  .  .  .  .  .  B0 B0 F4 B1 B1 F5 B2 B2 .  B3 B3 .  B4 B4 .  B5 B5
        rank 1  .  F0 F1 F2 .  .  .  .  B0 B0 F3 B1 B1 F4 B2 B2 F5 B3 B3 .  B4 B4 .  B5 B5 .  .
        rank 2  .  .  F0 F1 .  .  B0 B0 F2 B1 B1 F3 B2 B2 F4 B3 B3 F5 B4 B4 .  B5 B5 .  .  .  .
        rank 3  .  .  .  F0 B0 B0 F1 B1 B1 F2 B2 B2 F3 B3 B3 F4 B4 B4 F5 B5 B5 .  .  .  .  .  .

    Bubble fraction (p - 1) / (m + p - 1), as GPipe, but rank r stashes at most
    min(p - r, m) micro-batches instead of m.
    """
    _check_sizes("1f1b", pp, n_micro, virtual)
    if virtual != 1:
        raise ScheduleError(f"1f1b runs one stage per rank (virtual stages: {virtual}); "
                            f"use interleaved-1f1b for virtual_stages > 1")
    programs = []
    for r in range(pp):
        warm = min(pp - r - 1, n_micro)
        prog = [Action("F", r, m) for m in range(warm)]
        for i in range(n_micro - warm):
            prog += [Action("F", r, warm + i), Action("B", r, i)]
        prog += [Action("B", r, m) for m in range(n_micro - warm, n_micro)]
        programs.append(prog)
    return programs


def _interleaved_order(pp: int, n_micro: int, virtual: int, backward: bool) -> list[tuple[int, int]]:
    """Megatron's (chunk, micro-batch) order on one rank: groups of pp micro-batches, chunk by chunk."""
    order = []
    for first in range(0, n_micro, pp):
        group = range(first, min(first + pp, n_micro))
        chunks = range(virtual - 1, -1, -1) if backward else range(virtual)
        order += [(c, m) for c in chunks for m in group]
    return order


def interleaved_1f1b(pp: int, n_micro: int, virtual: int = 2) -> list[list[Action]]:
    """Interleaved 1F1B (Megatron-LM, Narayanan et al. 2021): v model chunks per rank, 1F1B over chunks.

    Stage s = c * pp + r is chunk c of rank r. Each rank walks micro-batches in
    groups of pp, through its chunks in order (forward) or reverse order
    (backward), with w = (pp - r - 1) * 2 + (v - 1) * pp warm-up forwards
    (capped at v * m) before alternating. Timeline for pp = 2, v = 2, m = 4
    (a letter names the chunk: ``a`` = stages 0, 1, ``b`` = stages 2, 3; a chunk
    forward takes 1 tick, a chunk backward 2)::

        rank 0  F0a F1a F0b F1b F2a .   B0b B0b F3a B1b B1b F2b B0a B0a F3b B1a B1a .   B2b B2b .   B3b B3b B2a B2a B3a B3a
        rank 1  .   F0a F1a F0b B0b B0b F1b B1b B1b F2a B0a B0a F3a B1a B1a F2b B2b B2b F3b B3b B3b B2a B2a B3a B3a .   .

    Each chunk costs 1/v of a
    stage, so the bubble shrinks v-fold: idle / compute = (p - 1) / (v * m).
    Peak stash on rank r: w + 1 chunk activations (each 1/v of a stage's).
    Requires m to be a multiple of pp (Megatron's rule) when v > 1.
    """
    _check_sizes("interleaved-1f1b", pp, n_micro, virtual)
    if virtual > 1 and n_micro % pp:
        raise ScheduleError(f"interleaved-1f1b needs micro-batches to be a multiple of pp "
                            f"(micro-batches: {n_micro}, pp: {pp}, virtual stages: {virtual})")
    if virtual == 1:
        return one_f_one_b(pp, n_micro, 1)
    total = virtual * n_micro
    fwd = _interleaved_order(pp, n_micro, virtual, backward=False)
    bwd = _interleaved_order(pp, n_micro, virtual, backward=True)
    programs = []
    for r in range(pp):
        warm = min((pp - r - 1) * 2 + (virtual - 1) * pp, total)
        prog = [Action("F", c * pp + r, m) for c, m in fwd[:warm]]
        for i in range(total - warm):
            c, m = fwd[warm + i]
            prog.append(Action("F", c * pp + r, m))
            c, m = bwd[i]
            prog.append(Action("B", c * pp + r, m))
        prog += [Action("B", c * pp + r, m) for c, m in bwd[total - warm:]]
        programs.append(prog)
    return programs


def zero_bubble_h1(pp: int, n_micro: int, virtual: int = 1) -> list[list[Action]]:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): split B into I and W, fill bubbles with W.

    The input-gradient half I is all the previous stage waits for, and the
    weight-gradient half W has no consumer, so W can fill what would be idle
    time. The order comes from a greedy list schedule on unit costs
    (F = I = W = 1, free messages): when a rank is free it runs the next F if
    its input has arrived, it is at most pp - r ahead of I (1F1B's warm-up)
    and fewer than min(p, m) micro-batches wait for their W; else an I whose
    gradient has arrived; else the oldest pending W. Timeline for pp = 4,
    m = 6 (from the simulator's ``--ascii``)::

        rank 0  F0 F1 F2 F3 .  .  .  I0 W0 F4 I1 W1 F5 I2 W2 I3 W3 I4 W4 I5 W5
        rank 1  .  F0 F1 F2 .  .  I0 F3 I1 W0 F4 I2 W1 F5 I3 W2 I4 W3 I5 W4 W5
        rank 2  .  .  F0 F1 .  I0 F2 I1 F3 I2 W0 F4 I3 W1 F5 I4 W2 I5 W3 W4 W5
        rank 3  .  .  .  F0 I0 F1 I1 F2 I2 F3 I3 W0 F4 I4 W1 F5 I5 W2 W3 W4 W5

    Idle time per rank (p - 1)(F + I - W) instead of 1F1B's (p - 1)(F + B):
    a third of it when F = I = W. Every rank holds at most min(p, m)
    micro-batches between F and W: the peak of 1F1B's first rank (Qi et
    al.'s "same peak memory as 1F1B"), now on every rank.
    """
    _check_sizes("zb-h1", pp, n_micro, virtual)
    if virtual != 1:
        raise ScheduleError(f"zb-h1 runs one stage per rank (virtual stages: {virtual})")
    return _greedy_split(pp, n_micro)


def _greedy_split(pp: int, n_micro: int) -> list[list[Action]]:
    """Unit-cost greedy list schedule of F / I / W on one stage per rank (rules in zero_bubble_h1)."""
    programs: list[list[Action]] = [[] for _ in range(pp)]
    f_ready = [[0 if r == 0 else -1] * n_micro for r in range(pp)]      # tick the input is available
    i_ready = [[-1] * n_micro for _ in range(pp)]                        # tick the output gradient is available
    next_f, next_i, next_w = [0] * pp, [0] * pp, [0] * pp
    remaining = 3 * pp * n_micro
    tick = 0
    limit = 3 * n_micro * pp + pp   # every tick some rank works: all ranks' work in sequence is the worst case
    while remaining:
        if tick > limit:
            raise ScheduleError(f"zb-h1 list schedule made no progress (pp: {pp}, micro-batches: {n_micro})")
        done_f, done_i = [], []
        for r in range(pp):
            f, i, w = next_f[r], next_i[r], next_w[r]
            # F first keeps the forward wave (and so the backward chain behind it) moving;
            # f - i < pp - r is 1F1B's warm-up rule, f - w < min(pp, m) bounds the activations held.
            if (f < n_micro and 0 <= f_ready[r][f] <= tick and f - i < pp - r
                    and f - w < min(pp, n_micro)):
                programs[r].append(Action("F", r, f))
                next_f[r] += 1
                done_f.append((r, f))
            elif i < n_micro and 0 <= i_ready[r][i] <= tick and i < f:
                programs[r].append(Action("I", r, i))
                next_i[r] += 1
                done_i.append((r, i))
            elif w < i:
                programs[r].append(Action("W", r, w))
                next_w[r] += 1
            else:
                continue
            remaining -= 1
        # results become visible to neighbours at the next tick
        for r, m in done_f:
            if r + 1 < pp:
                f_ready[r + 1][m] = tick + 1
            else:
                i_ready[r][m] = tick + 1
        for r, m in done_i:
            if r > 0:
                i_ready[r - 1][m] = tick + 1
        tick += 1
    return programs


ScheduleFn = Callable[[int, int, int], list[list[Action]]]

SCHEDULES: dict[str, ScheduleFn] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved_1f1b,
    "zb-h1": zero_bubble_h1,
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
