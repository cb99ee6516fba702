"""Schedules in array form: timelines, the vectorised validator and the vectorised simulator.

The per-action code (``lower`` + ``validate`` + ``simulate``) is the reference:
the vectorised path must give the same verdicts and the same numbers.
"""

import itertools
import random

import numpy as np
import pytest
from support.timelines import mutate, per_action_verdict

from hpcpipe.errors import ScheduleError
from hpcpipe.schedule.costs import Costs
from hpcpipe.schedule.event_sim import simulate, simulate_schedule
from hpcpipe.schedule.ir import IDLE, Timeline
from hpcpipe.schedule.lower import lower
from hpcpipe.schedule.registry import SCHEDULES, build_schedule, build_timeline
from hpcpipe.schedule.render import ascii_timeline, sim_rows
from hpcpipe.schedule.sweep import simulate_timeline
from hpcpipe.schedule.validate_programs import validate_programs
from hpcpipe.schedule.validate_timeline import validate_timeline
from hpcpipe.simulate import main

SIZES = [(p, m, v) for p in range(1, 9) for m in (1, 2, 3, 4, 5, 8, 12, 13, 16, 24, 32) for v in (1, 2, 3)]


def _timelines(names=tuple(SCHEDULES), sizes=SIZES):
    for name in names:
        for p, m, v in sizes:
            try:
                yield build_timeline(name, p, m, v)
            except ScheduleError:
                continue        # a combination the schedule refuses (test_schedules pins those)


def _random_costs(rng: random.Random, n_stages: int) -> Costs:
    per_stage = {}
    if rng.random() < 0.5:
        per_stage = {(op, s): rng.choice([0.0, 0.25, 1.0, 1.7, 3.3]) for op in "FBIW" for s in range(n_stages)
                     if rng.random() < 0.7}
    backward = rng.uniform(0.1, 3.0)
    return Costs(rng.uniform(0.1, 3.0), backward, rng.uniform(0.0, backward), rng.choice([0.0, 0.0, 0.37, 2.5]),
                 rng.choice([0.0, 0.5]), per_stage)


def _same(a, b):
    """Everything a simulation reports except the events, compared exactly (same floating-point operations)."""
    return (a.step_time, a.bubble, a.busy, a.peak_stashed, a.peak_stashed_stage) == \
        (b.step_time, b.bubble, b.busy, b.peak_stashed, b.peak_stashed_stage)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_vectorised_simulator_equals_per_action_simulator(name):
    rng = random.Random(name)
    count = 0
    for tl in _timelines((name,)):
        programs = lower(tl.actions(), tl.shape)
        for _ in range(2):
            costs = _random_costs(rng, tl.n_stages)
            reference = simulate(programs, tl.shape, costs)
            fast = simulate_timeline(tl, costs, block=rng.choice([1, 5, 128]))
            assert _same(reference, fast), (name, tl.pp, tl.n_micro, tl.virtual, costs)
            assert fast.events is None
            count += 1
    assert count >= 100


def test_simulate_schedule_without_events_takes_the_vectorised_path_with_the_same_numbers():
    for name, p, m, v in [("gpipe", 4, 8, 1), ("1f1b", 8, 32, 1), ("interleaved-1f1b", 4, 8, 2), ("zb-h1", 5, 7, 1)]:
        costs = Costs(1.0, 2.0, 0.75, 0.1, 0.4)
        slow = simulate_schedule(name, p, m, v, costs)
        fast = simulate_schedule(name, p, m, v, costs, events=False)
        assert slow.events is not None and fast.events is None
        assert _same(slow, fast)


def test_shared_cores_and_infinite_costs_stay_on_the_per_action_path():
    assert simulate_schedule("1f1b", 4, 8, cores=2, events=False).events is not None
    assert simulate_schedule("1f1b", 4, 8, cores=4, events=False).events is None   # a core each: no sharing
    slow = simulate_schedule("1f1b", 2, 2, costs=Costs(1, float("inf")), events=False)
    assert slow.events is not None and slow.step_time == float("inf")
    with pytest.raises(ScheduleError, match="finite costs"):
        simulate_timeline(build_timeline("1f1b", 2, 2), Costs(1, float("inf")))


def test_vectorised_results_cannot_be_drawn():
    fast = simulate_schedule("gpipe", 2, 2, events=False)
    with pytest.raises(ScheduleError, match="no per-action events"):
        ascii_timeline(fast)
    with pytest.raises(ScheduleError, match="no per-action events"):
        sim_rows(fast)


def test_every_builtin_timeline_validates_and_agrees_with_the_validator():
    count = 0
    for tl in _timelines():
        validate_timeline(tl)
        validate_timeline(tl, ranks_per_pass=1)
        validate_programs(lower(tl.actions(), tl.shape), tl.shape)
        count += 1
    assert count >= 400


def test_larger_sizes_with_wider_index_types():
    # micro-batch numbers past int8 and int16, chunk x micro-batch keys past int16: both paths agree
    for name, p, m, v in [("interleaved-1f1b", 2, 200, 2), ("1f1b", 3, 40000, 1), ("zb-h1", 3, 300, 1),
                          ("zb-v", 3, 300, 2)]:
        tl = build_timeline(name, p, m, v)
        assert tl.mb.dtype == (np.int16 if m <= 32768 else np.int32)
        validate_timeline(tl)
        if m <= 300:
            costs = Costs(1.0, 2.5, 1.25, 0.5)
            programs = lower(tl.actions(), tl.shape)
            assert _same(simulate(programs, tl.shape, costs), simulate_timeline(tl, costs))
        else:       # too many actions for the per-action simulator in a unit test: 1F1B's closed form
            fast = simulate_timeline(tl, Costs(1.0, 2.5, 1.25, 0.0))
            assert fast.step_time == (m + p - 1) * 3.5
            assert fast.peak_stashed == [3, 2, 1]


def test_timeline_arrays_are_read_only_and_shaped():
    tl = build_timeline("interleaved-1f1b", 4, 8, 2)
    assert tl.ops.shape == tl.mb.shape == tl.chunk.shape == (4, tl.n_ticks)
    assert tl.n_stages == 8
    with pytest.raises(ValueError):
        tl.ops[0, 0] = 1
    one = build_timeline("1f1b", 4, 8)
    assert not one.chunk.any() and one.chunk.strides == (0, 0)     # no chunk array for one stage per rank
    with pytest.raises(ScheduleError, match=r"mb has shape \(3, 2\), expected \(pp, ticks\) = \(2, 2\)"):
        Timeline("x", 2, 1, 1, np.zeros((2, 2), np.int8), np.zeros((2, 2), np.int8), np.zeros((3, 2), np.int8),
                 "interleaved")


# ----------------------------------------------------------------------------- broken timelines ----

def _edit(tl: Timeline, **cells) -> Timeline:
    """A copy of tl with cells replaced: name=(rank, tick, value) or a list of them, for ops / chunk / mb."""
    arrays = {"ops": tl.ops.copy(), "chunk": np.array(tl.chunk), "mb": tl.mb.copy()}
    for name, edits in cells.items():
        for rank, tick, value in edits if isinstance(edits, list) else [edits]:
            arrays[name][rank, tick] = value
    return Timeline(tl.name, tl.pp, tl.n_micro, tl.virtual, arrays["ops"], arrays["chunk"], arrays["mb"], tl.placement)


def _tick(tl: Timeline, rank: int, op: int, mb: int, chunk: int = 0) -> int:
    hit = np.flatnonzero((tl.ops[rank] == op) & (tl.mb[rank] == mb) & (tl.chunk[rank] == chunk))
    return int(hit[0])


def test_validator_names_a_missing_a_duplicate_and_an_out_of_range_action():
    tl = build_timeline("1f1b", 3, 4)
    t = _tick(tl, 1, 1, 2)
    with pytest.raises(ScheduleError, match="rank 1 runs 3 backwards, expected 4"):
        validate_timeline(_edit(tl, ops=(1, t, IDLE)))
    t = _tick(tl, 0, 1, 2)
    with pytest.raises(ScheduleError, match="rank 0: the backward of stage 0 micro-batch 1 appears 2 times"):
        validate_timeline(_edit(tl, mb=(0, t, 1)))                  # B1 twice, B2 never
    with pytest.raises(ScheduleError, match="rank 2 tick 3 has micro-batch 9, outside 0..3"):
        validate_timeline(_edit(tl, mb=(2, 3, 9)))
    with pytest.raises(ScheduleError, match="op code 7"):
        validate_timeline(_edit(tl, ops=(0, 0, 7)))


def test_validator_catches_out_of_order_messages():
    tl = build_timeline("gpipe", 2, 3)
    # rank 1 runs its forwards of micro-batches 0 and 1 the other way round: the channel delivers 0 first
    a, b = _tick(tl, 1, 0, 0), _tick(tl, 1, 0, 1)
    with pytest.raises(ScheduleError, match="messages on a channel arrive in order"):
        validate_timeline(_edit(tl, mb=[(1, a, 1), (1, b, 0)]))


def test_validator_catches_a_timeline_out_of_dependency_order():
    tl = build_timeline("gpipe", 2, 2)
    # rank 1 one tick earlier: its F0 at tick 0, when rank 0's F0 (tick 0) has not been sent yet; the
    # programs are the same, the ticks impossible
    ops, mb = tl.ops.copy(), tl.mb.copy()
    ops[1], mb[1] = np.roll(ops[1], -1), np.roll(mb[1], -1)
    moved = Timeline(tl.name, 2, 2, 1, ops, tl.chunk, mb, "interleaved")
    with pytest.raises(ScheduleError, match="not in dependency order: rank 1 runs s1F0 at tick 0"):
        validate_timeline(moved)
    with pytest.raises(ScheduleError, match="not in dependency order: rank 1 runs s1F0 at tick 0"):
        simulate_timeline(moved, Costs())
    validate_programs(lower(moved.actions(), moved.shape), moved.shape)      # the programs themselves are fine


def test_validator_catches_backward_before_forward_and_w_before_i():
    tl = build_timeline("1f1b", 1, 2, 1)
    a, b = _tick(tl, 0, 0, 1), _tick(tl, 0, 1, 1)
    swapped = _edit(tl, ops=[(0, a, 1), (0, b, 0)])
    with pytest.raises(ScheduleError, match="s0B1 runs before its forward"):
        validate_timeline(swapped)
    zb = build_timeline("zb-h1", 2, 3)
    # rank 1's W0 moved to its first (idle) tick, before I0: the W's keep the I's order
    assert zb.ops[1, 0] == IDLE
    with pytest.raises(ScheduleError, match="s1W0 runs before its input-gradient I"):
        validate_timeline(_edit(zb, ops=[(1, 0, 3), (1, _tick(zb, 1, 3, 0), IDLE)]))


def test_vectorised_validator_agrees_with_the_per_action_one_on_mutated_timelines():
    rng = random.Random(7)
    sizes = list(itertools.product(range(1, 6), range(1, 7), range(1, 4)))
    verdicts = {True: 0, False: 0}
    while sum(verdicts.values()) < 1500:
        name = rng.choice(sorted(SCHEDULES))
        p, m, v = rng.choice(sizes)
        try:
            tl = build_timeline(name, p, m, v)
        except ScheduleError:
            continue
        for _ in range(rng.randint(1, 2)):
            tl = mutate(tl, rng)
        want = per_action_verdict(tl)
        try:
            validate_timeline(tl, ranks_per_pass=rng.choice([1, 2, 16]))
            got = True
        except ScheduleError:
            got = False
        assert got == want, (name, p, m, v, tl.ops.tolist(), tl.chunk.tolist(), tl.mb.tolist())
        verdicts[want] += 1
        if want:    # a valid mutant: the simulators agree on it too
            costs = _random_costs(rng, tl.n_stages)
            programs = lower(tl.actions(), tl.shape)
            assert _same(simulate(programs, tl.shape, costs), simulate_timeline(tl, costs))
    assert verdicts[True] >= 100 and verdicts[False] >= 500


def test_out_of_order_timeline_with_valid_programs_is_refused_by_the_simulator():
    rng = random.Random(3)
    refused = 0
    for _ in range(3000):
        name = rng.choice(sorted(SCHEDULES))
        p, m, v = rng.randint(2, 5), rng.randint(1, 6), rng.randint(1, 3)
        try:
            tl = build_timeline(name, p, m, v)
        except ScheduleError:
            continue
        tl = mutate(tl, rng)
        try:
            validate_programs(lower(tl.actions(), tl.shape), tl.shape)
        except ScheduleError:
            continue
        if not per_action_verdict(tl):
            with pytest.raises(ScheduleError, match="not in dependency order"):
                simulate_timeline(tl, Costs(1, 2, 1, 0.1))
            refused += 1
    assert refused >= 50


# ----------------------------------------------------------------------------------------- CLI ----

def test_cli_says_which_path_and_whether_it_validated(capsys):
    assert main(["--schedule", "zb-h1", "--pp", "4", "--micro-batches", "8"]) == 0
    out = capsys.readouterr().out
    assert "simulator        vectorised" in out and "validation       vectorised (validate_timeline)" in out
    assert main(["--schedule", "1f1b", "--pp", "8", "--micro-batches", "32", "--no-validate"]) == 0
    out = capsys.readouterr().out
    assert "step time        117" in out and "validation       SKIPPED (--no-validate)" in out
    assert main(["--schedule", "1f1b", "--pp", "4", "--micro-batches", "4", "--per-action"]) == 0
    out = capsys.readouterr().out
    assert "simulator        per action" in out and "validation       per action (validate)" in out


def test_cli_fast_and_per_action_print_the_same_numbers(capsys):
    args = ["--schedule", "interleaved-1f1b", "--pp", "4", "--micro-batches", "8", "--virtual-stages", "3",
            "--costs", "1.1,2.3,0.9,0.2"]
    assert main(args) == 0
    fast = capsys.readouterr().out.splitlines()
    assert main(args + ["--per-action"]) == 0
    slow = capsys.readouterr().out.splitlines()
    assert fast[:5] == slow[:5]      # header, step time, bubble, peaks per rank and per stage


def test_action_lists_are_read_off_the_timeline():
    for name in SCHEDULES:
        tl = build_timeline(name, 4, 8, 2 if name in ("interleaved-1f1b", "zb-v") else 1)
        assert tl.actions() == build_schedule(name, 4, 8, tl.virtual)
