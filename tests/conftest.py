"""Shared fixtures. MPI tests run under ``mpiexec -n 8 python -m pytest --with-mpi -m mpi``.

Under MPI, an exception in a test on one rank while the others wait in a
collective would hang the job, so any failure of an mpi-marked test prints
its traceback with the rank and aborts the whole run (fail fast, never
hang). Ranks other than 0 write their pytest output to a log file instead of
the terminal, so the run shows one report.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import traceback

import pytest


def _under_mpi(config) -> bool:
    return bool(getattr(config.option, "with_mpi", False))


def _world_rank() -> int:
    from mpi4py import MPI
    return MPI.COMM_WORLD.Get_rank()


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    # A suite started in the background of a script without job control inherits SIGINT ignored, and so would
    # the commands its tests start: the Ctrl-C tests (in process and of real commands) need Python's own handler.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if _under_mpi(config) and _world_rank() > 0:
        path = os.path.join(tempfile.gettempdir(), f"hpcpipe-pytest-rank{_world_rank()}.log")
        sys.stdout = open(path, "w", buffering=1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    outcome = yield
    if item.get_closest_marker("mpi") and _under_mpi(item.config) and outcome.excinfo is not None:
        from mpi4py import MPI
        exc_type, exc, tb = outcome.excinfo
        if exc_type is pytest.skip.Exception:
            return
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        sys.__stderr__.write(f"\n[world rank {MPI.COMM_WORLD.Get_rank()}] {item.nodeid} FAILED:\n{text}\n")
        sys.__stderr__.flush()
        MPI.COMM_WORLD.Abort(3)


@pytest.fixture
def world():
    """MPI.COMM_WORLD (as an argument, never a global in library code)."""
    from mpi4py import MPI
    return MPI.COMM_WORLD


@pytest.fixture
def shared_tmp(world, tmp_path):
    """A temporary directory that every rank sees (rank 0's tmp_path, broadcast)."""
    return world.bcast(str(tmp_path) if world.Get_rank() == 0 else None, root=0)
