"""Test hooks: every ``HPCPIPE_*`` fault the tests inject, read from the environment by one parser.

Environment only, never config, and inert when unset. Each hook names the
world rank and the step (or micro-batch, or save point) it fires at:

    HPCPIPE_FAULT='rank=R,step=S'                  training: raise on rank R at step S;
                                                   inference: raise before rank R's S-th micro-batch;
                                                   serving: before rank R's S-th work item
    HPCPIPE_STALL='rank=R,step=S,seconds=T'        sleep T seconds at step S (a stuck rank)
    HPCPIPE_NAN='rank=R,step=S[,count=C][,what=grad|loss]'   poison a gradient or loss
    HPCPIPE_CRASH_IN_SAVE='step=S,rank=R[,point=write|commit]'   SIGKILL while saving step S
    HPCPIPE_STEP_SLEEP=S                           sleep S seconds before each step (lets a test kill mid-run);
                                                   serving: before each work item of a replica's first stage
    HPCPIPE_PID_DIR=DIR                            write DIR/rank-R.pid at start-up

This module imports only the standard library (and :mod:`hpcpipe.runtime.atomic_write`, which does
too): ``python -m hpcpipe.train`` loads it before NumPy and MPI.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from hpcpipe.runtime.atomic_write import write_atomic


def hook_fields(name: str) -> dict[str, str]:
    """Parse a test-hook environment variable 'key=value,key=value' into a dict (empty when unset)."""
    spec = os.environ.get(name, "")
    return dict(item.split("=", 1) for item in spec.split(",") if "=" in item)


def _hits(fields: dict[str, str], world_rank: int, step: int) -> bool:
    """True when a hook names this rank and a step in [step, step + count)."""
    if not fields or int(fields.get("rank", -1)) != world_rank:
        return False
    first = int(fields.get("step", -1))
    return first <= step < first + int(fields.get("count", 1))


def fault_injection(world_rank: int, step: int) -> None:
    """HPCPIPE_FAULT: raise on the rank and training step it names."""
    fields = hook_fields("HPCPIPE_FAULT")
    if _hits(fields, world_rank, step):
        spec = os.environ["HPCPIPE_FAULT"]
        raise RuntimeError(f"injected fault (HPCPIPE_FAULT={spec!r}) on world rank {world_rank} at step {step}")


def fault_step(world_rank: int) -> int:
    """HPCPIPE_FAULT for inference: the micro-batch index before which this rank raises, else -1."""
    fields = hook_fields("HPCPIPE_FAULT")
    return int(fields.get("step", -1)) if fields and int(fields.get("rank", -1)) == world_rank else -1


def stall_injection(world_rank: int, step: int) -> None:
    """HPCPIPE_STALL: make the named rank sleep at the named step (a stuck rank for the watchdog)."""
    fields = hook_fields("HPCPIPE_STALL")
    if _hits(fields, world_rank, step):
        time.sleep(float(fields.get("seconds", 3600)))


def nan_injection(world_rank: int, step: int) -> str | None:
    """HPCPIPE_NAN: what to poison on this rank at this step ("grad" or "loss"), or None."""
    fields = hook_fields("HPCPIPE_NAN")
    if _hits(fields, world_rank, step):
        return fields.get("what", "grad")
    return None


def crash_due(point: str, step: int, world_rank: int) -> bool:
    """HPCPIPE_CRASH_IN_SAVE: whether it names this save point, step and rank."""
    fields = hook_fields("HPCPIPE_CRASH_IN_SAVE")
    return bool(fields) and (fields.get("point", "write") == point and int(fields.get("step", -1)) == step
                             and int(fields.get("rank", 0)) == world_rank)


def crash_hook(point: str, step: int, world_rank: int) -> None:
    """HPCPIPE_CRASH_IN_SAVE: kill this process (SIGKILL) at the save point, step and rank it names."""
    if crash_due(point, step, world_rank):
        os.kill(os.getpid(), signal.SIGKILL)


def step_sleep() -> None:
    """HPCPIPE_STEP_SLEEP: sleep that many seconds before each step."""
    seconds = float(os.environ.get("HPCPIPE_STEP_SLEEP", "0") or 0)
    if seconds > 0:
        time.sleep(seconds)


def write_pid(world_rank: int) -> None:
    """HPCPIPE_PID_DIR: write this rank's process id to DIR/rank-R.pid (right after the stop handlers)."""
    directory = os.environ.get("HPCPIPE_PID_DIR", "")
    if directory:
        # written whole: a test polling for the file never reads it half written
        write_atomic(Path(directory, f"rank-{world_rank}.pid"), f"{os.getpid()}\n")
