"""How the end-to-end tests start a job: HPCPIPE_TEST_LAUNCHER picks the launcher.

    (unset) or mpich   the mpiexec beside this Python (the mpich wheel), else the one on PATH
    openmpi            Open MPI's mpirun (mpirun.openmpi, or an mpirun/mpiexec that says "Open MPI"),
                       with mpi4py told to load Open MPI's libmpi (MPI4PY_LIBMPI = its libdir)

CI runs the launcher-dependent end-to-end tests once more with HPCPIPE_TEST_LAUNCHER=openmpi.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys

ENV = "HPCPIPE_TEST_LAUNCHER"


def _skip(reason: str):
    import pytest
    pytest.skip(reason)


def chosen() -> str:
    """Return the launcher the tests use: 'mpich' (default) or 'openmpi'."""
    name = os.environ.get(ENV, "") or "mpich"
    if name not in ("mpich", "openmpi"):
        raise ValueError(f"{ENV} must be mpich or openmpi, got {name!r}")
    return name


def mpich_mpiexec() -> str:
    """Return $HPCPIPE_GPU_MPIEXEC (bench/gpu/check.sh: its carried MPICH's), else the mpiexec beside this
    interpreter (the venv's mpich wheel), else the one on PATH."""
    chosen = os.environ.get("HPCPIPE_GPU_MPIEXEC", "").strip()
    if chosen:
        return chosen
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    found = beside if os.path.exists(beside) else shutil.which("mpiexec")
    if not found:
        _skip("no mpiexec found (pip install 'hpcpipe[mpich]' or load your MPI module)")
    return found


@functools.lru_cache(maxsize=1)
def _open_mpi() -> tuple[str, str]:
    """Return (Open MPI's mpirun, its libdir), or ('', reason) when Open MPI is not installed."""
    for name in ("mpirun.openmpi", "orterun", "mpirun", "mpiexec"):
        path = shutil.which(name, path=f"/usr/bin{os.pathsep}{os.environ.get('PATH', '')}")
        if not path:
            continue
        try:
            version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30,
                                     check=False).stdout
        except (OSError, subprocess.TimeoutExpired):
            continue
        if "Open MPI" in version or "OpenRTE" in version:
            info = shutil.which("ompi_info", path=f"{os.path.dirname(path)}{os.pathsep}/usr/bin")
            libdir = ""
            if info:
                out = subprocess.run([info, "--path", "libdir", "--parsable"], capture_output=True, text=True,
                                     check=False, timeout=30).stdout
                libdir = out.strip().rpartition(":")[2]
            return path, libdir
    return "", "Open MPI's mpirun is not installed (apt-get install openmpi-bin libopenmpi-dev)"


def openmpi_mpirun() -> tuple[str, str]:
    """Return (Open MPI's mpirun, the libdir holding its libmpi); skip the test when it is not installed."""
    mpirun, libdir = _open_mpi()
    if not mpirun:
        _skip(libdir)
    return mpirun, libdir


def openmpi_env() -> dict[str, str]:
    """Environment that lets Open MPI's mpirun run here (as root, 8 ranks on fewer cores) with mpi4py on its libmpi."""
    _, libdir = openmpi_mpirun()
    env = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1"}
    if libdir:
        env["MPI4PY_LIBMPI"] = libdir
    return env


def prefix(n: int) -> list[str]:
    """Return the argv that starts n ranks with the chosen launcher (program and its arguments follow)."""
    if chosen() == "mpich":
        return [mpich_mpiexec(), "-n", str(n)]
    mpirun, _ = openmpi_mpirun()
    argv = [mpirun, "-n", str(n), "--oversubscribe"]
    if os.geteuid() == 0:
        argv.append("--allow-run-as-root")
    for key, value in openmpi_env().items():
        if key.startswith("MPI4PY"):
            argv += ["-x", f"{key}={value}"]
    return argv
