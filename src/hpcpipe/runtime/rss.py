"""This process's peak resident set size (RSS), in bytes."""

from __future__ import annotations

import resource
import sys


def peak_rss_bytes() -> int:
    """Return the most resident memory this process has held so far, in bytes (0 where unknown)."""
    try:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    except (OSError, ValueError):
        return 0
    # Linux reports KiB, macOS bytes
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024
