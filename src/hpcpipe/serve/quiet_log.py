"""Log lines for events a client can cause at will (connections reset mid-body, requests whose sampling fails).

Each such event is one line at most, never a traceback, and after the first only one line per ``every``
events reaches the log: a client repeating the event cannot fill the job's log or slow the server
writing it. The count in each line says how many there were.
"""

from __future__ import annotations

import sys
import threading
from typing import Any


class RateLimitedLog:
    """Print the first event's line, then one line per ``every`` events, each with the running count."""

    def __init__(self, every: int = 100, stream: Any = None):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"RateLimitedLog: every must be an integer >= 1, got {every!r}")
        self.every, self.stream = every, stream
        self.count = 0
        self._lock = threading.Lock()

    def __call__(self, line: str) -> bool:
        """Count one event; print its line when it is the first or an every-th one; return whether it printed."""
        with self._lock:
            self.count += 1
            count = self.count
        if count != 1 and count % self.every:
            return False
        tail = "" if count == 1 else f"; {count} such events so far, one line per {self.every}"
        print(f"{line}{tail}", file=self.stream or sys.stderr, flush=True)
        return True
