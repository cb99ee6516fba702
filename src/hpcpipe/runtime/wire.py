"""Bytes a rank sends over MPI in a step, and the part that leaves its node (the ``link_bytes`` of the metrics).

Point-to-point messages are counted exactly; collectives by the ring model: an
allreduce of n bytes over r ranks sends ``2 (r-1)/r x n`` from each rank to its
successor in the ring, an allgather ``(r-1)/r`` of the whole. That is what MPICH
and Open MPI run for large messages; their small-message algorithms move about
as much at r = 2. Which peer is on another node comes from
:class:`hpcpipe.runtime.nodes.Nodes` (passed in: this module sends nothing).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mpi4py.MPI import Comm


class WireBytes:
    """Bytes this rank sent in MPI messages since the last take(), and the part that left its node."""

    def __init__(self, nodes: Any = None):
        self.nodes = nodes
        self.sent = 0
        self.off_node = 0
        self._off_cache: dict[tuple[int, int], bool] = {}     # (id(comm), peer) -> on another node

    def _off(self, comm: Comm, peer: int) -> bool:
        key = (id(comm), peer)
        if key not in self._off_cache:
            self._off_cache[key] = self.nodes is not None and self.nodes.off_node(comm, peer)
        return self._off_cache[key]

    def p2p(self, comm: Comm, peer: int, nbytes: int) -> None:
        """Count one message of nbytes to rank peer of comm."""
        self.sent += nbytes
        if self._off(comm, peer):
            self.off_node += nbytes

    def _ring(self, comm: Comm, nbytes: int) -> None:
        self.sent += nbytes
        if self._off(comm, (comm.Get_rank() + 1) % comm.Get_size()):
            self.off_node += nbytes

    def allreduce(self, comm: Comm, nbytes: int) -> None:
        """Count an allreduce of an nbytes buffer over comm (ring: 2 (r-1)/r x nbytes from each rank)."""
        size = comm.Get_size()
        if size > 1:
            self._ring(comm, 2 * (size - 1) * nbytes // size)

    def allgather(self, comm: Comm, total_bytes: int) -> None:
        """Count an allgather that assembles total_bytes on every rank of comm (ring: (r-1)/r of it from each)."""
        size = comm.Get_size()
        if size > 1:
            self._ring(comm, (size - 1) * total_bytes // size)

    def take(self) -> tuple[int, int]:
        """Return (bytes sent, bytes sent to other nodes) since the last call, and start counting again."""
        taken = (self.sent, self.off_node)
        self.sent = self.off_node = 0
        return taken


def link_bytes(hosts: tuple[str, ...] | list[str], off_node_by_rank: list[int]) -> dict[str, int]:
    """Bytes each node sent to the other nodes (its link's outgoing direction), from every world rank's count."""
    out: dict[str, int] = {}
    for host, nbytes in zip(hosts, off_node_by_rank, strict=True):
        out[host] = out.get(host, 0) + int(nbytes)
    return out
