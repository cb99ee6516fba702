"""The profile cache: files keyed by model, dtype, backend, host and BLAS threads, read and written whole.

A layer profile lives in ``<cache dir>/layers-<hash>.json`` where the hash is
of its key (the model's keys, dtype, loss and optimizer; the backend; the
host name; the BLAS threads per rank). The communication probe is per host
and launcher: ``comm-<host>.json``. Files are written whole to a temporary
name and renamed, so an interrupted plan never leaves a half profile; a cache
file that cannot be read, or whose key differs, is measured again (by
:mod:`hpcpipe.plan.profiling`, which also runs the layer bench).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import socket
import stat
from pathlib import Path
from typing import Any

from hpcpipe.config import Config
from hpcpipe.errors import ConfigError
from hpcpipe.profiles.check import profile_problem
from hpcpipe.state.outputs import file_kind, write_atomic

# 6: the token loss computed in the logits' buffer (a cheaper head); 5: measured with freed memory kept
# (runtime.host_memory); 4: a ZB-H1 calibration run
PROFILE_VERSION = 6


def _backend_name(choice: str) -> str:
    from hpcpipe.runtime.backend import select_backend

    return select_backend(choice).name


def layer_key(config: Config, threads: int) -> dict[str, Any]:
    """The key of a layer profile: what changes the measured costs."""
    model = {k: v for k, v in config.to_dict()["model"].items() if k not in ("init", "seed", "adapter")}
    tr = config.train
    if tr.lora_rank:    # adapters change a block's products and drop the base's weight gradients
        model["lora"] = [tr.lora_rank, tr.lora_alpha, sorted(tr.lora_targets)]
    if config.model.kind == "mlp":     # the last layer's forward includes the loss (a GPT's is always token CE)
        model["loss"] = config.train.loss
    # TF32 changes the measured costs; the key of a full-float32 profile stays what it always was
    return {"version": PROFILE_VERSION, "model": model, "backend": _backend_name(config.run.backend),
            "host": socket.gethostname(), "threads": threads, **({"tf32": True} if config.run.tf32 else {})}


def _name(key: dict[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return f"layers-{digest}.json"


def _read_regular(path: Path) -> bytes:
    """The bytes of the regular file at path; OSError for anything else, unopened for reading: every rank reads
    the profile in its setup, before any watchdog, and opening a named pipe there blocked them all for good."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):    # before fdopen, which refuses a directory with its own error
        os.close(fd)
        raise OSError(errno.EINVAL, f"it is {file_kind(path)}, not a profile file")
    with os.fdopen(fd, "rb") as f:
        return f.read()


def read_json(path: Path) -> dict | None:
    """The JSON object in the regular file at path, None when it is missing, not a regular file or not an object."""
    try:
        data = json.loads(_read_regular(path))
        return data if isinstance(data, dict) else None
    except (OSError, ValueError, RecursionError):
        return None


def _unusable(path: Path) -> str:
    """Why an existing profile file gives no JSON object, as the end of a sentence naming it."""
    if path.is_dir():
        return "is a directory, not a profile file"
    try:
        text = _read_regular(path)
    except OSError as exc:
        return f"cannot be read: {exc.strerror or exc}"
    if not text.strip():
        return "is empty"
    try:
        json.loads(text)
    except ValueError as exc:
        return f"is not valid JSON (truncated or damaged: {exc})"
    return "is JSON but not an object"


def ordinary_mode(fd: int) -> None:
    """Give a file from mkstemp (mode 0600) the mode any new file gets under the user's umask."""
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)


def _write_json(directory: str, name: str, data: dict) -> Path:
    """Write data to directory/name atomically (temporary file in the same directory, then rename)."""
    target = Path(directory)
    try:
        target.mkdir(parents=True, exist_ok=True)
        write_atomic(target / name, json.dumps(data))
    except OSError as exc:
        raise ConfigError(f"cannot write the profile cache in {directory!r}: {exc.strerror or exc} "
                          f"(set HPCPIPE_PROFILE_DIR or --profile-dir to a writable directory)") from None
    return target / name


def inspect(directory: str, key: dict[str, Any]) -> tuple[dict | None, str | None]:
    """Return (the cached layer profile for key or None, what is wrong with the file when it exists but is unusable)."""
    path = Path(directory) / _name(key)
    data = read_json(path)
    if data is None:
        return None, (f"{str(path)!r} {_unusable(path)}" if path.exists() or path.is_symlink() else None)
    if data.get("key") != key:
        return None, f"{str(path)!r} is the profile of another model or host (its key differs)"
    problem = profile_problem(data)
    if problem:
        return None, f"{str(path)!r} is damaged: {problem}"
    return data, None


def read(directory: str, key: dict[str, Any]) -> dict | None:
    """Return the cached layer profile for key, or None (missing, unreadable, damaged, or another key)."""
    return inspect(directory, key)[0]


def write(directory: str, key: dict[str, Any], data: dict) -> Path:
    """Store a layer profile under its key; return the file's path."""
    return _write_json(directory, _name(key), data)


def _comm_name() -> str:
    host = "".join(c if c.isalnum() or c in "-_." else "_" for c in socket.gethostname())
    launcher = os.environ.get("HPCPIPE_MPIEXEC", "")
    suffix = "-" + hashlib.sha256(launcher.encode()).hexdigest()[:8] if launcher else ""
    return f"comm-{host}{suffix}.json"


def read_comm(directory: str) -> dict | None:
    """Return this host's cached communication model (as a dict), or None."""
    return read_json(Path(directory) / _comm_name())


def write_comm(directory: str, data: dict) -> Path:
    """Store this host's communication model."""
    return _write_json(directory, _comm_name(), data)


def merge_layers(old: dict, new: dict) -> dict:
    """Add newly measured micro-batch sizes to a cached layer profile (same model, same groups)."""
    merged = json.loads(json.dumps(old))
    for key, entry in new["groups"].items():
        target = merged["groups"].setdefault(key, entry)
        if target is entry:
            continue
        for field, values in entry.items():
            if isinstance(values, dict):
                target.setdefault(field, {}).update(values)
    merged["optimizer"] = {**old.get("optimizer", {}), **new["optimizer"]}
    merged["blas_rss_bytes"] = max(old.get("blas_rss_bytes", 0), new.get("blas_rss_bytes", 0))
    merged["tps"] = sorted(set(old.get("tps", [])) | set(new.get("tps", [])))
    return merged
