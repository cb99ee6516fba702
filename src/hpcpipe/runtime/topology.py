"""Topology: a world communicator -> Cartesian (dp, pp, tp) grid, per-axis sub-communicators, neighbours.

World rank w sits at (dp_rank, pp_rank, tp_rank) with w = (dp_rank * pp + pp_rank) * tp + tp_rank (no
reordering), so the tp ranks of one stage are consecutive world ranks (one node when ranks are packed by
node, where their per-layer collectives are cheapest) and the ranks of one pipeline follow each other.

Expert parallelism (``ep``) adds no axis of its own: as in Megatron-LM and vLLM, the ep group of a rank is
the ep consecutive data-parallel replicas of its (pp stage, tp rank) with dp_rank // ep equal, and its rank in
that group ep_rank = dp_rank % ep; the replicas holding the same experts (dp_rank % ep equal) average those
experts' gradients (``expert_dp_comm``, dp / ep ranks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hpcpipe.errors import ConfigError

if TYPE_CHECKING:
    from mpi4py.MPI import Cartcomm, Comm


@dataclass
class Topology:
    """This rank's place in the (dp, pp, tp) grid and the communicators that go with it."""

    world: Comm
    cart: Cartcomm
    dp: int
    pp: int
    dp_rank: int
    pp_rank: int
    pp_comm: Comm    # the ranks of this pipeline with this tp rank; rank in it == pp_rank
    dp_comm: Comm    # the replicas of this stage's shard; rank in it == dp_rank
    tp: int = 1
    tp_rank: int = 0
    tp_comm: Comm | None = None   # the tensor-parallel ranks of this stage; rank in it == tp_rank
    ep: int = 1
    ep_rank: int = 0
    ep_comm: Comm | None = None         # the ep replicas sharing this stage's experts; rank in it == ep_rank
    expert_dp_comm: Comm | None = None  # the dp / ep replicas holding the same experts as this rank

    @property
    def name(self) -> str:
        """Human name of this rank, e.g. 'dp01-pp03' (or 'dp01-pp03-tp01' with tensor parallelism)."""
        return rank_name(self.dp_rank, self.pp_rank, self.tp_rank if self.tp > 1 else None)

    @property
    def prev(self) -> int:
        """Pipeline rank of the previous stage, or -1 on the first."""
        return self.pp_rank - 1 if self.pp_rank > 0 else -1

    @property
    def next(self) -> int:
        """Pipeline rank of the next stage, or -1 on the last."""
        return self.pp_rank + 1 if self.pp_rank < self.pp - 1 else -1

    def free(self) -> None:
        """Release the communicators this topology created."""
        for comm in (self.pp_comm, self.dp_comm, self.tp_comm, self.ep_comm, self.expert_dp_comm, self.cart):
            if comm is not None:
                comm.Free()


def rank_name(dp_rank: int, pp_rank: int, tp_rank: int | None = None) -> str:
    """Return the printable name of grid cell (dp_rank, pp_rank[, tp_rank])."""
    name = f"dp{dp_rank:02d}-pp{pp_rank:02d}"
    return name if tp_rank is None else f"{name}-tp{tp_rank:02d}"


def make_topology(world: Comm, dp: int, pp: int, tp: int = 1, ep: int = 1) -> Topology:
    """Build the (dp, pp, tp) Cartesian grid over world (with ep: the expert groups over dp); the size checks run
    before any collective."""
    size = world.Get_size()
    if dp < 1 or pp < 1 or tp < 1 or dp * pp * tp != size:
        raise ConfigError(f"world size {size} does not equal dp ({dp}) x pp ({pp}) x tp ({tp}) = {dp * pp * tp}")
    if ep < 1 or dp % ep:
        raise ConfigError(f"parallel.ep ({ep}) does not divide parallel.dp ({dp})")
    cart = world.Create_cart(dims=[dp, pp, tp], periods=[False, False, False], reorder=False)
    dp_rank, pp_rank, tp_rank = cart.Get_coords(cart.Get_rank())
    pp_comm = cart.Sub([False, True, False])
    dp_comm = cart.Sub([True, False, False])
    tp_comm = cart.Sub([False, False, True])
    ep_comm = expert_dp_comm = None
    if ep > 1:
        ep_comm = dp_comm.Split(color=dp_rank // ep, key=dp_rank)
        expert_dp_comm = dp_comm.Split(color=dp_rank % ep, key=dp_rank)
    return Topology(world, cart, dp, pp, dp_rank, pp_rank, pp_comm, dp_comm, tp, tp_rank, tp_comm,
                    ep, dp_rank % ep, ep_comm, expert_dp_comm)
