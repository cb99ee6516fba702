"""The simulator's cost model and result: seconds (or units) per action kind, per stage."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hpcpipe.schedule.ir import Action

COMPUTE = ("F", "B", "I", "W")


@dataclass(frozen=True)
class Costs:
    """Seconds (or any unit) per action: F, full B, W (I = B - W), per message, per step end.

    ``per_stage`` overrides the uniform costs: {(op, stage): cost} for op in F, B, I, W.
    """

    forward: float = 1.0
    backward: float = 2.0
    weight: float = 1.0
    comm: float = 0.0
    step: float = 0.0                       # ALLREDUCE + OPT_STEP per rank
    per_stage: dict = field(default_factory=dict)

    def of(self, op: str, stage: int) -> float:
        """Return the cost of a compute op on a stage."""
        hit = self.per_stage.get((op, stage))
        if hit is not None:
            return hit
        if op == "F":
            return self.forward
        if op == "B":
            return self.backward
        if op == "W":
            return self.weight
        return self.backward - self.weight   # I

    def tensor_parallel(self, tp: int, forward_comm: float = 0.0, backward_comm: float = 0.0) -> Costs:
        """Return the costs of the same stages split over tp tensor-parallel ranks.

        Each rank computes 1/tp of every action, and the tp collectives sit on the action's critical path:
        ``forward_comm`` seconds per F (a block's two allreduces of its output), ``backward_comm`` per full
        backward B and per input half I (the mirrored sums of the input gradients); W needs none.
        """
        if tp < 1:
            raise ValueError(f"tensor-parallel ranks must be >= 1, got {tp}")
        add = {"F": forward_comm, "B": backward_comm, "I": backward_comm, "W": 0.0}
        per_stage = {(op, stage): cost / tp + add[op] for (op, stage), cost in self.per_stage.items()}
        # I = B - W: keep W's share of B unchanged relative to the split compute
        return Costs(self.forward / tp + forward_comm, self.backward / tp + backward_comm, self.weight / tp,
                     self.comm, self.step, per_stage)

    def scaled(self, factor: float) -> Costs:
        """Return the uniform compute costs multiplied by factor (a stage cut into virtual chunks)."""
        return Costs(self.forward * factor, self.backward * factor, self.weight * factor, self.comm,
                     self.step, dict(self.per_stage))


@dataclass
class SimResult:
    """What a simulated step did."""

    step_time: float
    bubble: float                       # idle share of pp x step_time
    busy: list[float]                   # compute time per rank
    peak_stashed: list[int]             # per rank: micro-batch activations held at once (all its stages)
    peak_stashed_stage: dict[int, int]  # per stage
    # per rank: (action, start, end), waits are gaps; None from the vectorised path (simulate_timeline)
    events: list[list[tuple[Action, float, float]]] | None

    @property
    def bubble_over_compute(self) -> float:
        """Idle time relative to compute time (the form of the interleaved closed form)."""
        busy = sum(self.busy)
        return (len(self.busy) * self.step_time - busy) / busy if busy else 0.0


def finite(costs: Costs) -> bool:
    """True when every cost is a finite number (the vectorised sweep needs that)."""
    uniform = (costs.forward, costs.backward, costs.weight, costs.comm, costs.step)
    return all(math.isfinite(c) for c in uniform) and all(math.isfinite(c) for c in costs.per_stage.values())
