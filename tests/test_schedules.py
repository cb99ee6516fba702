"""GPipe as data, lowering, and the validator (which must accept good programs and reject bad ones)."""

import pytest

from hpcpipe.errors import ScheduleError
from hpcpipe.lowering import lower, validate
from hpcpipe.schedules import Action, build_schedule, gpipe


@pytest.mark.parametrize("pp", range(1, 9))
@pytest.mark.parametrize("micro", range(1, 17))
def test_gpipe_lowers_to_a_valid_program(pp, micro):
    programs = lower(gpipe(pp, micro), pp, pp)
    validate(programs, pp, pp, micro)
    for rank, prog in enumerate(programs):
        ops = [a.op for a in prog]
        assert ops.count("F") == micro and ops.count("B") == micro
        assert ops.count("SEND_F") == (micro if rank < pp - 1 else 0)
        assert ops.count("RECV_B") == (micro if rank < pp - 1 else 0)
        assert ops.count("RECV_F") == ops.count("SEND_B") == (micro if rank > 0 else 0)
        assert prog[-2:] == [Action("ALLREDUCE"), Action("OPT_STEP")]


def test_gpipe_first_rank_program_reads_as_expected():
    programs = lower(gpipe(2, 2), 2, 2)
    assert [str(a) for a in programs[0]] == [
        "s0F0", "s0SEND_F0@1", "s0F1", "s0SEND_F1@1", "s0RECV_B0@1", "s0B0", "s0RECV_B1@1", "s0B1",
        "ALLREDUCE", "OPT_STEP"]


def test_validator_reports_deadlock_with_grid():
    # both ranks receive before they send: a classic deadlock
    programs = lower(gpipe(2, 1), 2, 2)
    bad = [list(programs[0]), list(programs[1])]
    bad[0] = [Action("RECV_B", 0, 0, 1)] + [a for a in bad[0] if a.op != "RECV_B"]
    with pytest.raises(ScheduleError, match="deadlock") as info:
        validate(bad, 2, 2, 1)
    assert "<-- ERROR HERE" in str(info.value)


def test_validator_rejects_missing_backward():
    programs = lower(gpipe(2, 2), 2, 2)
    programs[1] = [a for a in programs[1] if str(a) != "s1B1"]
    with pytest.raises(ScheduleError, match="stage 1 micro-batch 1 needs exactly one B"):
        validate(programs, 2, 2, 2)


def test_validator_rejects_out_of_order_messages():
    programs = lower(gpipe(2, 2), 2, 2)
    # rank 1 receives micro-batch 1 before micro-batch 0: FIFO matching would swap them
    p1 = programs[1]
    i0, i1 = p1.index(Action("RECV_F", 1, 0, 0)), p1.index(Action("RECV_F", 1, 1, 0))
    p1[i0], p1[i1] = p1[i1], p1[i0]
    f0, f1 = p1.index(Action("F", 1, 0)), p1.index(Action("F", 1, 1))
    p1[f0], p1[f1] = p1[f1], p1[f0]
    with pytest.raises(ScheduleError, match="arrive in order"):
        validate(programs, 2, 2, 2)


def test_validator_rejects_backward_before_forward():
    programs = [[Action("B", 0, 0), Action("F", 0, 0), Action("ALLREDUCE"), Action("OPT_STEP")]]
    with pytest.raises(ScheduleError, match="before its forward"):
        validate(programs, 1, 1, 1)


def test_validator_rejects_unmatched_send():
    programs = lower(gpipe(2, 1), 2, 2)
    programs[0].insert(1, Action("SEND_F", 0, 0, 1))
    with pytest.raises(ScheduleError, match="unmatched"):
        validate(programs, 2, 2, 1)


def test_schedule_errors_name_the_values():
    with pytest.raises(ScheduleError, match=r"micro-batches must be a positive integer, got 0"):
        gpipe(4, 0)
    with pytest.raises(ScheduleError, match=r"virtual stages: 2"):
        gpipe(4, 8, 2)
    with pytest.raises(ScheduleError, match="unknown schedule 'nope'"):
        build_schedule("nope", 2, 2)
