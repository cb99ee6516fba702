"""The profile cache: files keyed by model, dtype, backend, host and BLAS threads, and the profiling subprocess.

A layer profile lives in ``<cache dir>/layers-<hash>.json`` where the hash is
of its key (the model's keys, dtype, loss and optimizer; the backend; the
host name; the BLAS threads per rank). The communication probe is per host
and launcher: ``comm-<host>.json``. Files are written whole to a temporary
name and renamed, so an interrupted plan never leaves a half profile; a cache
file that cannot be read, or whose key differs, is measured again.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from hpcpipe.config import Config
from hpcpipe.errors import ConfigError
from hpcpipe.plan.profile_check import profile_problem

# 6: the token loss computed in the logits' buffer (a cheaper head); 5: measured with freed memory kept
# (runtime.host_memory); 4: a ZB-H1 calibration run
PROFILE_VERSION = 6


def _backend_name(choice: str) -> str:
    from hpcpipe.runtime.backend import select_backend

    return select_backend(choice).name


def layer_key(config: Config, threads: int) -> dict[str, Any]:
    """The key of a layer profile: what changes the measured costs."""
    model = {k: v for k, v in config.to_dict()["model"].items() if k not in ("init", "seed")}
    if config.model.kind == "mlp":     # the last layer's forward includes the loss (a GPT's is always token CE)
        model["loss"] = config.train.loss
    return {"version": PROFILE_VERSION, "model": model, "backend": _backend_name(config.run.backend),
            "host": socket.gethostname(), "threads": threads}


def _name(key: dict[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return f"layers-{digest}.json"


def _read_json(path: Path) -> dict | None:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def _unusable(path: Path) -> str:
    """Why an existing profile file gives no JSON object, as the end of a sentence naming it."""
    if path.is_dir():
        return "is a directory, not a profile file"
    try:
        text = path.read_bytes()
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
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=target)
        ordinary_mode(fd)     # a shared profile directory stays readable to the group, as with any new file
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, target / name)
    except OSError as exc:
        raise ConfigError(f"cannot write the profile cache in {directory!r}: {exc.strerror or exc} "
                          f"(set HPCPIPE_PROFILE_DIR or --profile-dir to a writable directory)") from None
    return target / name


def inspect(directory: str, key: dict[str, Any]) -> tuple[dict | None, str | None]:
    """Return (the cached layer profile for key or None, what is wrong with the file when it exists but is unusable)."""
    path = Path(directory) / _name(key)
    data = _read_json(path)
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
    return _read_json(Path(directory) / _comm_name())


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
    return merged


def thread_env(threads: int) -> dict[str, str]:
    """The environment of a process computing with ``threads`` BLAS threads (as a rank of the planned job)."""
    env = dict(os.environ)
    env.pop("HPCPIPE_AUTO_THREADS", None)      # these counts are chosen, not inherited
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS", "HPCPIPE_THREADS"):
        env[name] = str(threads)
    return env


def _average(results: list[dict]) -> dict:
    """One layer profile from the copies that ran side by side: mean times, largest bytes."""
    out = json.loads(json.dumps(results[0]))
    for key, entry in out["groups"].items():
        for field, values in entry.items():
            if not isinstance(values, dict):
                continue
            for rows in values:
                column = [r["groups"][key][field][rows] for r in results]
                values[rows] = max(column) if field.endswith("bytes") else sum(column) / len(column)
    return out


def run_layer_profile(config: Config, sizes: list[int], threads: int, concurrent: int = 1,
                      timeout_s: float = 600.0) -> dict:
    """Measure the layer groups in ``concurrent`` subprocesses side by side, each with the planned BLAS threads.

    The planned job runs that many ranks at once on a node like this one: they share
    its memory bandwidth and caches, so each is measured while its siblings compute
    the model, as a rank of the real run is.
    """
    with tempfile.TemporaryDirectory(prefix="hpcpipe-profile-") as tmp:
        request = os.path.join(tmp, "request.json")
        with open(request, "w") as f:
            json.dump({"config": config.to_dict(), "sizes": sizes}, f)
        outs = [os.path.join(tmp, f"profile-{k}.json") for k in range(concurrent)]
        # copy k starts its passes k / concurrent of the way through the sizes
        cmds = [[sys.executable, "-m", "hpcpipe.plan.layer_profile", request, out, str(k * len(sizes) // concurrent)]
                for k, out in enumerate(outs)]
        procs = [subprocess.Popen(cmd, env=thread_env(threads), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  text=True) for cmd in cmds]
        failures = []
        try:
            for proc in procs:
                _, err = proc.communicate(timeout=timeout_s)
                if proc.returncode != 0:
                    failures.append((proc.returncode, err))
        except subprocess.TimeoutExpired:
            raise ConfigError(f"profiling the layers took more than {timeout_s:.0f} s ({' '.join(cmds[0])})") from None
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        if failures:
            code, err = failures[0]
            tail = "\n".join(err.strip().splitlines()[-5:])
            raise ConfigError(f"profiling the layers failed (exit {code}): {tail}")
        results = [_read_json(Path(out)) for out in outs]
    if any(r is None for r in results):
        raise ConfigError("profiling the layers wrote no result")
    data = _average(results)
    data["concurrent"] = concurrent
    return data
