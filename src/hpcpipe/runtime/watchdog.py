"""The stall watchdog: a daemon thread per rank that dumps every thread's stack and aborts when progress stops.

The command's main loop calls ``beat(phase)`` at every step boundary and
around long operations (checkpoint saves); if no beat comes for
``run.stall_timeout`` seconds (a rank stuck in compute, or waiting on a stuck
neighbour), the thread dumps every thread's stack (faulthandler), each line
prefixed with the rank name, then calls the ``abort(code)`` it was given
(comm.abort on the world) with EXIT_STALLED. Nothing here touches MPI.

A server waits for work as well as for progress: ``idle(phase)`` says that
nothing is pending, and the watchdog then never fires, however long the wait
(or a SIGSTOP of the whole rank) lasts; ``progressed(phase, at)`` says that
work is pending and last moved at ``at`` (time.monotonic()), which may lie
before the call (the oldest of several pending pieces of work).

Time the whole process spent stopped (SIGSTOP, Slurm's ``scontrol suspend``,
a frozen VM) is not a stall of its work: when the watching thread wakes far
later than it asked to, the clock restarts then, so a rank resumed after a
long stop is given a full run.stall_timeout before its watchdog may fire
(its neighbours' watchdogs, which kept running, see the stall meanwhile).
"""

from __future__ import annotations

import faulthandler
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from hpcpipe.errors import EXIT_STALLED


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
        self._idle = False       # True: nothing pending, the clock does not run
        self._resumed = 0.0      # when this process last woke from a stop (see _run)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.fired = False

    def beat(self, phase: str) -> None:
        """Record progress: the main thread has reached `phase` (cheap: three assignments)."""
        self.phase = phase
        self._last = time.monotonic()
        self._idle = False

    def progressed(self, phase: str, at: float) -> None:
        """Record that work is pending in `phase` and last progressed at time.monotonic() value `at`."""
        self.phase = phase
        self._last = at          # set before _idle: the watching thread never sees a pending state with a stale time
        self._idle = False

    def idle(self, phase: str = "idle") -> None:
        """Record that nothing is pending: the rank waits for work, and the watchdog does not fire until work comes."""
        self.phase = phase
        self._idle = True

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
        tick = time.monotonic()
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            if now - tick > self.interval + max(1.0, self.interval):
                self._resumed = now      # the whole process was stopped: the lost time is not its work's stall
            tick = now
            if self._idle:
                continue
            idle = now - max(self._last, self._resumed)
            if idle > self.timeout and not self._idle:    # the work may have ended while we looked
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
