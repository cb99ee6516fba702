"""An emulated cluster for the tests: jobs/netns-cluster.sh up/down, and the real commands started in its nodes.

The tests' cluster has its own names (HPCPIPE_NETNS_NAME=hpctest) and network, so it never meets one a
person has up. Every node has its own /tmp: a job's files live in a directory under /var/tmp (shared).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from support import ROOT

SCRIPT = ROOT / "jobs" / "netns-cluster.sh"
NAME, NET = "hpctest", "10.213.9"
ENV = {"HPCPIPE_NETNS_NAME": NAME, "HPCPIPE_NETNS_NET": NET, "HPCPIPE_NETNS_DIR": f"/run/{NAME}-netns"}


def script(*args: str, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run jobs/netns-cluster.sh ARGS with the tests' names; return the finished process (text)."""
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **ENV, **(env or {})}, check=False)


def unavailable() -> str | None:
    """Why the emulated cluster cannot run here (not root, no ip/tc, no namespaces), or None."""
    if os.geteuid() != 0:
        return "the emulated cluster needs root (network namespaces); CI runs these tests as root"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"'{tool}' is not installed (apt-get install iproute2 util-linux)"
    if not os.path.exists(os.path.join(os.path.dirname(sys.executable), "mpiexec")):
        return "no mpiexec beside this Python (pip install '.[mpich]'): the cluster's launcher is MPICH hydra"
    for what, path in (("this Python's environment", Path(sys.prefix)), ("the checkout", ROOT)):
        if Path(path).resolve().is_relative_to("/tmp"):
            return (f"{what} ({path}) is under /tmp, which every emulated node replaces with its own: its ranks "
                    f"would not find it (make the venv and checkout outside /tmp)")
    return None


class Cluster:
    """A cluster that is up: its nodes' names and addresses, and jobs started in it."""

    def __init__(self, nodes: int, rate: str):
        up = script("up", str(nodes), rate)
        if up.returncode != 0:
            script("down")
            raise RuntimeError(f"netns-cluster.sh up failed ({up.returncode}): {up.stderr}{up.stdout}")
        self.nodes = [f"{NAME}-node{k}" for k in range(nodes)]
        self.addresses = [f"{NET}.{k + 1}" for k in range(nodes)]
        self.args = script("args").stdout.split()
        self.shared = Path(tempfile.mkdtemp(prefix="hpcpipe-netns-test-", dir="/var/tmp"))

    def workdir(self, name: str) -> Path:
        """A new directory every node sees, for one test's job."""
        path = self.shared / name
        path.mkdir()
        return path

    def mpiexec(self, n: int, *more: str, per_node: int | None = None) -> list[str]:
        """The argv that starts n ranks in the nodes (round robin, or per_node consecutive ranks a node)."""
        mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
        return [mpiexec, *self.args, "-n", str(n), *(["-ppn", str(per_node)] if per_node else []), *more]

    def command(self, n: int, module: str, args: list[str], per_node: int | None = None) -> list[str]:
        """`mpiexec <cluster> -n N python -m MODULE ARGS`."""
        return self.mpiexec(n, sys.executable, "-m", module, *args, per_node=per_node)

    def run(self, argv: list[str], timeout: float = 180, env: dict | None = None, cwd: Path | None = None):
        """Run a job to completion from cwd (default the shared directory); return the CompletedProcess."""
        full = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        full.pop("TMPDIR", None)     # hydra would hand the launcher's TMPDIR to ranks whose /tmp is another
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=full,
                              cwd=cwd or self.shared, check=False)

    def pids(self) -> dict[str, list[str]]:
        """The processes still running in each node (a finished job leaves none)."""
        out = {}
        for node in self.nodes:
            found = subprocess.run(["ip", "netns", "pids", node], capture_output=True, text=True, check=False)
            out[node] = found.stdout.split()
        return {node: pids for node, pids in out.items() if pids}

    def link_tx_bytes(self) -> dict[str, int]:
        """Bytes each node has sent over its link so far (the host end's receive counter)."""
        return {node: int(Path(f"/sys/class/net/{NAME}-v{k}/statistics/rx_bytes").read_text())
                for k, node in enumerate(self.nodes)}

    def down(self) -> subprocess.CompletedProcess:
        """Remove the cluster (and the shared directory this object made)."""
        shutil.rmtree(self.shared, ignore_errors=True)
        return script("down")
