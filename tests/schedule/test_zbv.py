"""ZB-V: the V placement, the schedule in both forms, its validation, simulation and configuration."""

import itertools
import random

import numpy as np
import pytest

from hpcpipe.config import from_dict
from hpcpipe.errors import ConfigError, ScheduleError
from hpcpipe.schedule.costs import Costs
from hpcpipe.schedule.event_sim import simulate, simulate_schedule
from hpcpipe.schedule.ir import IDLE, Action, I, PipeShape, Timeline, W, chunk_stage, rank_stages, stage_rank
from hpcpipe.schedule.lower import lower
from hpcpipe.schedule.registry import build_schedule, build_timeline, placement_of
from hpcpipe.schedule.sweep import simulate_timeline
from hpcpipe.schedule.validate_programs import validate_programs
from hpcpipe.schedule.validate_timeline import validate_timeline

GRID = list(itertools.product(range(1, 9), range(1, 33)))
UNIT = Costs(1, 2, 1)          # per whole stage: F = I = W = 1


def _v(pp, m):
    return PipeShape(pp, 2 * pp, m, "v")


def _lowered(pp, m, programs=None):
    programs = programs if programs is not None else build_schedule("zb-v", pp, m, 2)
    return lower(programs, _v(pp, m))


# ------------------------------------------------------------------------------------ placement ----

def test_v_placement_puts_stage_r_and_2p_minus_1_minus_r_on_rank_r():
    for pp in range(1, 9):
        for r in range(pp):
            assert rank_stages(r, pp, 2 * pp, "v") == [r, 2 * pp - 1 - r]
            assert rank_stages(r, pp, 3 * pp, "interleaved") == [r, pp + r, 2 * pp + r]
        for s in range(4 * pp):
            for placement in ("v", "interleaved"):
                r = stage_rank(s, pp, placement)
                assert chunk_stage(s // pp, r, pp, placement) == s
    assert stage_rank(7, 4, "v") == 0 and stage_rank(4, 4, "v") == 3 and stage_rank(3, 4, "v") == 3
    ranks = np.arange(4)
    assert chunk_stage(1, ranks, 4, "v").tolist() == [7, 6, 5, 4]
    assert placement_of("zb-v") == "v" and placement_of("zb-h1") == "interleaved"


def test_unknown_placement_and_schedule_are_named():
    with pytest.raises(ScheduleError, match="unknown stage placement 'w'"):
        stage_rank(1, 2, "w")
    with pytest.raises(ScheduleError, match="unknown schedule 'zb-x'"):
        placement_of("zb-x")
    with pytest.raises(ScheduleError, match="stages must be a multiple of pp"):
        rank_stages(0, 3, 7, "v")


# ------------------------------------------------------------------------ schedule and validator ----

def test_zbv_needs_two_virtual_stages():
    for v in (1, 3):
        with pytest.raises(ScheduleError, match=rf"zb-v .*virtual stages must be 2, got {v}"):
            build_schedule("zb-v", 4, 8, v)
        with pytest.raises(ScheduleError, match=rf"virtual stages must be 2, got {v}"):
            build_timeline("zb-v", 4, 8, v)


def test_zbv_action_lists_are_its_timeline_and_validate_over_the_grid():
    for pp, m in GRID:
        tl = build_timeline("zb-v", pp, m, 2)
        assert tl.placement == "v" and tl.n_stages == 2 * pp
        programs = build_schedule("zb-v", pp, m, 2)
        assert programs == tl.actions(), (pp, m)
        for r, prog in enumerate(programs):
            assert sorted({a.stage for a in prog}) == sorted(rank_stages(r, pp, 2 * pp, "v"))
            assert len(prog) == 6 * m                     # F, I, W of both chunks
        lowered = _lowered(pp, m, programs)
        validate_programs(lowered, _v(pp, m))
        validate_timeline(tl)
        if pp > 1:
            # the V's turn on rank pp - 1 is local: no message between stage pp - 1 and pp
            turn = [a for a in lowered[pp - 1] if a.op.startswith(("SEND", "RECV"))]
            assert all(a.peer in (pp - 2,) for a in turn), turn


def test_zbv_runs_loss_stage_on_rank_0():
    programs = build_schedule("zb-v", 4, 8, 2)
    assert {a.stage for a in programs[0]} == {0, 7}
    lowered = _lowered(4, 8, programs)
    # rank 0 receives chunk b's input from rank 1 and never receives a gradient for the loss stage
    assert any(a.op == "RECV_F" and a.stage == 7 and a.peer == 1 for a in lowered[0])
    assert not any(a.op == "RECV_B" and a.stage == 7 for a in lowered[0])


def _edit(tl: Timeline, **cells) -> Timeline:
    arrays = {"ops": tl.ops.copy(), "chunk": np.array(tl.chunk), "mb": tl.mb.copy()}
    for name, edits in cells.items():
        for r, t, value in edits:
            arrays[name][r, t] = value
    return Timeline(tl.name, tl.pp, tl.n_micro, tl.virtual, arrays["ops"], arrays["chunk"], arrays["mb"],
                    tl.placement)


def _tick(tl: Timeline, rank: int, op: int, chunk: int, mb: int) -> int:
    hit = np.flatnonzero((tl.ops[rank] == op) & (tl.chunk[rank] == chunk) & (tl.mb[rank] == mb))
    return int(hit[0])


def test_validators_reject_broken_zbv_variants():
    tl = build_timeline("zb-v", 4, 8, 2)
    ok = build_schedule("zb-v", 4, 8, 2)
    # the right programs under the wrong placement: stages on ranks that do not own them
    with pytest.raises(ScheduleError, match="belongs to rank"):
        validate_programs(lower(ok, PipeShape(4, 8, 8, "interleaved")), PipeShape(4, 8, 8, "interleaved"))
    # a missing action
    dropped = [list(p) for p in ok]
    dropped[2].pop()                      # its last W
    with pytest.raises(ScheduleError, match="needs exactly one B, or one I and one W"):
        validate_programs(_lowered(4, 8, dropped), _v(4, 8))
    # chunk b's forwards out of micro-batch order on one rank: that channel is FIFO
    swapped = [list(p) for p in ok]
    f = [i for i, a in enumerate(swapped[1]) if a.op == "F" and a.stage == 6]
    swapped[1][f[0]], swapped[1][f[1]] = swapped[1][f[1]], swapped[1][f[0]]
    with pytest.raises(ScheduleError, match="arrive in order|deadlock"):
        validate_programs(_lowered(4, 8, swapped), _v(4, 8))
    # a W before its I
    w_first = [list(p) for p in ok]
    i = next(k for k, a in enumerate(w_first[3]) if a.op == "I")
    w = next(k for k, a in enumerate(w_first[3]) if a.op == "W" and (a.stage, a.mb) == (w_first[3][i].stage,
                                                                                        w_first[3][i].mb))
    w_first[3].insert(i, w_first[3].pop(w))
    with pytest.raises(ScheduleError, match="before its input-gradient I"):
        validate_programs(_lowered(4, 8, w_first), _v(4, 8))
    # timeline forms: a duplicate, an action out of range, and one out of dependency order
    t = _tick(tl, 0, I, 1, 0)
    with pytest.raises(ScheduleError):
        validate_timeline(_edit(tl, ops=[(0, t, W)]))
    with pytest.raises(ScheduleError, match="micro-batch 8, outside 0..7"):
        validate_timeline(_edit(tl, mb=[(0, t, 8)]))
    # rank 0's loss-stage F(0) dropped from the timeline
    with pytest.raises(ScheduleError, match="runs before its forward"):
        validate_timeline(_edit(tl, ops=[(0, _tick(tl, 0, 0, 1, 0), IDLE)]))


def test_timeline_out_of_dependency_order_is_refused_with_valid_programs():
    tl = build_timeline("zb-v", 3, 4, 2)
    # rank 2 (the turn) runs everything one tick earlier: same program, but its first F precedes its input
    ops = np.concatenate([tl.ops, np.full((3, 1), IDLE, np.int8)], axis=1)
    chunk = np.concatenate([np.array(tl.chunk), np.zeros((3, 1), tl.chunk.dtype)], axis=1)
    mb = np.concatenate([tl.mb, np.zeros((3, 1), tl.mb.dtype)], axis=1)
    for arr in (ops, chunk, mb):
        arr[2] = np.roll(arr[2], -1)
    moved = Timeline(tl.name, 3, 4, 2, ops, chunk, mb, "v")
    validate_programs(_lowered(3, 4, moved.actions()), _v(3, 4))          # the programs are fine
    with pytest.raises(ScheduleError, match="not in dependency order"):
        validate_timeline(moved)
    with pytest.raises(ScheduleError, match="not in dependency order"):
        simulate_timeline(moved, Costs(1, 2, 1, 0.1))


# ---------------------------------------------------------------------------------- simulation ----

def _same(a, b):
    return (a.step_time, a.bubble, a.busy, a.peak_stashed, a.peak_stashed_stage) == \
        (b.step_time, b.bubble, b.busy, b.peak_stashed, b.peak_stashed_stage)


def test_both_simulators_agree_on_zbv_with_random_costs():
    rng = random.Random(5)
    count = 0
    for pp, m in itertools.product(range(1, 6), (1, 2, 3, 5, 8, 11)):
        tl = build_timeline("zb-v", pp, m, 2)
        programs = _lowered(pp, m, tl.actions())
        for _ in range(3):
            per_stage = {(op, s): rng.choice([0.0, 0.3, 1.0, 2.2]) for op in "FIW" for s in range(2 * pp)
                         if rng.random() < 0.6}
            b = rng.uniform(0.2, 3.0)
            costs = Costs(rng.uniform(0.1, 3.0), b, rng.uniform(0.0, b), rng.choice([0.0, 0.37, 2.5]),
                          rng.choice([0.0, 0.5]), per_stage)
            swept = simulate_timeline(tl, costs, block=rng.choice([1, 7]))
            assert _same(simulate(programs, _v(pp, m), costs), swept), (pp, m, costs)
            count += 1
    assert count >= 90


def test_comm_cost_skips_the_local_turn():
    # with a message cost, the V's turn on rank pp - 1 pays none: both simulators agree on it
    costs = Costs(1, 2, 1, 0.5)
    fast = simulate_schedule("zb-v", 4, 8, 2, costs, events=False)
    slow = simulate_schedule("zb-v", 4, 8, 2, costs)
    assert _same(fast, slow)
    assert fast.step_time > simulate_schedule("zb-v", 4, 8, 2, Costs(1, 2, 1), events=False).step_time


def test_unit_cost_bubble_is_below_zbh1_and_1f1b_and_memory_is_2p_chunks():
    for pp in range(2, 9):
        for m in range(1, 33):
            zbv = simulate_schedule("zb-v", pp, m, 2, UNIT, events=False)
            zbh1 = simulate_schedule("zb-h1", pp, m, 1, UNIT, events=False)
            ofob = simulate_schedule("1f1b", pp, m, 1, UNIT, events=False)
            assert zbv.bubble <= zbh1.bubble < ofob.bubble or m == 1 and zbv.bubble <= zbh1.bubble, (pp, m)
            if m >= pp:
                assert zbv.bubble <= 0.6 * zbh1.bubble, (pp, m, zbv.bubble, zbh1.bubble)
            # at most 2p chunk activations (p stages' worth: 1F1B's first rank) on every rank
            assert zbv.peak_stashed == [min(2 * pp, 2 * m)] * pp, (pp, m)
            assert set(zbv.peak_stashed_stage) == set(range(2 * pp))
    assert simulate_schedule("zb-v", 4, 8, 2, UNIT, events=False).step_time == 25.5
    assert simulate_schedule("zb-v", 8, 32, 2, UNIT, events=False).step_time == 99.5
    # one micro-batch past a multiple of p: W's free memory for a capped chunk-b forward first
    assert simulate_schedule("zb-v", 8, 9, 2, UNIT, events=False).step_time == 30.5


def test_pp1_is_two_local_stages():
    tl = build_timeline("zb-v", 1, 3, 2)
    assert [str(a) for a in tl.actions()[0][:3]] == ["s0F0", "s1F0", "s1I0"]
    assert not any(a.op.startswith(("SEND", "RECV")) for a in _lowered(1, 3)[0])
    assert _same(simulate(_lowered(1, 3), _v(1, 3), UNIT.scaled(0.5)), simulate_timeline(tl, UNIT.scaled(0.5)))


# ---------------------------------------------------------------------------------------- config ----

def test_config_requires_two_virtual_stages_and_enough_layers():
    with pytest.raises(ConfigError, match=r"zb-v.*parallel.virtual_stages = 2, got 1"):
        from_dict({"parallel": {"pp": 2, "dp": 1, "schedule": "zb-v", "virtual_stages": 1}})
    with pytest.raises(ConfigError, match=r"parallel.pp \(4\) x parallel.virtual_stages \(2\) exceeds"):
        from_dict({"parallel": {"pp": 4, "dp": 1, "schedule": "zb-v", "virtual_stages": 2},
                   "model": {"dims": [8] * 5}})
    cfg = from_dict({"parallel": {"pp": 2, "dp": 1, "schedule": "zb-v", "virtual_stages": 2}})
    assert cfg.parallel.schedule == "zb-v"


def test_plan_places_stages_in_a_v():
    from hpcpipe.train.setup import prepare

    cfg = from_dict({"parallel": {"pp": 4, "dp": 1, "schedule": "zb-v", "virtual_stages": 2},
                     "model": {"dims": [8] * 9}, "train": {"micro_batches": 6}})
    p = prepare(cfg, 4)
    assert p.shape.placement == "v" and p.n_stages == 8
    assert [a.stage for a in p.programs[0] if a.op == "F"][:1] == [0]
    assert {a.stage for a in p.programs[0] if a.op in ("F", "I", "W")} == {0, 7}
    assert Action("F", 4, 0) in p.programs[3]
