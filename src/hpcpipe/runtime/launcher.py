"""What the launcher (mpiexec, mpirun, srun) told this process through its environment, before MPI starts.

Every answer here reads environment variables only: no MPI call, no import of
anything slow, so the package's import (which caps BLAS threads before NumPy
loads) and a command's argument parsing can use them. Launchers disagree on
names, so each answer tries MPICH/Hydra (PMI), Open MPI, PMIx and Slurm in
that order of trust.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")
SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "SLURM_NTASKS")
LOCAL_RANK_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "PMI_LOCAL_RANK")
LOCAL_SIZE_VARIABLES = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE",
                        "PMI_LOCAL_SIZE", "MPI_LOCAL_NRANKS")


def _first_count(names: tuple[str, ...], env: Mapping[str, str] | None) -> int | None:
    """The first of names that holds a non-negative integer (Slurm's "4(x2)" and "4,2" forms: the first count)."""
    env = os.environ if env is None else env
    for name in names:
        value = env.get(name, "").strip().split("(")[0].split(",")[0]
        if value.isdigit():
            return int(value)
    return None


def launcher_rank(env: Mapping[str, str] | None = None) -> int:
    """Return this process's world rank from the launcher's environment (0 when not launched by one)."""
    rank = _first_count(RANK_VARIABLES, env)
    return 0 if rank is None else rank


def launcher_size(env: Mapping[str, str] | None = None) -> int:
    """Return how many processes the launcher started (0 when it does not say)."""
    size = _first_count(SIZE_VARIABLES, env)
    return 0 if size is None else size


def local_rank(default: int = 0, env: Mapping[str, str] | None = None) -> int:
    """Return this process's rank among the ranks of its node."""
    rank = _first_count(LOCAL_RANK_VARIABLES, env)
    return default if rank is None else rank


def local_rank_count(default: int = 1, env: Mapping[str, str] | None = None) -> int:
    """Return how many ranks of this job share this node (default when the launcher does not say)."""
    count = _first_count(LOCAL_SIZE_VARIABLES, env) or slurm_tasks_here(env)
    return count if count else default


def slurm_tasks_here(env: Mapping[str, str] | None = None) -> int | None:
    """Return the tasks srun started on this node, from SLURM_TASKS_PER_NODE and SLURM_NODEID; None if unknown.

    srun sets SLURM_NTASKS_PER_NODE only when asked for --ntasks-per-node; SLURM_TASKS_PER_NODE
    ("4(x2),3": 4 on each of the first two nodes, 3 on the third) is always there. Only for an srun task
    (SLURM_LOCALID set): in the batch shell it describes the allocation, not a job step.
    """
    env = os.environ if env is None else env
    node, spec = env.get("SLURM_NODEID", "").strip(), env.get("SLURM_TASKS_PER_NODE", "").strip()
    if not env.get("SLURM_LOCALID", "").strip().isdigit() or not node.isdigit() or not spec:
        return None
    counts: list[int] = []
    for part in spec.split(","):
        number, _, repeat = part.partition("(x")
        if not number.isdigit() or (repeat and not repeat.rstrip(")").isdigit()):
            return None
        counts += [int(number)] * (int(repeat.rstrip(")")) if repeat else 1)
        if len(counts) > int(node):
            return counts[int(node)] or None
    return None


def under_open_mpi(env: Mapping[str, str] | None = None) -> bool:
    """True when this process was started by Open MPI's launcher (its OMPI_COMM_WORLD_* variables)."""
    env = os.environ if env is None else env
    return "OMPI_COMM_WORLD_SIZE" in env



# what mpiexec / mpirun set, not Slurm's counts: a batch script's plain `python -m ...` sees SLURM_NTASKS too
MPI_SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE")


def _parent_has(name: str, env: Mapping[str, str] | None = None) -> bool | None:
    """Whether this process's parent has the environment variable ``name`` with this process's value (Linux /proc;
    None where its environment cannot be read). The value too: a rank's child inherits it whole, while a launcher
    started by another (Hydra's proxies, Open MPI's daemons under srun) holds that launcher's own count."""
    env = os.environ if env is None else env
    parent = f"/proc/{os.getppid()}"
    try:
        with open(f"{parent}/environ", "rb") as f:
            entries = f.read().split(b"\0")
    except OSError:
        # srun's slurmstepd runs as root, so a user's task cannot read its environment; a rank (whose child
        # this would be) runs as the user: a parent of another user is the launcher, which never holds them
        try:
            return False if os.stat(parent).st_uid != os.getuid() else None
        except OSError:
            return None
    return f"{name}={env.get(name, '')}".encode() in entries


def one_process_problem(command: str, env: Mapping[str, str] | None = None,
                        parent_has: bool | None = None) -> str | None:
    """Why a one-process command must not run as N > 1 ranks of mpiexec, or None: each rank would do the whole job
    (evaluate N times over) and write the same output (checkpoint import / export: all but one refused).

    Only a process the launcher started counts: the launcher (Hydra's proxy, Open MPI's mpirun or orted, srun's
    slurmstepd) sets the size variable for its ranks, not in its own environment, while a command that a rank runs
    as a child process inherits the rank's variables from its parent and runs alone. ``parent_has``: whether the
    parent holds them (None: read from /proc; a parent of this user that cannot be read counts as a child,
    never refused; one of another user, as srun's slurmstepd, as the launcher).
    """
    name = next((n for n in MPI_SIZE_VARIABLES if _first_count((n,), env) is not None), None)
    size = _first_count((name,), env) if name else None
    if size is None or size <= 1:
        return None
    if parent_has is None:
        parent_has = _parent_has(name, env)
    if parent_has is not False:
        return None
    return (f"python -m {command} runs on one process, and the launcher started {size}: each would do the whole "
            f"job and write the same output; run it without mpiexec")


# The size of the job step the launcher started, most specific first: srun's SLURM_NTASKS is the allocation's in
# a batch shell, SLURM_STEP_NUM_TASKS only exists inside an srun step.
STEP_SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "SLURM_STEP_NUM_TASKS")


def launcher_mismatch(world_size: int, library: str, env: Mapping[str, str] | None = None,
                      parent_has: bool | None = None) -> str:
    """Why MPI sees this process alone although its launcher started several ('' when it does not).

    srun without the MPI's PMI plugin (``--mpi=pmi2``/``pmix``), or an mpiexec of another MPI than the
    libmpi mpi4py loaded, starts N singletons: each then failed on its own with a layout message ("world size 1
    is not divisible by parallel.pp (4)", printed N times) that hid the cause. ``library`` names the MPI loaded.
    As for one_process_problem, only a process the launcher started counts (``parent_has``: whether the parent
    holds the size variable found, with its value; a rank's child inherits it and runs alone by design).
    """
    env = os.environ if env is None else env
    if world_size != 1:
        return ""
    for name in STEP_SIZE_VARIABLES:
        size = _first_count((name,), env)
        if size is None:
            continue
        if size <= 1 or (name == "SLURM_STEP_NUM_TASKS" and env.get("SLURM_PTY_PORT")):
            return ""       # `srun -n 4 --pty bash`: a shell in task 0 that may run a program alone
        if parent_has is None:
            parent_has = _parent_has(name, env)
        if parent_has is not False:
            return ""
        if name == "SLURM_STEP_NUM_TASKS":
            return (f"srun started {size} tasks ({name}={size}) but MPI sees each one alone (world size 1): srun "
                    f"needs the PMI plugin of this MPI ({library}): srun --mpi=pmi2 or --mpi=pmix (`srun --mpi=list` "
                    f"lists them; jobs/*.sbatch: HPCPIPE_LAUNCHER_ARGS=--mpi=pmi2), or launch with mpiexec")
        return (f"the launcher started {size} processes ({name}={size}) but MPI sees each one alone (world size 1): "
                f"the launcher does not belong to the MPI library mpi4py loaded ({library}); use that MPI's "
                f"mpiexec, or point mpi4py at the launcher's libmpi (MPI4PY_LIBMPI, docs/cluster.md \"Which MPI\")")
    return ""
