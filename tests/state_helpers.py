"""Helpers of the state tests: run the real commands under mpiexec, corrupt files, compare results."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import h5py
import launchers
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent


def mpiexec() -> str:
    """Return the chosen launcher (tests/launchers.py: HPCPIPE_TEST_LAUNCHER; default the venv's mpiexec)."""
    return launchers.prefix(1)[0]


def command(n: int, module: str, args: list[str]) -> list[str]:
    """Return the argv of `mpiexec -n N python -m MODULE ARGS` (or the launcher HPCPIPE_TEST_LAUNCHER names)."""
    return [*launchers.prefix(n), sys.executable, "-m", module, *args]


def run(argv: list[str], timeout: float = 180, env: dict | None = None, cwd: str | Path | None = None):
    """Run a command to completion (never longer than timeout) and return the CompletedProcess."""
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd or ROOT)


def sets(**sections) -> list[str]:
    """Turn {'train': {'steps': 4}} into ['--set', 'train.steps=4', ...] (values as TOML)."""
    out = []
    for section, values in sections.items():
        for key, value in values.items():
            out += ["--set", f"{section}.{key}={json.dumps(value)}"]
    return out


def metrics_losses(path: str | Path) -> dict[int, float]:
    """Return {step: loss} from a metrics JSON-lines file (a later record of a step wins)."""
    out = {}
    for line in Path(path).read_text().splitlines():
        record = json.loads(line)
        out[record["step"]] = record["loss"]
    return out


def checkpoint_state(path: str | Path) -> tuple[dict, dict]:
    """Return (parameters, optimizer state) of every layer of a checkpoint, by global index."""
    from hpcpipe.state.sources import resolve_weights
    source = resolve_weights(path)
    layers = list(range(source.n_layers))
    return source.read(layers), source.read_optimizer(layers)[1]


def assert_nested_equal(a, b) -> None:
    """Assert two nested dicts of arrays are bit-for-bit equal."""
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], dict):
            assert_nested_equal(a[key], b[key])
        else:
            assert a[key].dtype == b[key].dtype and np.array_equal(a[key], b[key]), key


def flip_byte_in_dataset(path: str | Path, dataset: str, at: int = 5) -> None:
    """Flip one bit inside a (chunked) dataset's stored data, leaving HDF5 metadata intact."""
    with h5py.File(path, "r") as f:
        offset = f[dataset].id.get_chunk_info(0).byte_offset
    with open(path, "r+b") as f:
        f.seek(offset + at)
        byte = f.read(1)
        f.seek(offset + at)
        f.write(bytes([byte[0] ^ 0x10]))


def pids_alive(pid_dir: str | Path) -> list[int]:
    """Return the pids listed in pid_dir/rank-*.pid that still exist (and are not zombies)."""
    alive = []
    for f in Path(pid_dir).glob("rank-*.pid"):
        pid = int(f.read_text())
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.append(pid)
    return alive


def processes_mentioning(text: str) -> list[str]:
    """Return 'pid: command line' of every live process whose command line or environment mentions text.

    Tests put a unique temporary path into each run's arguments or environment, so a
    process still matching after the run ended was left behind by it.
    """
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes()
            status = (entry / "status").read_text()
        except OSError:
            continue
        if "\nState:\tZ" in status:        # a zombie holds no resources; its parent will reap it
            continue
        if text.encode() in cmdline or text.encode() in environ:
            shown = cmdline.replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{entry.name}: {shown}")
    return found


def wait_until_gone(text: str, seconds: float) -> list[str]:
    """Wait up to `seconds` for processes_mentioning(text) to be empty; return what is left."""
    import time
    deadline = time.time() + seconds
    left = processes_mentioning(text)
    while left and time.time() < deadline:
        time.sleep(0.1)
        left = processes_mentioning(text)
    return left


@contextmanager
def small_tmpfs(mnt: Path, size: str) -> Iterator[Path]:
    """Mount a tmpfs of `size` (e.g. "200k") at the new directory mnt; unmount it afterwards (root only, else skip)."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a small tmpfs needs root")
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], check=False).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)

