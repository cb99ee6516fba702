"""The on-disk protocol of checkpoints: run directories, names, atomic commit, ``latest``, retention.

No MPI here: :mod:`hpcpipe.state.collective` decides who calls what; what makes
a manifest valid is :mod:`hpcpipe.state.manifest`. ``checkpoint.dir`` is a root
of runs; every fresh run writes into its own run directory::

    ROOT/latest                              "run-0002/step-00000006": the newest checkpoint any run committed
    ROOT/run-0002/latest                     "step-00000006": this run's newest checkpoint
    ROOT/run-0002/step-00000006/manifest.json layout, step, run, config, SHA-256 and size of every file
    ROOT/run-0002/step-00000006/stage-000.h5 one file per pipeline rank, layers by global index
    ROOT/run-0002/.tmp-step-00000008/        a save in progress (or left by a crash: ignored, then cleaned)
    ROOT/run-0002/.del-step-00000002/        a checkpoint being deleted by retention (ignored, then cleaned)

A run directory is a checkpoint directory exactly as roots were before runs
existed; such an old-layout root (``latest`` = "step-N", step directories in
ROOT itself) is still read, and a resumed run keeps writing into it.

A save writes into ``.tmp-step-N``, fsyncs every file, writes and fsyncs
the manifest, fsyncs the directory, renames it to ``step-N`` and fsyncs the
run directory; only then is the run's ``latest`` replaced (write
``.latest.tmp``, fsync, rename), then ROOT's (through a temporary named
after the run, so runs never remove each other's). A crash at any point
leaves every ``latest`` naming a complete checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import time
from pathlib import Path
from typing import Any

from hpcpipe.errors import ConfigError
from hpcpipe.state.outputs import file_kind

MANIFEST = "manifest.json"
LATEST = "latest"
MANIFEST_FORMAT = "hpcpipe-checkpoint"
MANIFEST_VERSION = 1
_STEP_RE = re.compile(r"^step-(\d{8,})$")
_RUN_RE = re.compile(r"^run-(\d{4,})$")
_ANY_STEP_RE = re.compile(r"^(\.tmp-|\.del-)?step-(\d{8,})$")
_LATEST_RE = re.compile(r"^(run-\d{4,}/)?step-\d{8,}$")
_LEFTOVER_PREFIXES = (".tmp-step-", ".del-step-")
_LATEST_TMP = ".latest.tmp"
POINTER_BYTES = 4096          # a pointer holds one name ("run-0002/step-00000012"): anything longer is not one
MANIFEST_BYTES = 64 << 20     # far above any manifest (one entry per stage file, the config): a bound, not a size


def step_name(step: int) -> str:
    """Return the directory name of the checkpoint taken after `step` completed steps."""
    return f"step-{step:08d}"


def step_of_dir_name(name: str) -> tuple[int, bool] | None:
    """Return (step, committed?) for step-N, .tmp-step-N and .del-step-N names, None for any other name."""
    match = _ANY_STEP_RE.match(name)
    return (int(match.group(2)), not match.group(1)) if match else None


def tmp_name(step: int) -> str:
    """Return the name of the temporary directory a save of `step` writes into."""
    return f".tmp-{step_name(step)}"


def stage_file(pp_rank: int) -> str:
    """Return the file name of one pipeline rank's share of a checkpoint."""
    return f"stage-{pp_rank:03d}.h5"


def fsync_path(path: str | Path) -> None:
    """Flush a file's or a directory's data and metadata to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: str | Path) -> str:
    """Return the hex SHA-256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def build_manifest(step: int, n_layers: int, layout: dict[str, Any], config: dict[str, Any],
                   optimizer: dict[str, Any], data: dict[str, Any], files: list[dict[str, Any]],
                   run: str = "") -> dict[str, Any]:
    """Return the manifest of a checkpoint (plain JSON data); `run` is the name of the run directory."""
    return {"format": MANIFEST_FORMAT, "format_version": MANIFEST_VERSION, "step": step, "n_layers": n_layers,
            "run": run,
            "layout": layout, "optimizer": optimizer, "data": data, "config": config,
            "files": sorted(files, key=lambda e: e["name"]), "created_unix": time.time()}


def write_json_durably(path: Path, obj: Any) -> None:
    """Write JSON text to path and fsync it."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def check_file(step_dir: str | Path, entry: dict[str, Any]) -> Path:
    """Check one manifest entry's file exists with the recorded size and SHA-256; return its path."""
    path = Path(step_dir) / entry["name"]
    if not path.is_file():
        raise ConfigError(f"checkpoint file {str(path)!r} is missing")
    size = path.stat().st_size
    if size != int(entry["bytes"]):
        raise ConfigError(f"checkpoint file {str(path)!r} has {size} bytes, the manifest records "
                          f"{entry['bytes']} (truncated or replaced)")
    digest = sha256_file(path)
    if digest != entry["sha256"]:
        raise ConfigError(f"checkpoint file {str(path)!r} fails its SHA-256 check (manifest {entry['sha256'][:16]}..., "
                          f"file {digest[:16]}...): corrupt or foreign")
    return path


def read_regular(path: Path, limit: int, what: str) -> bytes:
    """Return the bytes of the regular file at path; ConfigError naming it when it is anything else or holds more
    than limit bytes: opening a named pipe must not block every rank for good (no watchdog runs yet, and a stop
    signal cannot interrupt the open), and a device (a link to /dev/zero) must not feed the reader forever."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise ConfigError(f"{what} {str(path)!r} is unreadable: {exc}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):    # before fdopen, which refuses a directory with its own error
        os.close(fd)
        raise ConfigError(f"{what} {str(path)!r} is {file_kind(path)}, not a regular file")
    with os.fdopen(fd, "rb") as f:
        try:
            data = _read_at_most(f, limit + 1)
        except OSError as exc:
            raise ConfigError(f"{what} {str(path)!r} is unreadable: {exc}") from None
    if len(data) > limit:
        raise ConfigError(f"{what} {str(path)!r} holds more than {limit} bytes, far more than any {what} "
                          f"hpcpipe writes: not one")
    return data


def _read_at_most(f: Any, most: int) -> bytes:
    """Up to ``most`` bytes of f, read a MiB at a time: f.read(most) allocates ``most`` bytes before reading one,
    and the bound is far above any real file (a 16 GiB bound on a trace raised MemoryError under ulimit -v)."""
    chunks, left = [], most
    while left > 0:
        chunk = f.read(min(left, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_latest(root: str | Path) -> str | None:
    """Return what `latest` in root names ("step-N" or, in a root of runs, "run-NNNN/step-N"), or None.

    Anything else (an absolute path, '..', a symlink leading out of root) is refused with ConfigError.
    """
    root = Path(root)
    path = root / LATEST
    if not path.exists() and not path.is_symlink():
        return None
    try:
        name = read_regular(path, POINTER_BYTES, "checkpoint pointer").decode().strip()
    except UnicodeDecodeError as exc:
        raise ConfigError(f"checkpoint pointer {str(path)!r} is unreadable: {exc}") from None
    if not _LATEST_RE.match(name):
        raise ConfigError(f"checkpoint pointer {str(path)!r} holds {name[:40]!r}, not a step-NNNNNNNN or "
                          f"run-NNNN/step-NNNNNNNN name")
    target = root / name
    try:
        inside = target.resolve().is_relative_to(root.resolve())
    except (OSError, RuntimeError):
        inside = False
    if not inside:
        raise ConfigError(f"checkpoint pointer {str(path)!r} names {name!r}, which leads out of {str(root)!r} "
                          f"(a symbolic link?)")
    return name


def set_latest(root: str | Path, name: str, tmp_name: str = _LATEST_TMP) -> None:
    """Atomically point `latest` at a committed checkpoint (temporary file, fsync, rename, fsync dir)."""
    root = Path(root)
    tmp = root / tmp_name
    try:
        with open(tmp, "w") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, root / LATEST)
    except OSError:
        tmp.unlink(missing_ok=True)   # e.g. disk full: leave no half-written pointer behind
        raise
    fsync_path(root)


def root_latest_tmp(run_dir: Path) -> str:
    """Return the name of the temporary file through which a run replaces ROOT/latest (its own, never shared)."""
    return f"{_LATEST_TMP}-{run_dir.name}"


def run_name(number: int) -> str:
    """Return the name of a run directory, e.g. run-0003."""
    return f"run-{number:04d}"


def run_dirs(root: str | Path) -> list[Path]:
    """Return the run directories of a root, by number."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), c) for c in root.iterdir() if (m := _RUN_RE.match(c.name)) and c.is_dir()]
    return [c for _, c in sorted(found)]


def new_run_dir(root: str | Path) -> Path:
    """Create and return ROOT/run-NNNN with the next free number (mkdir is the lock: retried on a race)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    taken = [int(_RUN_RE.match(d.name).group(1)) for d in run_dirs(root)]
    number = max(taken, default=0) + 1
    while True:
        path = root / run_name(number)
        try:
            path.mkdir()
            return path
        except FileExistsError:
            number += 1


def is_run_dir(path: str | Path) -> bool:
    """Whether path is named like a run directory (run-NNNN)."""
    return bool(_RUN_RE.match(Path(path).name))


def commit(root: str | Path, tmp_dir: str | Path, step: int) -> Path:
    """Make a fully written temporary checkpoint directory visible as step-N, durably."""
    root, tmp_dir = Path(root), Path(tmp_dir)
    fsync_path(tmp_dir)
    final = root / step_name(step)
    if final.exists():   # a complete but unreferenced save of the same step from an earlier, crashed run
        aside = root / f".del-{step_name(step)}"
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(final, aside)
        shutil.rmtree(aside, ignore_errors=True)
    os.rename(tmp_dir, final)
    fsync_path(root)
    return final


def committed_steps(root: str | Path) -> list[int]:
    """Return the steps of every step-N directory that holds a manifest, ascending."""
    root = Path(root)
    if not root.is_dir():
        return []
    steps = []
    for child in root.iterdir():
        match = _STEP_RE.match(child.name)
        if match and (child / MANIFEST).is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def prune(root: str | Path, keep: int) -> list[int]:
    """Delete all but the newest `keep` committed checkpoints, never the one `latest` names; return deleted steps."""
    root = Path(root)
    latest = read_latest(root)
    steps = committed_steps(root)
    doomed = [s for s in steps[:-max(keep, 1)] if step_name(s) != latest]
    for step in doomed:
        aside = root / f".del-{step_name(step)}"
        os.rename(root / step_name(step), aside)   # atomic: a crash leaves a leftover, never half a checkpoint
        shutil.rmtree(aside, ignore_errors=True)
    return doomed


def leftovers(root: str | Path) -> list[Path]:
    """Return temporary entries a crashed save or prune left behind (never read as checkpoints)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(c for c in root.iterdir() if c.name.startswith(_LEFTOVER_PREFIXES) or c.name == _LATEST_TMP)


def clean_leftovers(root: str | Path) -> list[Path]:
    """Remove what :func:`leftovers` finds (call only from the one rank that owns the directory)."""
    found = leftovers(root)
    for path in found:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return found
