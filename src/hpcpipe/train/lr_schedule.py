"""Learning-rate schedules: the rate each step's update uses, a pure function of the step and [train].

With lr = train.lr, w = train.warmup_steps, T = train.steps, r = train.min_lr_ratio and step s
counted from 0 (the update of step s uses lr x factor(s), as torch's LambdaLR after s scheduler steps)::

    warmup (s < w):  factor = s / max(1, w)                 (the first update of a warmed-up run uses 0)
    constant:        factor = 1
    linear:          factor = r + (1 - r) max(0, (T - s) / max(1, T - w))
    cosine:          factor = max(0, r + (1 - r) (1 + cos(pi p)) / 2),   p = (s - w) / max(1, T - w)

These are transformers' ``get_constant_schedule_with_warmup``, ``get_linear_schedule_with_warmup`` (r = 0)
and ``get_cosine_with_min_lr_schedule_with_warmup(min_lr_rate=r)`` (``get_cosine_schedule_with_warmup`` when
r = 0), evaluated in the same float64 operations. The schedule depends on the step and the config only, and a
checkpoint stores the config: a resumed or resharded run continues the same sequence.
"""

from __future__ import annotations

import math
from typing import Any

SCHEDULES = ("constant", "linear", "cosine")


def lr_factor(step: int, schedule: str, warmup: int, total: int, min_ratio: float = 0.0) -> float:
    """The multiplier of train.lr for the update of step ``step`` (0-based)."""
    if step < warmup:
        return float(step) / float(max(1, warmup))
    if schedule == "constant":
        return 1.0
    if schedule == "linear":
        decay = max(0.0, float(total - step) / float(max(1, total - warmup)))
        return decay if not min_ratio else decay * (1 - min_ratio) + min_ratio
    progress = float(step - warmup) / float(max(1, total - warmup))
    factor = 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress))
    return max(0, factor * (1 - min_ratio) + min_ratio)


def lr_at(train: Any, step: int) -> float:
    """The learning rate of step ``step``'s update under a [train] section (TrainConfig)."""
    return train.lr * lr_factor(step, train.lr_schedule, train.warmup_steps, train.steps, train.min_lr_ratio)


def schedule_warning(train: Any) -> str | None:
    """A warning line when the warmup does not end within the run (the rate never reaches train.lr), else None."""
    if train.warmup_steps and train.warmup_steps >= train.steps:
        return (f"train.warmup_steps = {train.warmup_steps} is not shorter than train.steps = {train.steps}: the "
                f"rate climbs for the whole run and never reaches train.lr = {train.lr:g} (its last update uses "
                f"{lr_at(train, max(train.steps - 1, 0)):.3g})")
    return None
