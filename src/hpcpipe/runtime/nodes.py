"""Which node each rank runs on: the bytes that leave a node, and directories every node must see alike.

A job on several nodes differs from one on one host in two ways hpcpipe has to know about:

* **Messages between nodes cross a network link**, orders of magnitude slower than shared memory:
  :class:`Nodes` tells which peers are on another node (:mod:`hpcpipe.runtime.wire` counts the
  bytes that leave a node with it).
* **Files written on one node are read on another** only through a shared file system. A
  checkpoint is written by one rank per stage into checkpoint.dir: a node-local path (``/tmp``,
  ``/dev/shm``, a local disk) there failed only at the first save, after all the steps.
  :func:`check_shared_directory` finds that before step 0.

A node is a host name (``MPI_Get_processor_name``), which on clusters names the machine.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hpcpipe.errors import EXIT_CONFIG, AgreedError
from hpcpipe.runtime.comm import MPI, Poller, barrier, broadcast

if TYPE_CHECKING:
    from mpi4py.MPI import Comm

SEE_TIMEOUT_S = 5.0     # a shared file system may show another client's new file after a moment (NFS caches)


@dataclass(frozen=True)
class Nodes:
    """The host name of every world rank (gather_nodes), and who shares a node with whom."""

    hosts: tuple[str, ...]
    rank: int               # this process's world rank
    world: Comm | None = field(default=None, compare=False)

    @property
    def count(self) -> int:
        """How many nodes the job runs on."""
        return len(set(self.hosts))

    def host(self, rank: int | None = None) -> str:
        """The host name of a world rank (default this one)."""
        return self.hosts[self.rank if rank is None else rank]

    def world_ranks(self, comm: Comm, ranks: list[int]) -> list[int]:
        """Translate ranks of comm (a sub-communicator of world) to world ranks (local, no message)."""
        if self.world is None or comm is self.world:
            return list(ranks)
        return list(MPI.Group.Translate_ranks(comm.Get_group(), ranks, self.world.Get_group()))

    def off_node(self, comm: Comm, peer: int) -> bool:
        """Whether rank peer of comm runs on another node than this rank."""
        if self.count == 1:
            return False
        return self.hosts[self.world_ranks(comm, [peer])[0]] != self.host()


def gather_nodes(world: Comm) -> Nodes:
    """Return every world rank's host name on every rank (collective, setup only)."""
    return Nodes(tuple(world.allgather(MPI.Get_processor_name())), world.Get_rank(), world)


def check_shared_directory(world: Comm, poller: Poller, nodes: Nodes, directory: str, what: str) -> None:
    """Raise AgreedError (exit 2) on every rank unless directory is the same directory on every node (collective).

    World rank 0 creates the directory (as the run would) and a probe file in it; every
    rank on another node looks for that file (up to SEE_TIMEOUT_S: attribute caches of
    network file systems); all agree; rank 0 removes the probe. On one node it does nothing.
    """
    if nodes.count == 1:
        return
    rank = world.Get_rank()
    name = problem = None
    if rank == 0:
        try:
            os.makedirs(directory, exist_ok=True)
            name = f".hpcpipe-shared-probe-{os.getpid()}-{time.time_ns()}"
            with open(os.path.join(directory, name), "w") as f:
                f.write(f"written by world rank 0 on {nodes.host(0)} to check that every node sees {what}\n")
        except OSError as exc:
            problem = f"cannot create {what} {directory!r} on {nodes.host(0)}: {exc.strerror or exc}"
    name, problem = broadcast(world, (name, problem))
    seen = True
    if problem is None and nodes.host() != nodes.host(0):
        seen = _sees(os.path.join(directory, name))
    blind = [r for r, ok in enumerate(world.allgather(seen)) if not ok]
    barrier(world, poller)
    if rank == 0 and name is not None:
        try:
            os.unlink(os.path.join(directory, name))
        except OSError:
            pass    # a probe left behind is a name, not a problem; the run goes on or stops below
    if problem is not None:
        raise AgreedError(problem, EXIT_CONFIG)
    if blind:
        hosts = sorted({nodes.host(r) for r in blind})
        raise AgreedError(
            f"{what} {directory!r} is not one directory shared by every node: the ranks on {', '.join(hosts)} "
            f"(world ranks {_ranges(blind)}) do not see the file world rank 0 made there on {nodes.host(0)}, so "
            f"their part of every checkpoint would be lost; a node-local path (/tmp, /dev/shm, a local disk) "
            f"cannot hold it: put {what} on a file system every node mounts", EXIT_CONFIG)


def _sees(path: str) -> bool:
    deadline = time.monotonic() + SEE_TIMEOUT_S
    while True:
        try:
            os.listdir(os.path.dirname(path))      # opening the directory revalidates an NFS client's cache
            if os.path.exists(path):
                return True
        except OSError:
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def _ranges(ranks: list[int]) -> str:
    """'1, 3, 5-7' for [1, 3, 5, 6, 7]."""
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(parts)
