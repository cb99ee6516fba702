"""MPI tests of the per-step agreement: a NaN injected on one rank is skipped identically by every rank."""

from __future__ import annotations

import numpy as np
import pytest

from hpcpipe.config import from_dict
from hpcpipe.train.setup import prepare
from hpcpipe.train.trainer import Trainer

pytestmark = pytest.mark.mpi


def _snapshot(trainer):
    return (trainer.params.flat.copy(), {k: v.copy() for k, v in trainer.optimizer.state.items()},
            trainer.optimizer.steps)


@pytest.mark.parametrize("what", ["grad", "loss"])
def test_nan_on_one_rank_is_skipped_by_every_rank(world, monkeypatch, what):
    size = world.Get_size()
    pp = 4 if size % 4 == 0 else 2 if size % 2 == 0 else 1
    victim = size - 1 if what == "grad" else size - 1 - (pp - 1)   # loss: poison a first-stage rank too
    monkeypatch.setenv("HPCPIPE_NAN", f"rank={max(victim, 0)},step=1,count=2,what={what}")
    cfg = from_dict({"parallel": {"pp": pp}, "model": {"dims": [8] * (pp + 1)},
                     "train": {"steps": 4, "micro_batches": 2, "micro_batch_size": 2, "optimizer": "adam"},
                     "checkpoint": {"dir": ""}, "log": {"progress": False}})
    trainer = Trainer(prepare(cfg, size), world)
    try:
        decisions, unchanged = [], []
        for step in range(4):
            before = _snapshot(trainer)
            d = trainer.run_step(step).decision
            after = _snapshot(trainer)
            decisions.append((d.skip, d.bad_ranks, d.stop))
            same = (np.array_equal(before[0], after[0]) and before[2] == after[2]
                    and all(np.array_equal(before[1][k], after[1][k]) for k in before[1]))
            unchanged.append(same)
        every = world.allgather((decisions, unchanged))
    finally:
        trainer.close()
    assert all(e == every[0] for e in every), every            # one decision, the same on every rank
    decisions, unchanged = every[0]
    assert [d[0] for d in decisions] == [False, True, True, False]
    assert [d[1] for d in decisions] == [0, 1, 1, 0]            # one rank was bad ...
    assert unchanged == [False, True, True, False]              # ... and nobody updated on those steps
    assert trainer.optimizer.steps == 2                         # Adam's step count skips them too
