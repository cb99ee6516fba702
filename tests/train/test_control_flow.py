"""Explicit control flow in training: the optimizer step and the stop request are arguments, the decision a
returned value (no attribute patched on the trainer or the engine), and the layout is resolved once."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from hpcpipe.config import from_dict
from hpcpipe.errors import ConfigError

CFG = {"parallel": {"pp": 1, "dp": 1}, "model": {"dims": [8, 8, 8]}, "checkpoint": {"dir": ""},
       "log": {"progress": False}, "train": {"steps": 4, "micro_batches": 2, "micro_batch_size": 2}}


@pytest.fixture
def trainer():
    from mpi4py import MPI

    from hpcpipe.train.setup import prepare
    from hpcpipe.train.trainer import Trainer

    made = Trainer(prepare(from_dict(CFG), 1), MPI.COMM_SELF)
    yield made
    made.close()


def test_the_stop_request_is_asked_once_at_the_agreement_and_its_decision_returned(trainer):
    asked = []

    def stop_requested() -> bool:
        asked.append(trainer.engine.stats.loss_sum)   # at the agreement: after the forward summed the loss
        return True

    result = trainer.run_step(0, stop_requested)
    assert len(asked) == 1 and asked[0] > 0
    assert result.decision.stop and result.decision.stop_ranks == 1 and not result.decision.skip
    assert result.stats is trainer.last_stats and result.stats.decision is result.decision
    assert result.loss == pytest.approx(result.decision.loss_sum / trainer.loss_norm)
    follow = trainer.run_step(1)                      # not asked: never a stop
    assert not follow.decision.stop


def test_no_control_attribute_is_patched_on_the_trainer_or_the_engine(trainer):
    before = trainer.params.flat.copy()
    trainer.train_step(0)
    assert not np.array_equal(before, trainer.params.flat)        # the update ran, from run_step's argument
    for gone in ("stop_requested", "last_decision", "last_grad_norm"):
        assert not hasattr(trainer, gone), gone
    params = inspect.signature(trainer.engine.run).parameters
    assert list(params) == ["feed", "optimizer_step"]
    frozen = trainer.params.flat.copy()
    loss = trainer.compute_gradients(1)                          # no optimizer step passed: nothing updated
    assert np.isfinite(loss) and np.array_equal(frozen, trainer.params.flat)
    assert trainer.last_stats.decision is None


def test_the_loop_passes_the_stop_request_and_reads_returned_decisions(trainer):
    from hpcpipe.train.loop import train

    class Stop:
        """A StopSignals stand-in: a signal arrived before the first step."""

        requested, name = True, "SIGTERM"

        def check_interrupt(self) -> None:
            pass

    summary = train(trainer, trainer.topo.world, Stop())
    assert summary["steps"] == 1 and "a stop signal on 1 of 1 rank(s) (SIGTERM here)" == summary["stopped"]


def test_the_train_command_resolves_the_layout_once(monkeypatch):
    from hpcpipe.train import command, setup

    calls = []
    real = command.resolve_layout
    monkeypatch.setattr(command, "resolve_layout", lambda c, n: calls.append(n) or real(c, n))
    monkeypatch.setattr(setup, "resolve_layout", lambda c, n: pytest.fail("the setup resolved the layout again"))
    config = from_dict(dict(CFG, parallel={"pp": 2}))
    layout = command.run_layout(config, 4, resumed=False)
    p = setup.prepare(config, 4, layout)
    assert (layout, p.dp, p.pp, calls) == ((2, 2), 2, 2, [4])
    with pytest.raises(ConfigError, match=r"not divisible by parallel.pp \(2\).*\(resuming: the layout is the run's"):
        command.run_layout(config, 3, resumed=True)
    with pytest.raises(ConfigError, match=r"not divisible by parallel.pp \(2\): run on a multiple of 2 ranks.*\)$"):
        command.run_layout(config, 3, resumed=False)
