"""Timelines for the validator tests: the per-action verdict (the reference), and random mutations to judge."""

from __future__ import annotations

import random

import numpy as np

from hpcpipe.errors import ScheduleError
from hpcpipe.schedule.ir import IDLE, Timeline, chunk_stage
from hpcpipe.schedule.lower import lower
from hpcpipe.schedule.validate_programs import validate_programs


def per_action_verdict(tl: Timeline) -> bool:
    """The per-action validator, plus the Timeline promise: each message's producer at an earlier tick."""
    try:
        validate_programs(lower(tl.actions(), tl.shape), tl.shape)
    except ScheduleError:
        return False
    tick = {}
    for r, t in zip(*np.nonzero(tl.ops != IDLE), strict=True):
        op = {0: "F", 1: "G", 2: "G", 3: "W"}[int(tl.ops[r, t])]
        tick[(op, int(chunk_stage(int(tl.chunk[r, t]), int(r), tl.pp, tl.placement)), int(tl.mb[r, t]))] = int(t)
    if tl.pp == 1:
        return True
    return all(tick[(op, s - 1 if op == "F" else s + 1, mb)] < t for (op, s, mb), t in tick.items()
               if (op == "F" and s > 0) or (op == "G" and s < tl.n_stages - 1))


def mutate(tl: Timeline, rng: random.Random) -> Timeline:
    """A copy of tl with one random change: cells swapped, dropped or copied, a micro-batch, op or chunk changed,
    a rank's program shifted by a tick (valid or not: the validators must agree on it)."""
    ops, chunk, mb = tl.ops.copy(), np.array(tl.chunk), tl.mb.copy()
    r = rng.randrange(tl.pp)
    busy = np.flatnonzero(ops[r] != IDLE)
    kind = rng.randrange(7)
    t = int(rng.choice(busy))
    if kind == 0:                                   # swap two cells of a rank
        u = rng.randrange(tl.n_ticks)
        for arr in (ops, chunk, mb):
            arr[r, t], arr[r, u] = arr[r, u], arr[r, t]
    elif kind == 1:                                 # drop an action
        ops[r, t], chunk[r, t], mb[r, t] = IDLE, 0, 0
    elif kind == 2:                                 # copy an action into another cell
        u = rng.randrange(tl.n_ticks)
        for arr in (ops, chunk, mb):
            arr[r, u] = arr[r, t]
    elif kind == 3:
        mb[r, t] = rng.randrange(tl.n_micro)
    elif kind == 4:
        ops[r, t] = rng.randrange(4)
    elif kind == 5:                                 # same program, ticks shifted
        for arr in (ops, chunk, mb):
            arr[r] = np.roll(arr[r], rng.choice([-1, 1]))
    else:
        chunk[r, t] = rng.randrange(tl.virtual)
    return Timeline(tl.name, tl.pp, tl.n_micro, tl.virtual, ops, chunk, mb, tl.placement)
