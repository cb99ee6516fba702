"""Checkpoints and files in the state tests: a run's losses and state, bit-exact comparison, damage, small disks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import h5py
import numpy as np
import pytest

from support.launch import run_module


def checkpoint_cli(*args, cwd: str | Path | None = None):
    """Run `python -m hpcpipe.checkpoint ARGS` (verify, info, export) in one process; return the CompletedProcess."""
    return run_module("hpcpipe.checkpoint", *args, timeout=60, cwd=cwd)


def file_tree(path: Path) -> dict[str, bytes]:
    """Every file under path (relative name -> bytes): compare before and after to prove nothing was touched."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


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

