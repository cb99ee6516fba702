"""Progress of a long command: elapsed time and ETA, redrawn in place on a terminal, plain lines otherwise.

Every command that can run longer than a few seconds (training, the
planner's profiling and calibration, evaluation) reports through
:class:`Progress`. On a real terminal the line is redrawn with ``\\r`` (at
most a few times a second); anywhere else (a Slurm output file, a pipe) it
is a plain line at most every ``every_s`` seconds, and nothing at all for
the first ``every_s`` seconds, so a quick run stays quiet. Only world rank 0
writes. Whether the stream reaches a terminal is
:func:`hpcpipe.runtime.runenv.stdout_is_terminal`'s answer, which looks past
Open MPI's pseudo-terminals.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from hpcpipe.runtime.launcher import launcher_rank
from hpcpipe.runtime.runenv import stdout_is_terminal

PLAIN_EVERY_S = 5.0     # a log file gets a line at most this often
REDRAW_EVERY_S = 0.25   # a terminal is redrawn at most this often


def clock_text(seconds: float) -> str:
    """Seconds as M:SS, or H:MM:SS from an hour on."""
    whole = max(0, int(round(seconds)))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def eta_seconds(elapsed: float, fraction: float | None) -> float | None:
    """Seconds left when ``fraction`` of the work took ``elapsed`` seconds (None: not known yet)."""
    if fraction is None or fraction <= 0:
        return None
    return elapsed * (1.0 - min(fraction, 1.0)) / fraction


def timing_text(elapsed: float, fraction: float | None) -> str:
    """'elapsed 0:12 ETA 0:34' (the ETA left out while it is not known)."""
    eta = eta_seconds(elapsed, fraction)
    return f"elapsed {clock_text(elapsed)}" + (f" ETA {clock_text(eta)}" if eta is not None else "")


class Progress:
    """One progress line: ``show`` it as work advances, ``close`` it at the end.

    ``every_s`` (default PLAIN_EVERY_S) is the least time between two plain
    lines, and the time before the first line of either kind; 0: every
    ``show`` writes, for callers that choose their own cadence (training's
    ``log.every``).
    """

    def __init__(self, stream: Any = None, every_s: float | None = None, enabled: bool | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.stream = sys.stderr if stream is None else stream
        self.enabled = launcher_rank() == 0 if enabled is None else enabled
        self.tty = self.enabled and stdout_is_terminal(self.stream)
        self.every_s = PLAIN_EVERY_S if every_s is None else every_s
        self.clock = clock
        self.start = clock()
        self.last = self.start
        self.drawn = 0          # width of the line left on a terminal (0: none)
        self.printed = False    # a plain line or a redraw was written
        self.lock = threading.Lock()

    def elapsed(self) -> float:
        """Seconds since the progress began."""
        return self.clock() - self.start

    def line(self, text: str, fraction: float | None) -> str:
        """The text with the elapsed time and the ETA appended."""
        return f"{text} {timing_text(self.elapsed(), fraction)}"

    def show(self, text: str, fraction: float | None = None, force: bool = False) -> None:
        """Write ``text`` with elapsed and ETA, when due (``force``: now)."""
        if not self.enabled:
            return
        with self.lock:
            now = self.clock()
            due = 0.0 if self.every_s == 0 else REDRAW_EVERY_S if self.tty and self.printed else self.every_s
            if not force and now - self.last < due:
                return
            self.last = now
            self._write(self.line(text, fraction))

    def _write(self, line: str) -> None:
        if self.tty:
            pad = " " * max(0, self.drawn - len(line))
            self.stream.write("\r" + line + pad)
            self.drawn = len(line)
        else:
            self.stream.write(line + "\n")
        self.printed = True
        self.stream.flush()

    def close(self, text: str | None = None) -> None:
        """End the progress: ``text`` as the last line (when any line was shown), then a newline after a redraw."""
        if not self.enabled:
            return
        with self.lock:
            if text is not None and self.printed:
                self._write(self.line(text, 1.0))
            if self.tty and self.drawn:
                self.stream.write("\n")
                self.stream.flush()
                self.drawn = 0

    @contextlib.contextmanager
    def ticking(self, text: Callable[[], str], fraction: Callable[[], float | None],
                period_s: float = 1.0) -> Iterator[None]:
        """Show ``text()`` and ``fraction()`` every ``period_s`` while the body runs (it may block in a child)."""
        stop = threading.Event()

        def tick() -> None:
            while not stop.wait(period_s):
                try:
                    self.show(text(), fraction())
                except (OSError, ValueError):    # a closed or broken stream: progress is not worth failing for
                    return

        thread = threading.Thread(target=tick, name="hpcpipe-progress", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
