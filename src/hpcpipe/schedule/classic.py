"""Classic schedules: GPipe, 1F1B and interleaved 1F1B, each a timeline and the action lists read off it."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from hpcpipe.errors import ScheduleError
from hpcpipe.schedule.ir import Action, B, F, Timeline, _check_sizes, _empty_grid, _timeline


def gpipe_timeline(pp: int, n_micro: int, virtual: int = 1) -> Timeline:
    """GPipe's timeline: rank r runs F(i) at tick r + i and B(i) at tick m + 2p - 2 - r + i."""
    _check_sizes("gpipe", pp, n_micro, virtual)
    if virtual != 1:
        raise ScheduleError(f"gpipe runs one stage per rank (virtual stages: {virtual}); "
                            f"use an interleaved schedule for virtual_stages > 1")
    ops, mb, _ = _empty_grid(pp, n_micro, 1, 2 * (n_micro + pp - 1))
    micro = np.arange(n_micro)
    for r in range(pp):
        ops[r, r:r + n_micro] = F
        mb[r, r:r + n_micro] = micro
        first_b = n_micro + 2 * pp - 2 - r     # one tick after rank r + 1's B(0)
        ops[r, first_b:first_b + n_micro] = B
        mb[r, first_b:first_b + n_micro] = micro
    return _timeline("gpipe", pp, n_micro, 1, ops, mb, None, "interleaved")


def gpipe(pp: int, n_micro: int, virtual: int = 1) -> list[list[Action]]:
    """GPipe (Huang et al. 2019): all forwards, then all backwards.

    Timeline for pp = 4, m = 4 (F = 1 tick, B = 2 ticks; ``python -m hpcpipe.simulate
    --schedule gpipe --pp 4 --micro-batches 4 --ascii``)::

        rank 0  F0 F1 F2 F3 .  .  .  .  .  .  .  .  .  B0 B0 B1 B1 B2 B2 B3 B3
        rank 1  .  F0 F1 F2 F3 .  .  .  .  .  .  B0 B0 B1 B1 B2 B2 B3 B3 .  .
        rank 2  .  .  F0 F1 F2 F3 .  .  .  B0 B0 B1 B1 B2 B2 B3 B3 .  .  .  .
        rank 3  .  .  .  F0 F1 F2 F3 B0 B0 B1 B1 B2 B2 B3 B3 .  .  .  .  .  .

    Bubble fraction (p - 1) / (m + p - 1); every stage stashes the activations
    of all m micro-batches before the first backward (peak m). Read off
    :func:`gpipe_timeline`.
    """
    return gpipe_timeline(pp, n_micro, virtual).actions()


def one_f_one_b_timeline(pp: int, n_micro: int, virtual: int = 1) -> Timeline:
    """1F1B's timeline: F(i) at tick r + i while i <= w, then B(i) at 2p - 1 - r + 2i with the later F's in between.

    With w = min(p - r - 1, m) warm-up forwards on rank r: F(i) for
    i < min(w + 1, m) at tick r + i, F(w + k) for k >= 1 at tick
    2p - 2 - r + 2k, and B(i) at tick 2p - 1 - r + 2i (one tick after rank
    r + 1's B(i), two after its own F(w + i)); 2(m + p - 1) ticks in all.
    """
    _check_sizes("1f1b", pp, n_micro, virtual)
    if virtual != 1:
        raise ScheduleError(f"1f1b runs one stage per rank (virtual stages: {virtual}); "
                            f"use interleaved-1f1b for virtual_stages > 1")
    ops, mb, _ = _empty_grid(pp, n_micro, 1, 2 * (n_micro + pp - 1))
    micro = np.arange(n_micro)
    for r in range(pp):
        warm = min(pp - r - 1, n_micro)
        lead = min(warm + 1, n_micro)          # forwards before the first backward
        ops[r, r:r + lead] = F
        mb[r, r:r + lead] = micro[:lead]
        later = n_micro - lead                 # forwards that each follow a backward
        first = 2 * pp - r
        ops[r, first:first + 2 * later:2] = F
        mb[r, first:first + 2 * later:2] = micro[lead:]
        first_b = 2 * pp - 1 - r
        ops[r, first_b:first_b + 2 * n_micro:2] = B
        mb[r, first_b:first_b + 2 * n_micro:2] = micro
    return _timeline("1f1b", pp, n_micro, 1, ops, mb, None, "interleaved")


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
    min(p - r, m) micro-batches instead of m. Read off :func:`one_f_one_b_timeline`.
    """
    return one_f_one_b_timeline(pp, n_micro, virtual).actions()


def interleaved_1f1b_timeline(pp: int, n_micro: int, virtual: int = 2) -> Timeline:
    """Interleaved 1F1B's timeline (v > 1; v = 1 is 1F1B's).

    Forwards and backwards follow Megatron's order (groups of pp
    micro-batches, chunk by chunk; backwards through the chunks in reverse),
    the same on every rank. Rank r runs w = min(2(p - r - 1) + (v - 1)p, vm)
    warm-up forwards, forward k at tick r + k + max(0, k - vp); then, with
    a = vp - 1 + 2(p - 1 - r), forward w + i at tick a + 2i and backward i at
    tick a + 2i + 1. Not the fastest unit-tick placement (a forward of chunk
    c > 0 on rank 0 can wait for rank p - 1), but every message goes to a
    later tick, which is all a timeline promises.
    """
    _check_sizes("interleaved-1f1b", pp, n_micro, virtual)
    if virtual > 1 and n_micro % pp:
        raise ScheduleError(f"interleaved-1f1b needs micro-batches to be a multiple of pp "
                            f"(micro-batches: {n_micro}, pp: {pp}, virtual stages: {virtual})")
    if virtual == 1:
        return replace(one_f_one_b_timeline(pp, n_micro, 1), name="interleaved-1f1b")
    total = virtual * n_micro
    k = np.arange(total)
    group, within = np.divmod(k, virtual * pp)
    fwd_chunk = within // pp
    bwd_chunk = virtual - 1 - fwd_chunk
    micro = group * pp + within % pp           # the same micro-batch sequence forwards and backwards
    ops, mb, chunk = _empty_grid(pp, n_micro, virtual, 2 * total + virtual * pp + 2 * pp - 3)
    fwd_chunk, bwd_chunk, micro = fwd_chunk.astype(chunk.dtype), bwd_chunk.astype(chunk.dtype), micro.astype(mb.dtype)
    for r in range(pp):
        warm = min((pp - r - 1) * 2 + (virtual - 1) * pp, total)
        steady = virtual * pp - 1 + 2 * (pp - 1 - r)
        # the forward ticks r + k + max(0, k - vp) for k < warm, then steady + 2i, and the backward ticks
        # steady + 1 + 2k are runs of consecutive or every-other ticks: strided slices, not index lists
        head = min(warm, virtual * pp + 1)    # k <= vp: tick r + k; k > vp: tick r + 2k - vp
        after = r + virtual * pp + 2
        runs = [(slice(r, r + head), slice(0, head)),
                (slice(after, after + 2 * (warm - head), 2), slice(head, warm)),
                (slice(steady, steady + 2 * (total - warm), 2), slice(warm, total))]
        for ticks, ks in runs:
            ops[r, ticks] = F
            chunk[r, ticks] = fwd_chunk[ks]
            mb[r, ticks] = micro[ks]
        b_ticks = slice(steady + 1, steady + 1 + 2 * total, 2)
        ops[r, b_ticks] = B
        chunk[r, b_ticks] = bwd_chunk
        mb[r, b_ticks] = micro
    return _timeline("interleaved-1f1b", pp, n_micro, virtual, ops, mb, chunk, "interleaved")


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
    Requires m to be a multiple of pp (Megatron's rule) when v > 1. Read off
    :func:`interleaved_1f1b_timeline`.
    """
    return interleaved_1f1b_timeline(pp, n_micro, virtual).actions()
