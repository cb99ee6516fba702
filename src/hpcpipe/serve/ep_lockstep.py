"""The heads of an expert-parallel group of replicas step together (vLLM's DP + EP): who launches, who has finished.

With parallel.ep > 1 the experts of every sparse block are split over ep replicas, so a replica's forward needs
its ep peers' experts: every stage's all-to-alls must pair up. The heads of the group therefore agree once a
step (one small allreduce over the ep ranks of stage 0) on whether any of them launches work; a head with
nothing to launch then *joins* (its stage exchanges zero rows of its own and still computes the rows the
peers send its experts) and sends a Join down its pipeline, so that every following stage of every replica
runs one forward (or join) per agreed step, in the same order as its peers. The heads leave their loops at the
same step: when every one of them has finished.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Lockstep:
    """One head's side of the agreement over its ep group (``group``: hpcpipe.runtime.expert_comm.ExpertGroup)."""

    def __init__(self, group: Any, finished: Callable[[], bool]):
        self.group, self.finished = group, finished
        self.done = False         # every head of the group has finished: leave the loop (the same step everywhere)
        self.steps = self.joins = 0

    def agree(self, launching: bool) -> bool:
        """Return whether any head of the group launches work this step (this one included); note who is done."""
        launches, finished = self.group.agree([float(launching), float(self.finished())])
        self.done = int(finished) == self.group.size and not launches
        self.steps += 1
        return launches > 0
