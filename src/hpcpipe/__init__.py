"""hpcpipe: pipeline-parallel training and inference on MPI clusters.

Importing the package caps the BLAS/OpenMP thread pools of each rank before
NumPy loads: with several ranks per node, every rank's BLAS spawning one
spinning thread per core starves the ranks that are computing.
"""

import os as _os

from hpcpipe.runtime.launcher import local_rank_count as _local_rank_count

__version__ = "0.1.0"


AUTO_THREADS = "HPCPIPE_AUTO_THREADS"   # the count hpcpipe chose itself (not the user), for child processes


def _cap_threads() -> None:
    """Give each node-local rank an equal share of the cores unless the user chose.

    A value hpcpipe set in a parent process (a script that imports hpcpipe and then
    starts ``mpiexec``) is not the user's choice: it was computed for that process
    alone, and would give every rank all the cores. It is marked in
    HPCPIPE_AUTO_THREADS, and a process that inherits it computes its own share.
    """
    cores = len(_os.sched_getaffinity(0)) if hasattr(_os, "sched_getaffinity") else (_os.cpu_count() or 1)
    share = _os.environ.get("HPCPIPE_THREADS") or str(max(1, cores // _local_rank_count()))
    inherited = _os.environ.get(AUTO_THREADS)
    chosen = False
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS"):
        current = _os.environ.get(name)
        if current is None or current == inherited:
            _os.environ[name] = share
            chosen = True
    if chosen:
        _os.environ[AUTO_THREADS] = share
    elif inherited is not None:
        del _os.environ[AUTO_THREADS]      # every variable is the user's: nothing of ours to pass on


_cap_threads()
