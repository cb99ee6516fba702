"""The on-disk protocol of a checkpoint directory: names, manifest, atomic commit, ``latest``, retention.

No MPI here: :mod:`hpcpipe.checkpoint_mpi` decides who calls what. Layout::

    DIR/latest                      text file naming the newest committed checkpoint ("step-00000006")
    DIR/step-00000006/manifest.json layout, step, config, SHA-256 and size of every file
    DIR/step-00000006/stage-000.h5  one file per pipeline rank, layers by global index
    DIR/.tmp-step-00000008/         a save in progress (or left by a crash: ignored, then cleaned)
    DIR/.del-step-00000002/         a checkpoint being deleted by retention (ignored, then cleaned)

A save writes into ``.tmp-step-N``, fsyncs every file, writes and fsyncs
the manifest, fsyncs the directory, renames it to ``step-N`` and fsyncs
``DIR``; only then is ``latest`` replaced (write ``.latest.tmp``, fsync,
rename). A crash at any point leaves ``latest`` naming a complete checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

from .errors import ConfigError

MANIFEST = "manifest.json"
LATEST = "latest"
MANIFEST_FORMAT = "hpcpipe-checkpoint"
MANIFEST_VERSION = 1
_STEP_RE = re.compile(r"^step-(\d{8})$")
_LEFTOVER_PREFIXES = (".tmp-step-", ".del-step-")
_LATEST_TMP = ".latest.tmp"


def step_name(step: int) -> str:
    """Return the directory name of the checkpoint taken after `step` completed steps."""
    return f"step-{step:08d}"


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
                   optimizer: dict[str, Any], data: dict[str, Any], files: list[dict[str, Any]]) -> dict[str, Any]:
    """Return the manifest of a checkpoint (plain JSON data)."""
    return {"format": MANIFEST_FORMAT, "format_version": MANIFEST_VERSION, "step": step, "n_layers": n_layers,
            "layout": layout, "optimizer": optimizer, "data": data, "config": config,
            "files": sorted(files, key=lambda e: e["name"]), "created_unix": time.time()}


def write_json_durably(path: Path, obj: Any) -> None:
    """Write JSON text to path and fsync it."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def read_manifest(step_dir: str | Path) -> dict[str, Any]:
    """Read and validate a checkpoint's manifest; ConfigError naming the file on any problem."""
    path = Path(step_dir) / MANIFEST
    if not path.is_file():
        raise ConfigError(f"checkpoint {str(step_dir)!r} has no {MANIFEST} (incomplete or not a checkpoint)")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"manifest {str(path)!r} is not valid JSON: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise ConfigError(f"manifest {str(path)!r} is not an hpcpipe checkpoint manifest")
    if manifest.get("format_version") != MANIFEST_VERSION:
        raise ConfigError(f"manifest {str(path)!r} has format_version {manifest.get('format_version')!r}; "
                          f"this hpcpipe reads {MANIFEST_VERSION}")
    try:
        n_layers = int(manifest["n_layers"])
        int(manifest["step"])
        files = manifest["files"]
        seen: list[int] = []
        for entry in files:
            if not (isinstance(entry["name"], str) and "/" not in entry["name"] and entry["name"] not in (".", "..")):
                raise ValueError(f"bad file name {entry['name']!r}")
            seen.extend(int(i) for i in entry["layers"])
            str(entry["sha256"])
            int(entry["bytes"])
        manifest["config"]["model"]
        manifest["optimizer"]["name"]
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"manifest {str(path)!r} is malformed: {type(exc).__name__}: {exc}") from None
    if sorted(seen) != list(range(n_layers)):
        raise ConfigError(f"manifest {str(path)!r} maps layers {sorted(seen)} to files; expected each of "
                          f"0..{n_layers - 1} exactly once")
    return manifest


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


def read_latest(root: str | Path) -> str | None:
    """Return the checkpoint name `latest` points to, or None when there is no pointer."""
    path = Path(root) / LATEST
    if not path.exists():
        return None
    try:
        name = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"checkpoint pointer {str(path)!r} is unreadable: {exc}") from None
    if not _STEP_RE.match(name):
        raise ConfigError(f"checkpoint pointer {str(path)!r} holds {name[:40]!r}, not a step-NNNNNNNN name")
    return name


def set_latest(root: str | Path, name: str) -> None:
    """Atomically point `latest` at a committed checkpoint (temporary file, fsync, rename, fsync dir)."""
    root = Path(root)
    tmp = root / _LATEST_TMP
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    fsync_path(root)


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
