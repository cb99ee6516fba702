"""Topology: a world communicator -> Cartesian (dp, pp, tp) grid, per-axis sub-communicators, neighbours.

World rank w sits at (dp_rank, pp_rank, tp_rank) with w = (dp_rank * pp + pp_rank) * tp + tp_rank (no
reordering), so the tp ranks of one stage are consecutive world ranks (one node when ranks are packed by
node, where their per-layer collectives are cheapest) and the ranks of one pipeline follow each other.
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
        for comm in (self.pp_comm, self.dp_comm, self.tp_comm, self.cart):
            if comm is not None:
                comm.Free()


def rank_name(dp_rank: int, pp_rank: int, tp_rank: int | None = None) -> str:
    """Return the printable name of grid cell (dp_rank, pp_rank[, tp_rank])."""
    name = f"dp{dp_rank:02d}-pp{pp_rank:02d}"
    return name if tp_rank is None else f"{name}-tp{tp_rank:02d}"


def make_topology(world: Comm, dp: int, pp: int, tp: int = 1) -> Topology:
    """Build the (dp, pp, tp) Cartesian grid over world; the size check runs before any collective."""
    size = world.Get_size()
    if dp < 1 or pp < 1 or tp < 1 or dp * pp * tp != size:
        raise ConfigError(f"world size {size} does not equal dp ({dp}) x pp ({pp}) x tp ({tp}) = {dp * pp * tp}")
    cart = world.Create_cart(dims=[dp, pp, tp], periods=[False, False, False], reorder=False)
    dp_rank, pp_rank, tp_rank = cart.Get_coords(cart.Get_rank())
    pp_comm = cart.Sub([False, True, False])
    dp_comm = cart.Sub([True, False, False])
    tp_comm = cart.Sub([False, False, True])
    return Topology(world, cart, dp, pp, dp_rank, pp_rank, pp_comm, dp_comm, tp, tp_rank, tp_comm)
