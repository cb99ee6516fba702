"""The stop marker: a JSON file that says a run stopped on a signal after checkpointing, for the batch script.

Launchers disagree on what they return when every rank exits 75 (Open MPI's
mpirun returns 1 after a SIGTERM), so ``jobs/train.sbatch`` reads the file
that ``$HPCPIPE_STOP_MARKER`` names instead of the launcher's status.
"""

from __future__ import annotations

import os
import sys
import time

from hpcpipe.errors import EXIT_PREEMPTED
from hpcpipe.runtime.atomic_write import write_json_atomic

STOP_MARKER_ENV = "HPCPIPE_STOP_MARKER"


def write_stop_marker(step: int | None, reason: str, checkpoint_dir: str, env: dict | None = None) -> str:
    """After a stop on a signal, write the JSON stop marker $HPCPIPE_STOP_MARKER names; return its path ('' if unset).

    Launchers disagree on what they return when every rank exits 75 (Open MPI's
    mpirun returns 1 after a SIGTERM), so the batch script reads this file
    instead of the launcher's status. Written atomically (temporary file and
    rename) after the checkpoint is complete; a failure is reported on stderr
    and does not change the exit status.
    """
    env = os.environ if env is None else env
    path = env.get(STOP_MARKER_ENV, "")
    if not path:
        return ""
    record = {"status": EXIT_PREEMPTED, "step": step, "checkpoint_dir": checkpoint_dir or None, "reason": reason,
              "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "job_id": env.get("SLURM_JOB_ID"),
              "restart": env.get("SLURM_RESTART_COUNT"), "pid": os.getpid()}
    try:
        write_json_atomic(path, record)
    except OSError as exc:
        print(f"hpcpipe: warning: cannot write the stop marker {STOP_MARKER_ENV}={path!r}: {exc}; "
              f"exit status {EXIT_PREEMPTED} stands", file=sys.stderr, flush=True)
        return ""
    return path
