"""The machine's load beside a profile: recorded when it is measured, and whether it was too busy to trust.

The profile cache is shared by every plan of a model on a host, so a profile
taken while other jobs computed (slower layers, noisier lines) would be reused
silently by every later plan. The 1-minute load average and the core count are
stored with the profile when it is measured, and the planner warns when the
profile it uses was measured on a busy machine, or when it measures on one now.
Busy means more runnable processes than cores: the load average above the
cores' count.
"""

from __future__ import annotations

import os
import time
from typing import Any


def core_count() -> int:
    """Cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def machine_load() -> dict[str, Any] | None:
    """{'load_1m', 'cores', 'unix'} now, or None where the system has no load average."""
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):
        return None
    return {"load_1m": round(load, 2), "cores": core_count(), "unix": round(time.time())}


def _share(record: Any) -> float | None:
    """Load per core of a record, None when there is none or it is damaged."""
    if not isinstance(record, dict):
        return None
    load, cores = record.get("load_1m"), record.get("cores")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (load, cores)) or cores <= 0:
        return None
    return load / cores


def is_busy(record: Any) -> bool:
    """Whether a load record says the machine was busy (load above its cores); False for none or a damaged one."""
    share = _share(record)
    return share is not None and share > 1.0


def busier(old: Any, new: Any) -> Any:
    """The record of the busier measurement (a profile merged from two sessions is as trustworthy as its worst)."""
    a, b = _share(old), _share(new)
    return old if a is not None and (b is None or a > b) else new


def load_text(record: dict, dated: bool = True) -> str:
    """'load 3.1 on 2 cores' (with the date it was recorded: dated)."""
    when = record.get("unix")
    stamped = dated and isinstance(when, (int, float)) and not isinstance(when, bool)
    date = f", {time.strftime('%Y-%m-%d %H:%M', time.localtime(when))}" if stamped else ""
    return f"load {record['load_1m']:g} on {record['cores']} cores{date}"


def busy_warning(used: Any, now: Any, measuring: bool) -> str | None:
    """One warning line, or None: the machine is busy now while measuring, or the cached part was measured busy."""
    if measuring and is_busy(now):
        return (f"hpcpipe.plan: warning: this machine is busy ({load_text(now, dated=False)}): the profile "
                f"measured now may be slow and is cached for every later plan; measure again on a quiet machine "
                f"with --refresh-profile")
    if is_busy(used):
        return (f"hpcpipe.plan: warning: the cached profile was measured on a busy machine ({load_text(used)}); "
                f"its times may be slow: measure again on a quiet machine with --refresh-profile")
    return None
