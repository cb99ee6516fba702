"""What a run was started in: which MPI library it loaded, and whether its console is a real terminal.

Nothing here calls MPI; comm.py passes in the library's version text. Both
answers read Linux's /proc and degrade to "unknown" / "not a terminal"
elsewhere.

Open MPI's ``mpirun`` gives every rank a pseudo-terminal for stdout (its
iof forwarding), even when mpirun's own output goes to a file, so a rank's
``isatty()`` says nothing about where the text ends up. Under Open MPI the
answer is taken from the launcher instead: the nearest ancestor named
``mpirun``/``mpiexec``/``orterun``/``prterun`` must have a terminal as its
stdout. A rank whose launcher is not found (a remote node's ``orted``) is
treated as writing to a file.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any

from hpcpipe.runtime.launcher import under_open_mpi

LAUNCHER_NAMES = ("mpirun", "mpiexec", "orterun", "prterun", "mpirun.openmpi", "mpiexec.openmpi")
_LIBMPI = re.compile(r"^lib(mpi|impi|msmpi|mpich)\.so(\.\d+)*$")


def loaded_libmpi(maps_text: str) -> str:
    """Return the path of the MPI library mapped into this process (from /proc/self/maps text), or ''."""
    for line in maps_text.splitlines():
        fields = line.split(None, 5)
        if len(fields) == 6 and _LIBMPI.match(os.path.basename(fields[5].strip())):
            return fields[5].strip()
    return ""


def library_name(version_text: str) -> str:
    """Return a short name of the MPI library from MPI_Get_library_version text, e.g. 'MPICH 5.0.2'."""
    lines = version_text.strip().splitlines()
    first = lines[0].split(",")[0] if lines else "unknown MPI library"
    return re.sub(r"\s+", " ", first.replace("Version:", " ")).strip()


def mpi4py_build(module_file: str, config: dict[str, Any], version: str) -> str:
    """Say which mpi4py build is in use: the wheel's per-ABI module, or a source build and its mpicc."""
    parts = os.path.basename(module_file).split(".")
    if len(parts) > 2 and parts[1] in ("mpich", "openmpi", "mpiabi", "impi", "msmpi"):
        return f"mpi4py {version} wheel, {parts[1]} ABI"
    compiler = config.get("mpicc") or config.get("MPICC") or ""
    return f"mpi4py {version} built with {compiler}" if compiler else f"mpi4py {version} built from source"


def mpi_line(version_text: str, size: int, libmpi: str, build: str) -> str:
    """Return the one line each run prints first: library, where it was loaded from, mpi4py build, ranks."""
    where = f"libmpi at {libmpi}" if libmpi else "libmpi path unknown"
    return f"hpcpipe: MPI: {library_name(version_text)} ({where}; {build}), {size} rank{'s' if size != 1 else ''}"


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def self_libmpi() -> str:
    """Return the path of the MPI library this process loaded ('' when /proc is unavailable)."""
    return loaded_libmpi(_read("/proc/self/maps"))


def _parent(pid: int) -> tuple[int, str]:
    """Return (parent pid, command name) of a process from /proc (0, '' when unknown)."""
    stat = _read(f"/proc/{pid}/stat")
    if not stat or ")" not in stat:
        return 0, ""
    name = stat[stat.index("(") + 1:stat.rindex(")")]
    rest = stat[stat.rindex(")") + 2:].split()
    return (int(rest[1]) if len(rest) > 1 else 0), name


def is_terminal_path(target: str) -> bool:
    """True when a /proc/PID/fd link target names a terminal device."""
    return target.startswith("/dev/pts/") or re.match(r"^/dev/tty\w*$", target) is not None


def launcher_stdout_is_terminal(pid: int | None = None, depth: int = 8) -> bool:
    """True when the nearest launcher ancestor (mpirun, mpiexec, ...) of pid writes its stdout to a terminal."""
    pid = os.getppid() if pid is None else pid
    for _ in range(depth):
        if pid <= 1:
            return False
        parent, name = _parent(pid)
        if name in LAUNCHER_NAMES or name.startswith(("mpirun", "mpiexec")):
            try:
                return is_terminal_path(os.readlink(f"/proc/{pid}/fd/1"))
            except OSError:
                return False
        pid = parent
    return False


def stdout_is_terminal(stream: Any = None) -> bool:
    """True when progress lines written to stream (default stdout) reach a real terminal, so '\\r' redraws are right."""
    stream = sys.stdout if stream is None else stream
    try:
        if not stream.isatty():
            return False
    except (AttributeError, ValueError):
        return False
    return launcher_stdout_is_terminal() if under_open_mpi() else True
