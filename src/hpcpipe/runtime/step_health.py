"""The per-step health decision: a small float64 vector every rank contributes to the step's one allreduce.

A rank whose loss or gradient is not finite sets a flag; a rank that received
a stop signal (:mod:`hpcpipe.runtime.signals`) sets another. Every rank sees
the same world sum, so all skip a bad update together (``train.max_bad_steps``
skipped steps in a row end the run with EXIT_DIVERGED) and all checkpoint and
stop together on a signal. NumPy is loaded only when a decision is made, so
that importing this module stays cheap for the commands' start-up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np


# The step decision: one float64 vector summed over every rank (one allreduce per step).
NORM, LOSS, BAD, STOP = range(4)
DECISION_SIZE = 4


@dataclass(frozen=True)
class StepDecision:
    """What every rank agreed on after a step's forward/backward (identical on all ranks)."""

    grad_norm: float
    loss_sum: float
    bad_ranks: int      # ranks whose loss or gradient was not finite
    stop_ranks: int     # ranks that received a stop signal

    @property
    def stop(self) -> bool:
        """True when some rank received a stop signal: every rank checkpoints and stops."""
        return self.stop_ranks > 0

    @property
    def skip(self) -> bool:
        """True when the update must be skipped (a non-finite value on any rank)."""
        return self.bad_ranks > 0


def local_decision(grad_sq: float, loss_sum: float, count_norm: bool, stop: bool) -> np.ndarray:
    """Return this rank's contribution to the step decision.

    grad_sq counts once per stage (count_norm on one replica only), so that the
    world sum is the squared global norm exactly as a sum over the pipeline.
    """
    import numpy as np  # here, not at module import: see the module docstring

    out = np.zeros(DECISION_SIZE, dtype=np.float64)
    out[NORM] = grad_sq if count_norm else 0.0
    out[LOSS] = loss_sum
    out[BAD] = 0.0 if (math.isfinite(grad_sq) and math.isfinite(loss_sum)) else 1.0
    out[STOP] = 1.0 if stop else 0.0
    return out


def decide(total: np.ndarray) -> StepDecision:
    """Turn the world sum of local_decision vectors into the agreed StepDecision."""
    bad = int(total[BAD])
    norm = math.sqrt(float(total[NORM])) if not bad else float("nan")
    return StepDecision(grad_norm=norm, loss_sum=float(total[LOSS]), bad_ranks=bad, stop_ranks=int(total[STOP]))
