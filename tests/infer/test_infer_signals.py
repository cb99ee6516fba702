"""End-to-end: the real `mpiexec -n 2 python -m hpcpipe.infer` stopped mid-stream by SIGTERM, SIGUSR1 or SIGINT.

The run is big enough (120 000 rows through 1024-wide layers, about 5 s on one
core per rank) to be signalled while it streams. Whatever stops it, nothing is
committed, no temporary file stays behind, and an earlier output at the path
(a real one, from a first run) keeps every byte.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from support import ROOT, launchers
from support.launch import command, run, wait_until_gone

from hpcpipe import errors
from hpcpipe.state.weights import write_weights

pytestmark = pytest.mark.slow

DIMS = [64, 1024, 1024, 1024, 64]
ROWS = 120_000


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(weights, big input, small input): a float32 MLP whose stream takes seconds over the big input."""
    tmp = tmp_path_factory.mktemp("infer-signals")
    rng = np.random.default_rng(0)
    weights = tmp / "w.h5"
    layers = {i: {"weight": (rng.standard_normal((DIMS[i], DIMS[i + 1])) / np.sqrt(DIMS[i])).astype(np.float32)}
              for i in range(len(DIMS) - 1)}
    write_weights(weights, layers, n_layers=len(DIMS) - 1,
                  model_config={"dims": DIMS, "bias": False, "activation": "relu", "final_activation": False,
                                "dtype": "float32"})
    big, small = tmp / "big.h5", tmp / "small.h5"
    with h5py.File(big, "w") as f:
        f["x"] = rng.standard_normal((ROWS, DIMS[0])).astype(np.float32)
    with h5py.File(small, "w") as f:
        f["x"] = rng.standard_normal((8, DIMS[0])).astype(np.float32)
    return weights, big, small


def _args(weights: Path, data: Path, out: Path) -> list[str]:
    return ["--weights", str(weights), "--input", str(data), "--output", str(out), "--set", "parallel.pp=2"]


def _earlier_output(weights: Path, small: Path, directory: Path) -> tuple[Path, bytes]:
    """A real earlier inference output at directory/out.h5 and its bytes (what a stopped run must leave as it was)."""
    out = directory / "out.h5"
    first = run(command(2, "hpcpipe.infer", _args(weights, small, out)), timeout=60)
    assert first.returncode == 0, first.stderr
    return out, out.read_bytes()


def _temporaries(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir() if ".tmp-" in p.name]


def _wait_for_the_stream(proc: subprocess.Popen, directory: Path, settle: float = 0.5) -> None:
    """Return once the run streams: its temporary output exists (created just before the first micro-batch)."""
    deadline = time.time() + 60
    while not _temporaries(directory):
        assert proc.poll() is None and time.time() < deadline, f"no temporary output (exit status {proc.poll()})"
        time.sleep(0.005)
    time.sleep(settle)    # 0.5 s: past the start barrier, mid-stream; 0: the ranks are still building their stages
    assert proc.poll() is None, "the run ended before it could be signalled: make the input bigger"


def _rank_pid(directory: Path, rank: int) -> int:
    """The process id of world rank `rank` of the run writing into directory (found by its environment)."""
    marks = [f"{name}={rank}".encode() for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK")]
    for entry in Path("/proc").iterdir():
        try:
            cmdline, environ = (entry / "cmdline").read_bytes(), (entry / "environ").read_bytes()
        except OSError:
            continue
        if b"hpcpipe.infer" in cmdline and str(directory).encode() in cmdline and \
                any(mark in environ.split(b"\0") for mark in marks):
            return int(entry.name)
    raise AssertionError(f"no process of world rank {rank} found")


@pytest.mark.parametrize("how", ["TERM to mpiexec", "USR1 to mpiexec", "TERM to rank 1", "INT to mpiexec",
                                 "INT to rank 1 at once"])
def test_a_signal_mid_stream_stops_every_rank_writes_nothing_and_keeps_the_earlier_output(files, tmp_path, how):
    weights, big, small = files
    out, before = _earlier_output(weights, small, tmp_path)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    proc = subprocess.Popen(command(2, "hpcpipe.infer", _args(weights, big, out)), env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # "at once": as soon as rank 0 has created the temporary output, before the stream starts (it was left
        # behind: the interrupted rank's abort killed rank 0 before rank 0 could remove it)
        _wait_for_the_stream(proc, tmp_path, 0.0 if how.endswith("at once") else 0.5)
        sig = {"TERM": signal.SIGTERM, "USR1": signal.SIGUSR1, "INT": signal.SIGINT}[how.split()[0]]
        t0 = time.time()
        if how.endswith("mpiexec"):
            proc.send_signal(sig)
        else:
            os.kill(_rank_pid(tmp_path, 1), sig)     # as a batch system that signals the tasks, or one node's
        _, err = proc.communicate(timeout=30)
        took = time.time() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    openmpi = launchers.chosen() == "openmpi" and how.endswith("mpiexec")
    if how.startswith("INT") and not openmpi:
        assert proc.returncode == errors.EXIT_INTERRUPTED, err      # was 1
        if how == "INT to mpiexec":
            assert "interrupted (SIGINT) while streaming: nothing written at" in err, err
    else:
        # Open MPI's mpirun reports 1 although the ranks exited 75, and turns Ctrl-C into SIGTERM to the ranks
        assert proc.returncode == errors.EXIT_PREEMPTED or (openmpi and proc.returncode == 1), err   # was 15
        name = "SIGTERM" if openmpi and how.startswith("INT") else f"SIG{how.split()[0]}"
        ranks = "1 of 2" if how.endswith("rank 1") else "2 of 2"
        assert err.count("hpcpipe: stopped by") == 1, err
        assert f"stopped by {name} (received on {ranks} ranks) before the last row: nothing written at " \
               f"{str(out)!r}; the earlier file there is unchanged" in err, err
        assert "hpcpipe: error" not in err and "Traceback" not in err, err
    assert took < 15
    assert out.read_bytes() == before
    assert _temporaries(tmp_path) == []        # was: the full-size OUT.tmp-XXXXXXXX left behind
    assert wait_until_gone(str(tmp_path), 10) == []


def _catches(pid: int, sig: int) -> bool:
    """True once the process has a handler for sig (SIGINT: Python's, then hpcpipe's; SIGTERM: hpcpipe's)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) & (1 << (sig - 1)))
    return False


def _catches_sigint(pid: int) -> bool:
    """True once the process has a handler for SIGINT: it runs Python code.

    A rank killed before that (at exec) leaves MPICH's other ranks spinning in MPI_Init for ever: the
    launcher's behaviour, which no Python program can change.
    """
    return _catches(pid, signal.SIGINT)


def test_a_stop_while_starting_creates_no_output_at_all(files, tmp_path):
    # SIGTERM once both ranks have hpcpipe's handler, i.e. while they import, plan or load: the run used to
    # load every weight and create and preallocate the full-size temporary output before it stopped
    weights, big, small = files
    out, before = _earlier_output(weights, small, tmp_path)
    proc = subprocess.Popen(command(2, "hpcpipe.infer", _args(weights, big, out)), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: set[str] = set()
    try:
        deadline = time.time() + 30
        while True:
            try:
                pids = [_rank_pid(tmp_path, r) for r in (0, 1)]
                if all(_catches(pid, signal.SIGTERM) for pid in pids):
                    break
            except (AssertionError, OSError):
                pass
            assert proc.poll() is None and time.time() < deadline, "the ranks never started"
            time.sleep(0.002)
        for pid in pids:   # to the ranks themselves, as Slurm signals every task (launchers forward with a delay)
            os.kill(pid, signal.SIGTERM)
        while proc.poll() is None and time.time() < deadline:
            seen.update(_temporaries(tmp_path))
            time.sleep(0.001)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert seen == set(), seen                  # was: the whole output preallocated, then removed
    if launchers.chosen() != "openmpi":
        assert proc.returncode == errors.EXIT_PREEMPTED, err
    assert "stopped by SIGTERM (received on 2 of 2 ranks) while starting, before the first row: nothing written" \
           in err, err
    assert out.read_bytes() == before and _temporaries(tmp_path) == []
    assert wait_until_gone(str(tmp_path), 10) == []


def test_ctrl_c_on_one_rank_while_it_starts_ends_the_job_without_a_hang(files, tmp_path):
    # SIGINT to rank 1 while it imports, initialises MPI or plans: the other rank waited for it in the planning
    # agreement for PLANNING_TIMEOUT_S (600 s) before; now the job ends at once and leaves nothing behind
    weights, big, small = files
    out, before = _earlier_output(weights, small, tmp_path)
    for delay in (0.3, 0.6, 0.9):
        proc = subprocess.Popen(command(2, "hpcpipe.infer", _args(weights, big, out)), cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.time() + 30
            while True:    # rank 1 runs Python (its SIGINT handler is installed), and nothing more is known
                try:
                    pid = _rank_pid(tmp_path, 1)
                    if _catches_sigint(pid):
                        break
                except (AssertionError, OSError):
                    pass
                assert proc.poll() is None and time.time() < deadline, "rank 1 never started"
                time.sleep(0.002)
            time.sleep(delay)
            os.kill(pid, signal.SIGINT)
            _, err = proc.communicate(timeout=30)      # was: a hang (the other rank waits up to 600 s)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode != 0, err
        assert "Traceback" not in err, err
        assert out.read_bytes() == before
        assert _temporaries(tmp_path) == []
        assert wait_until_gone(str(tmp_path), 10) == []
