"""The stall watchdog: a daemon thread per rank that dumps every thread's stack and aborts when progress stops.

The command's main loop calls ``beat(phase)`` at every step boundary and
around long operations (checkpoint saves); if no beat comes for
``run.stall_timeout`` seconds (a rank stuck in compute, or waiting on a stuck
neighbour), the thread dumps every thread's stack (faulthandler), each line
prefixed with the rank name, then calls the ``abort(code)`` it was given
(comm.abort on the world) with EXIT_STALLED. Nothing here touches MPI.
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
