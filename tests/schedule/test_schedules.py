"""Schedules and the validator: every schedule over stages 1..8 x micro-batches 1..32 x virtual 1..3."""

import itertools

import pytest

from hpcpipe.errors import ScheduleError
from hpcpipe.schedule.classic import gpipe
from hpcpipe.schedule.ir import Action, PipeShape, rank_stages, stage_rank
from hpcpipe.schedule.lower import lower
from hpcpipe.schedule.registry import SCHEDULES, build_schedule, placement_of, shape_of
from hpcpipe.schedule.validate_programs import validate_programs

GRID = list(itertools.product(range(1, 9), range(1, 33), range(1, 4)))


def _supported(name: str, pp: int, m: int, v: int) -> bool:
    """The documented support matrix (what each schedule's docstring promises)."""
    if name == "interleaved-1f1b":
        return v == 1 or m % pp == 0
    if name == "zb-v":
        return v == 2
    return v == 1


def _check_program_facts(compute, pp, m, v, placement):
    """Independent of the validator: each (stage, mb) once per needed op, on its rank, F before backward."""
    n_stages = pp * v
    for rank, prog in enumerate(compute):
        seen = {}
        for i, a in enumerate(prog):
            assert stage_rank(a.stage, pp, placement) == rank, f"{a} on rank {rank}"
            assert (a.op, a.stage, a.mb) not in seen, f"{a} twice"
            seen[(a.op, a.stage, a.mb)] = i
        for s in rank_stages(rank, pp, n_stages, placement):
            for mb in range(m):
                f = seen[("F", s, mb)]
                if ("B", s, mb) in seen:
                    assert seen[("B", s, mb)] > f
                else:
                    assert f < seen[("I", s, mb)] < seen[("W", s, mb)]
        expected = v * m * (3 if any(a.op == "W" for a in prog) else 2)
        assert len(prog) == expected


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_schedule_validates_over_the_grid(name):
    supported = 0
    for pp, m, v in GRID:
        if not _supported(name, pp, m, v):
            with pytest.raises(ScheduleError) as err:
                build_schedule(name, pp, m, v)
            text = str(err.value)
            assert str(v) in text and name in text, text
            continue
        compute = build_schedule(name, pp, m, v)
        placement = placement_of(name)
        _check_program_facts(compute, pp, m, v, placement)
        shape = PipeShape(pp, pp * v, m, placement)
        programs = lower(compute, shape)
        validate_programs(programs, shape)
        sends = sum(a.op.startswith("SEND") for p in programs for a in p)
        recvs = sum(a.op.startswith("RECV") for p in programs for a in p)
        assert sends == recvs
        supported += 1
    assert supported >= 8 * 32


def test_interleaved_refuses_micro_batches_not_multiple_of_pp():
    with pytest.raises(ScheduleError, match=r"micro-batches: 6, pp: 4, virtual stages: 2"):
        build_schedule("interleaved-1f1b", 4, 6, 2)


def test_unknown_schedule_and_bad_sizes_are_named():
    with pytest.raises(ScheduleError, match="unknown schedule 'zb-x'"):
        build_schedule("zb-x", 2, 2)
    with pytest.raises(ScheduleError, match="micro-batches must be a positive integer, got 0"):
        build_schedule("1f1b", 2, 0)


def test_one_f_one_b_shape():
    programs = build_schedule("1f1b", 4, 6)
    assert [str(a) for a in programs[0][:6]] == ["s0F0", "s0F1", "s0F2", "s0F3", "s0B0", "s0F4"]
    assert [str(a) for a in programs[3][:4]] == ["s3F0", "s3B0", "s3F1", "s3B1"]


def _lowered(name, pp, m, v=1):
    return lower(build_schedule(name, pp, m, v), shape_of(name, pp, m, v))


def _shape(pp, m):
    return PipeShape(pp, pp, m, "interleaved")


def test_validator_catches_a_missing_action():
    programs = _lowered("1f1b", 3, 4)
    programs[1] = [a for a in programs[1] if str(a) != "s1B2"]
    with pytest.raises(ScheduleError, match="missing|needs exactly one B"):
        validate_programs(programs, _shape(3, 4))


def test_validator_catches_a_duplicate_action():
    programs = _lowered("gpipe", 2, 2)
    programs[0].insert(1, Action("F", 0, 0))
    with pytest.raises(ScheduleError, match="appears twice"):
        validate_programs(programs, _shape(2, 2))


def test_validator_catches_backward_before_forward():
    programs = _lowered("zb-h1", 2, 3)
    w = next(i for i, a in enumerate(programs[1]) if a.op == "W")
    programs[1].insert(0, programs[1].pop(w))
    with pytest.raises(ScheduleError, match="before its"):
        validate_programs(programs, _shape(2, 3))


def test_validator_reports_deadlock_with_grid():
    # rank 1 waits for mb 1's activation before it sends mb 0's gradient that rank 0 waits on first
    compute = [[Action("F", 0, 0), Action("B", 0, 0), Action("F", 0, 1), Action("B", 0, 1)],
               [Action("F", 1, 0), Action("F", 1, 1), Action("B", 1, 0), Action("B", 1, 1)]]
    programs = lower(compute, _shape(2, 2))
    with pytest.raises(ScheduleError) as err:
        validate_programs(programs, _shape(2, 2))
    assert "deadlock" in str(err.value) and "<-- ERROR HERE" in str(err.value)


def test_validator_catches_out_of_order_messages():
    programs = _lowered("gpipe", 2, 3)
    # rank 1 receives micro-batch 1 first, but the channel delivers micro-batch 0 first
    recvs = [i for i, a in enumerate(programs[1]) if a.op == "RECV_F"]
    p = programs[1]
    p[recvs[0]], p[recvs[1]] = p[recvs[1]], p[recvs[0]]
    with pytest.raises(ScheduleError, match="arrive in order|no input"):
        validate_programs(programs, _shape(2, 3))


def test_validator_catches_unmatched_send():
    programs = _lowered("1f1b", 2, 2)
    programs[0].insert(-2, Action("SEND_F", 0, 1, 1))
    with pytest.raises(ScheduleError, match="unmatched"):
        validate_programs(programs, _shape(2, 2))


def test_plan_turns_unsupported_schedule_into_config_error():
    from hpcpipe.config import from_dict
    from hpcpipe.errors import ConfigError
    from hpcpipe.train.setup import prepare

    cfg = from_dict({"parallel": {"pp": 2, "schedule": "1f1b", "virtual_stages": 2},
                     "model": {"dims": [4] * 5}, "train": {"micro_batches": 4}})
    with pytest.raises(ConfigError, match=r"parallel.schedule = '1f1b'.*virtual stages: 2"):
        prepare(cfg, 2)
    cfg = from_dict({"parallel": {"pp": 2, "schedule": "interleaved-1f1b", "virtual_stages": 2},
                     "model": {"dims": [4] * 5}, "train": {"micro_batches": 3}})
    with pytest.raises(ConfigError, match=r"micro-batches: 3, pp: 2, virtual stages: 2"):
        prepare(cfg, 2)
    assert prepare(from_dict({"parallel": {"pp": 2, "schedule": "interleaved-1f1b", "virtual_stages": 2},
                           "model": {"dims": [4] * 5}, "train": {"micro_batches": 4}}), 2).n_stages == 4


# GPipe's lowered program, message by message
@pytest.mark.parametrize("pp", range(1, 9))
@pytest.mark.parametrize("micro", range(1, 17))
def test_gpipe_lowers_to_a_valid_program(pp, micro):
    programs = lower(gpipe(pp, micro), _shape(pp, micro))
    validate_programs(programs, _shape(pp, micro))
    for rank, prog in enumerate(programs):
        ops = [a.op for a in prog]
        assert ops.count("F") == micro and ops.count("B") == micro
        assert ops.count("SEND_F") == (micro if rank < pp - 1 else 0)
        assert ops.count("RECV_B") == (micro if rank < pp - 1 else 0)
        assert ops.count("RECV_F") == ops.count("SEND_B") == (micro if rank > 0 else 0)
        assert prog[-2:] == [Action("ALLREDUCE"), Action("OPT_STEP")]


def test_gpipe_first_rank_program_reads_as_expected():
    programs = lower(gpipe(2, 2), _shape(2, 2))
    assert [str(a) for a in programs[0]] == [
        "s0F0", "s0SEND_F0@1", "s0F1", "s0SEND_F1@1", "s0RECV_B0@1", "s0B0", "s0RECV_B1@1", "s0B1",
        "ALLREDUCE", "OPT_STEP"]


# The array (timeline) form is now the one definition of every schedule; its action lists must be the
# lists the former imperative generators (frozen in schedule_reference.py) produced, action for action.
# (zb-v postdates the frozen generators: tests/schedule/test_zbv.py checks its action lists against its timeline)
@pytest.mark.parametrize("name", sorted(set(SCHEDULES) - {"zb-v"}))
def test_action_lists_equal_the_former_generators(name):
    from support.schedule_reference import REFERENCE

    compared = 0
    for pp, m, v in GRID:
        try:
            expected = REFERENCE[name](pp, m, v)
        except ScheduleError as err:
            with pytest.raises(ScheduleError) as ours:
                build_schedule(name, pp, m, v)
            assert str(ours.value) == str(err)
            continue
        assert build_schedule(name, pp, m, v) == expected, (name, pp, m, v)
        compared += 1
    assert compared >= 8 * 32
