"""ZB-V at scale: the vectorised V-placement validator against the per-action one."""

import itertools
import random

import numpy as np
import pytest
from support.timelines import mutate, per_action_verdict

from hpcpipe.errors import ScheduleError
from hpcpipe.schedule import timeline_proofs
from hpcpipe.schedule.ir import Timeline, W
from hpcpipe.schedule.registry import build_timeline
from hpcpipe.schedule.validate_timeline import validate_timeline


def _verdict(tl: Timeline, ranks_per_pass: int) -> bool:
    try:
        validate_timeline(tl, ranks_per_pass=ranks_per_pass)
    except ScheduleError:
        return False
    return True


def test_v_validator_agrees_with_the_per_action_one_on_mutated_zbv_timelines(monkeypatch):
    rng = random.Random(11)
    sizes = list(itertools.product(range(1, 7), range(1, 9)))
    fallbacks = []
    per_action = timeline_proofs.validate_per_action

    def spy(tl):
        fallbacks.append(tl)
        per_action(tl)

    monkeypatch.setattr(timeline_proofs, "validate_per_action", spy)
    verdicts = {True: 0, False: 0}
    decided_alone = 0            # verdicts reached without the per-action validator
    while sum(verdicts.values()) < 2000:
        p, m = rng.choice(sizes)
        tl = build_timeline("zb-v", p, m, 2)
        for _ in range(rng.randint(1, 3)):
            tl = mutate(tl, rng)
        want = per_action_verdict(tl)
        before = len(fallbacks)
        got = _verdict(tl, rng.choice([1, 2, 3, 16]))
        assert got == want, (p, m, tl.ops.tolist(), tl.chunk.tolist(), tl.mb.tolist())
        verdicts[want] += 1
        decided_alone += len(fallbacks) == before
    assert verdicts[True] >= 100 and verdicts[False] >= 800
    assert decided_alone >= 400      # the rest miss or repeat an action, or reorder W's: named per action


def test_builtin_zbv_timelines_validate_without_the_per_action_validator(monkeypatch):
    def refuse(tl):
        raise AssertionError("per-action fallback taken")

    monkeypatch.setattr(timeline_proofs, "validate_per_action", refuse)
    for p, m in itertools.product(range(1, 9), range(1, 17)):
        for ranks_per_pass in (1, 3, 16):
            validate_timeline(build_timeline("zb-v", p, m, 2), ranks_per_pass=ranks_per_pass)
    validate_timeline(build_timeline("zb-v", 64, 256, 2))


@pytest.mark.parametrize("down", [True, False])
def test_v_channels_in_both_directions_are_checked_for_order_and_ticks(down):
    tl = build_timeline("zb-v", 4, 8, 2)
    # swap two forwards of one chunk on rank 1: the FIFO channel to (chunk a) or from (chunk b) rank 2 breaks
    c = 0 if down else 1
    ticks = np.flatnonzero((tl.ops[1] == 0) & (np.asarray(tl.chunk[1]) == c))[:2]
    mb = tl.mb.copy()
    mb[1, ticks] = mb[1, ticks[::-1]]
    swapped = Timeline(tl.name, 4, 8, 2, tl.ops, tl.chunk, mb, "v")
    with pytest.raises(ScheduleError, match="arrive in order"):
        validate_timeline(swapped)
    assert not per_action_verdict(swapped)


def test_w_order_other_than_the_is_goes_to_the_per_action_validator():
    tl = build_timeline("zb-v", 2, 3, 2)
    ops, chunk, mb = tl.ops.copy(), np.array(tl.chunk), tl.mb.copy()
    # rank 0's last two W's swapped: still each after its I, so valid, but outside step 6
    a, b = np.flatnonzero(ops[0] == W)[-2:]
    for arr in (chunk, mb):
        arr[0, [a, b]] = arr[0, [b, a]]
    swapped = Timeline(tl.name, 2, 3, 2, ops, chunk, mb, "v")
    assert per_action_verdict(swapped) == _verdict(swapped, 16)
