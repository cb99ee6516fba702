"""This process's resident set size (RSS) now and at its peak, in bytes."""

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


def resident_bytes() -> int:
    """Return this process's resident memory now (VmRSS), else its peak where /proc is missing."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return peak_rss_bytes()
