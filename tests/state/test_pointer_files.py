"""A named pipe or a device where hpcpipe keeps a small file of its own (a `latest` pointer, a manifest, a run's
`.lock`) is refused in one line naming it, never opened for a blocking read.

Opening a named pipe for reading blocks until a writer comes: every rank of a resumed job (and `python -m
hpcpipe.checkpoint`) waited there for good, before any watchdog runs, and SIGTERM could not end it (the stop
handlers only set a flag and the open is restarted). A link to /dev/zero fed the reader forever.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support import ROOT
from support.configs import merged, sets
from support.launch import command, one_error, train

TINY = {"model": {"dims": [8, 8, 8, 8]}, "parallel": {"dp": 1, "pp": 2},
        "data": {"synthetic_samples": 32}, "log": {"progress": False},
        "train": {"steps": 2, "micro_batches": 2, "micro_batch_size": 2},
        "checkpoint": {"every": 1, "keep": 2}}
LIMIT_S = 120     # each command below ends in about a second; before the fix they never ended


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A root of runs holding run-0001 with steps 1 and 2."""
    root = tmp_path_factory.mktemp("pointers") / "ck"
    result = train(2, merged(TINY, {"checkpoint": {"dir": str(root)}}))
    assert result.returncode == 0, result.stderr
    return root


def _copy(saved: Path, tmp_path: Path) -> Path:
    root = tmp_path / "ck"
    shutil.copytree(saved, root, symlinks=True)
    return root


def _replace(path: Path, what: str) -> None:
    path.unlink()
    if what == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")


def _bounded(argv: list[str]) -> subprocess.CompletedProcess:
    """Run argv in its own session; past LIMIT_S kill the whole session (ranks blocked in open() ignore SIGTERM)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"{' '.join(argv[-6:])} still ran after {LIMIT_S} s (blocked opening a named pipe?)")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _checkpoint(*args) -> subprocess.CompletedProcess:
    return _bounded([sys.executable, "-m", "hpcpipe.checkpoint", *map(str, args)])


def _resume(root: Path) -> subprocess.CompletedProcess:
    return _bounded(command(2, "hpcpipe.train", sets(**merged(TINY, {"checkpoint": {"dir": str(root)}},
                                                               {"train": {"steps": 3}})) + ["--resume"]))


# A link to /dev/zero is refused by the same check (not a regular file); it is not tried here: a reader that
# opened it would fill this machine's memory before its bound, not fail.
@pytest.mark.parametrize("what, kind", [("fifo", "a named pipe")])
def test_a_root_latest_that_is_a_pipe_or_a_device_is_refused(saved, tmp_path, what, kind):
    root = _copy(saved, tmp_path)
    _replace(root / "latest", what)
    result = _checkpoint("verify", root)
    assert result.returncode == 1, (result.returncode, result.stderr)
    assert f"checkpoint pointer '{root / 'latest'}' is {kind}, not a regular file" in result.stderr
    assert "Traceback" not in result.stderr
    one_error(_resume(root), "latest", code=2)


@pytest.mark.parametrize("what", ["fifo"])
def test_a_run_latest_or_manifest_that_is_a_pipe_is_never_read(saved, tmp_path, what):
    """The run's own pointer and an older step's manifest are read while the root's pointer is checked for lag."""
    root = _copy(saved, tmp_path)
    _replace(root / "run-0001" / "latest", what)
    _replace(root / "run-0001" / "step-00000001" / "manifest.json", what)
    result = _checkpoint("info", root)                # reads both, to see whether the root's pointer lags
    assert result.returncode in (0, 1) and "Traceback" not in result.stderr, result.stderr
    resumed = _resume(root)
    assert resumed.returncode in (0, 2), resumed.stderr
    assert "Traceback" not in resumed.stderr, resumed.stderr


def test_a_lock_file_that_is_a_named_pipe_is_refused_in_one_line(saved, tmp_path):
    root = _copy(saved, tmp_path)
    os.mkfifo(root / "run-0001" / ".lock")
    line = one_error(_resume(root), "lock file", "is a named pipe, not a regular file", code=2)
    assert str(root / "run-0001" / ".lock") in line
    assert (root / "run-0001" / "step-00000002" / "manifest.json").is_file()   # nothing of the run touched


def test_a_bounded_read_takes_only_what_the_file_holds(tmp_path):
    """read_regular's bound (16 GiB for a trace) is a bound, not a buffer: reading it up front raised MemoryError
    under ulimit -v or on a node with less memory; a file at the bound is read whole, one byte over is refused."""
    import tracemalloc

    from hpcpipe.errors import ConfigError
    from hpcpipe.state.directory_protocol import read_regular
    small = tmp_path / "small.json"
    small.write_bytes(b"{}")
    tracemalloc.start()
    try:
        data = read_regular(small, 1 << 30, "trace")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert data == b"{}" and peak < 8 << 20, peak      # the old read took the whole GiB before reading a byte
    big = tmp_path / "big"
    big.write_bytes(b"x" * (3 << 20))
    assert read_regular(big, 3 << 20, "trace") == b"x" * (3 << 20)
    with pytest.raises(ConfigError, match="holds more than"):
        read_regular(big, (3 << 20) - 1, "trace")
