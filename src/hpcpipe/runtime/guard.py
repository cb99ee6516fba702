"""Run guards: preemption signals, the stall watchdog, the per-step health decision, and exit statuses.

Nothing here touches MPI, and NumPy is loaded only when a step decision is
made, so that importing this module stays cheap for the commands' start-up.
The step decision is a small float64 vector that the trainer sums over every
rank with its one per-step allreduce (comm.py); the watchdog is given an
``abort(code)`` callable (comm.abort on the world).

* Signals (SIGUSR1, SIGTERM; :mod:`hpcpipe.runtime.stopsignal`):
  the handler only records the signal number; ``python -m hpcpipe.train``
  installs it before anything slow, so a signal during start-up is kept.
  At the next step boundary every rank learns, through the step decision,
  whether any rank was signalled; all then write a checkpoint and exit with
  EXIT_PREEMPTED together. No I/O and no collectives in the handler.
* Watchdog: a daemon thread per rank. The training loop calls ``beat(phase)``
  at every step boundary and around checkpoint saves; if no beat comes for
  ``run.stall_timeout`` seconds (a rank stuck in compute, or waiting on a
  stuck neighbour), the thread dumps every thread's stack (faulthandler),
  each line prefixed with the rank name, then aborts the job with EXIT_STALLED.
* Numerical faults: a rank whose loss or gradient is not finite sets a flag in
  the step decision; every rank sees the same sum and skips the update
  together; ``train.max_bad_steps`` skipped steps in a row end the run with
  EXIT_DIVERGED.
"""

from __future__ import annotations

import faulthandler
import json
import math
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hpcpipe.errors import EXIT_PREEMPTED, EXIT_STALLED

if TYPE_CHECKING:
    import numpy as np


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
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(record, f)
            f.write("\n")
        os.replace(tmp, path)
    except OSError as exc:
        print(f"hpcpipe: warning: cannot write the stop marker {STOP_MARKER_ENV}={path!r}: {exc}; "
              f"exit status {EXIT_PREEMPTED} stands", file=sys.stderr, flush=True)
        return ""
    return path


class Watchdog:
    """A daemon thread that dumps every thread's stack and aborts when no beat comes for `timeout` seconds."""

    def __init__(self, timeout: float, name: Callable[[], str], abort: Callable[[int], None],
                 stream: Any = None, grace: float | None = None):
        self.timeout = float(timeout)
        self.name = name
        self.abort = abort
        self.stream = stream
        # Wait a little between the dump and the abort so the other ranks' watchdogs, which
        # started their clocks at the same step boundary, dump their stacks too.
        self.grace = min(2.0, self.timeout / 4) if grace is None else grace
        self.interval = max(0.05, min(1.0, self.timeout / 10))
        self.phase = "startup"
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.fired = False

    def beat(self, phase: str) -> None:
        """Record progress: the main thread has reached `phase` (cheap: two assignments)."""
        self.phase = phase
        self._last = time.monotonic()

    def start(self) -> Watchdog:
        """Start watching (no-op when timeout is 0)."""
        if self.timeout > 0 and self._thread is None:
            self._last = time.monotonic()
            self._thread = threading.Thread(target=self._run, name="hpcpipe-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching and join the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            idle = time.monotonic() - self._last
            if idle > self.timeout:
                self.fire(idle)
                return

    def fire(self, idle: float) -> None:
        """Dump every thread's stack, prefixed with the rank name, then abort with EXIT_STALLED."""
        self.fired = True
        name = self.name()
        stream = self.stream or sys.stderr
        header = (f"hpcpipe: [{name}] watchdog: no progress for {idle:.1f} s (run.stall_timeout = "
                  f"{self.timeout:g} s) in {self.phase}; stacks of every thread follow, then the job is "
                  f"aborted with exit status {EXIT_STALLED}\n")
        stream.write(header + self.stacks(name))
        stream.flush()
        time.sleep(self.grace)
        self.abort(EXIT_STALLED)

    @staticmethod
    def stacks(name: str) -> str:
        """Return faulthandler's dump of every thread, each line prefixed with '[name] '."""
        try:
            with tempfile.TemporaryFile("w+") as tmp:
                faulthandler.dump_traceback(file=tmp, all_threads=True)
                tmp.flush()
                tmp.seek(0)
                text = tmp.read()
        except OSError as exc:   # no temporary directory: say so rather than lose the abort
            return f"[{name}] (cannot dump stacks: {exc})\n"
        return "".join(f"[{name}] {line}\n" for line in text.splitlines())


# The step decision: one float64 vector summed over every rank (one allreduce per step).
NORM, LOSS, BAD, STOP = range(4)
DECISION_SIZE = 4


@dataclass(frozen=True)
class StepDecision:
    """What every rank agreed on after a step's forward/backward (identical on all ranks)."""

    grad_norm: float
    loss_sum: float
    bad_ranks: int      # ranks whose loss or gradient was not finite
    stop_ranks: int     # ranks that received a stop signal

    @property
    def stop(self) -> bool:
        """True when some rank received a stop signal: every rank checkpoints and stops."""
        return self.stop_ranks > 0

    @property
    def skip(self) -> bool:
        """True when the update must be skipped (a non-finite value on any rank)."""
        return self.bad_ranks > 0


def local_decision(grad_sq: float, loss_sum: float, count_norm: bool, stop: bool) -> np.ndarray:
    """Return this rank's contribution to the step decision.

    grad_sq counts once per stage (count_norm on one replica only), so that the
    world sum is the squared global norm exactly as a sum over the pipeline.
    """
    import numpy as np  # here, not at module import: see the module docstring

    out = np.zeros(DECISION_SIZE, dtype=np.float64)
    out[NORM] = grad_sq if count_norm else 0.0
    out[LOSS] = loss_sum
    out[BAD] = 0.0 if (math.isfinite(grad_sq) and math.isfinite(loss_sum)) else 1.0
    out[STOP] = 1.0 if stop else 0.0
    return out


def decide(total: np.ndarray) -> StepDecision:
    """Turn the world sum of local_decision vectors into the agreed StepDecision."""
    bad = int(total[BAD])
    norm = math.sqrt(float(total[NORM])) if not bad else float("nan")
    return StepDecision(grad_norm=norm, loss_sum=float(total[LOSS]), bad_ranks=bad, stop_ranks=int(total[STOP]))
