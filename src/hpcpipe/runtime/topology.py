"""Topology: a world communicator -> Cartesian (dp, pp) grid, per-axis sub-communicators, neighbours.

World rank w sits at (dp_rank, pp_rank) = divmod(w, pp) (no reordering), so
ranks of one pipeline are consecutive, which keeps pipeline neighbours on the
same node when ranks are packed by node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hpcpipe.errors import ConfigError

if TYPE_CHECKING:
    from mpi4py.MPI import Cartcomm, Comm


@dataclass
class Topology:
    """This rank's place in the (dp, pp) grid and the communicators that go with it."""

    world: Comm
    cart: Cartcomm
    dp: int
    pp: int
    dp_rank: int
    pp_rank: int
    pp_comm: Comm    # the ranks of this pipeline; rank in it == pp_rank
    dp_comm: Comm    # the replicas of this stage; rank in it == dp_rank

    @property
    def name(self) -> str:
        """Human name of this rank, e.g. 'dp01-pp03'."""
        return rank_name(self.dp_rank, self.pp_rank)

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
        for comm in (self.pp_comm, self.dp_comm, self.cart):
            comm.Free()


def rank_name(dp_rank: int, pp_rank: int) -> str:
    """Return the printable name of grid cell (dp_rank, pp_rank)."""
    return f"dp{dp_rank:02d}-pp{pp_rank:02d}"


def make_topology(world: Comm, dp: int, pp: int) -> Topology:
    """Build the (dp, pp) Cartesian grid over world; the size check runs before any collective."""
    size = world.Get_size()
    if dp < 1 or pp < 1 or dp * pp != size:
        raise ConfigError(f"world size {size} does not equal dp ({dp}) x pp ({pp}) = {dp * pp}")
    cart = world.Create_cart(dims=[dp, pp], periods=[False, False], reorder=False)
    dp_rank, pp_rank = cart.Get_coords(cart.Get_rank())
    pp_comm = cart.Sub([False, True])
    dp_comm = cart.Sub([True, False])
    return Topology(world, cart, dp, pp, dp_rank, pp_rank, pp_comm, dp_comm)
