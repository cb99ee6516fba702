"""Held-out loss during training: data.eval_path evaluated every train.eval_every steps by a forward-only pass.

Roughly, after the update of every train.eval_every-th step (and after the last)::

    for each global batch k of the held-out file (file order; whole batches: the first N // G * G samples):
        every stage runs the step's program keeping only F, SEND_F and RECV_F (no stash, no backward)
        the last stage adds its micro-batches' summed losses
    eval_loss = world sum / (samples x tokens per sample)    # per target token, as the training loss
    eval_perplexity = exp(eval_loss)                           # token models

The forward-only program is the training program with every other action dropped: its receives wait for
sends that come earlier than before, so it runs wherever the training program runs. The same samples go to
the same replica and micro-batch as a training step's would; one world allreduce per evaluation.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

from hpcpipe.config import DECODERS, Config
from hpcpipe.errors import ConfigError
from hpcpipe.train.data import HDF5Data, ReplicaFeeder, check_data_file
from hpcpipe.train.engine import StepFeed

if TYPE_CHECKING:
    from hpcpipe.train.trainer import Trainer

FORWARD = ("F", "SEND_F", "RECV_F")


def eval_config(config: Config) -> Config:
    """The config that reads data.eval_path as a data file (in file order)."""
    data = dataclasses.replace(config.data, path=config.data.eval_path, shuffle=False)
    return dataclasses.replace(config, data=data)


def check_eval_data(config: Config, dp: int) -> int:
    """Check data.eval_path against the model as data.path is checked; return the samples evaluated (0: none)."""
    if not config.data.eval_path:
        return 0
    try:
        n = check_data_file(eval_config(config))
    except ConfigError as exc:
        raise ConfigError(f"data.eval_path: {exc}") from None
    tr = config.train
    batch = dp * tr.micro_batches * tr.micro_batch_size
    if n < batch:
        raise ConfigError(f"data.eval_path {config.data.eval_path!r} holds {n} samples, fewer than one global batch "
                          f"(dp x train.micro_batches x train.micro_batch_size = {dp} x {tr.micro_batches} x "
                          f"{tr.micro_batch_size} = {batch}): the held-out loss is taken over whole batches")
    return n // batch * batch


def due(config: Config, done: int) -> bool:
    """Whether the held-out loss is taken after ``done`` steps: every train.eval_every-th, and after the last."""
    every = config.train.eval_every
    return bool(config.data.eval_path) and ((every and done % every == 0) or done == config.train.steps)


class Evaluator:
    """One rank's share of the held-out loss: its replica's rows, its stages' forwards."""

    def __init__(self, trainer: Trainer):
        setup, topo = trainer.setup, trainer.topo
        config = eval_config(trainer.config)
        self.trainer = trainer
        self.feeder = ReplicaFeeder(HDF5Data(config), config, setup.dp, topo.dp_rank, trainer.first, trainer.last)
        self.batches = setup.eval_rows // trainer.global_batch
        self.norm = trainer.model.samples_norm(setup.eval_rows)
        self.program = [a for a in setup.programs[topo.pp_rank] if a.op in FORWARD]
        self.tokens = trainer.config.model.kind in DECODERS

    def run(self) -> dict[str, Any]:
        """The held-out loss (and perplexity) of the current parameters (collective over the world)."""
        trainer = self.trainer
        xp = trainer.backend.xp
        total = 0.0
        for k in range(self.batches):
            xs, ys = self.feeder.step(k)
            loss = trainer.engine.evaluate(StepFeed([xp.asarray(x) for x in xs], [xp.asarray(y) for y in ys]),
                                           self.program)
            total += loss if trainer.topo.tp_rank == 0 else 0.0    # every tp rank of a last stage knows it
        loss = float(trainer.comm.sum_over_world([total])[0]) / self.norm
        out: dict[str, Any] = {"eval_loss": loss}
        if self.tokens:
            out["eval_perplexity"] = math.exp(loss) if loss < 700 else float("inf")
        return out
