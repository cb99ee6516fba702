"""A root's ``latest`` that lags behind the run it names, and when following the run's own pointer is safe.

A save commits ``run-R/step-M``, replaces ``run-R/latest``, then ``ROOT/latest``
(:mod:`hpcpipe.state.directory_protocol`). When the last of these fails (a full disk
between the two renames) the save reports the failure, but the step is committed
and the run's pointer names it while the root's still names the run's previous
step ``run-R/step-N``. Resuming from the root's would overwrite step M, so
``--resume`` used to refuse until ``checkpoint.dir`` was set to the run by hand.

:func:`lagging_root` recognises that state when it is unambiguous, and every reader
of the root then takes the run's newer checkpoint; the resumed run's first save
moves ``ROOT/latest`` forward as every save does. Nothing here writes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from hpcpipe.errors import ConfigError
from hpcpipe.state import directory_protocol as cf
from hpcpipe.state.manifest import read_manifest


@dataclass(frozen=True)
class Lag:
    """ROOT/latest names ``named``; the run it names has committed the later ``newer`` (both 'run-R/step-N')."""

    root: Path
    named: str
    newer: str


def lagging_root(root: str | Path) -> Lag | None:
    """Return how ROOT/latest lags its run's own ``latest`` when taking the run's is safe, else None.

    Safe means the pointer only moves forward, to a complete checkpoint, never past a
    newer one: the root's pointer names ``run-R/step-N``; ``run-R/latest`` names
    ``step-M`` with M > N; step M is committed (its manifest passes the checks every
    reader runs, its files are present); and no other run's ``latest`` names a
    checkpoint created after step M's (the manifests' ``created_unix``). Any doubt,
    an unreadable pointer included, is None: the root's pointer is then read as it is.
    """
    root = Path(root)
    try:
        named = cf.read_latest(root)
        if named is None or "/" not in named:
            return None
        run_name, step = named.split("/")
        run = root / run_name
        own = cf.read_latest(run) if run.is_dir() else None
    except ConfigError:
        return None
    if own is None or "/" in own or _step(own) <= _step(step):
        return None
    try:
        read_manifest(run / own)
    except ConfigError:
        return None
    created = _created(run / own)
    if created is None:
        return None
    for other in cf.run_dirs(root):
        if other.name == run_name:
            continue
        try:
            theirs = cf.read_latest(other)
        except ConfigError:
            continue
        when = _created(other / theirs) if theirs and "/" not in theirs else None
        if when is not None and when > created:
            return None
    return Lag(root, named, f"{run_name}/{own}")


def _step(name: str) -> int:
    """The step of a 'step-NNNNNNNN' name."""
    return int(name.rsplit("-", 1)[1])


def _created(step_dir: Path) -> float | None:
    """When a checkpoint's manifest says it was written (seconds since the epoch), None when it does not say."""
    try:
        value = json.loads(cf.read_regular(step_dir / cf.MANIFEST, cf.MANIFEST_BYTES, "manifest")).get("created_unix")
    except (ConfigError, UnicodeDecodeError, ValueError, AttributeError, RecursionError):
        return None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
