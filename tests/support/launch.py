"""Start the real commands as the tests do, and check what they leave: exit status, error line, processes.

Jobs start under the launcher HPCPIPE_TEST_LAUNCHER picks (support/launchers.py; default the mpiexec
beside this Python), from the repository root unless a test says otherwise.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from support import ROOT, launchers
from support.configs import sets


def mpiexec() -> str:
    """Path of the chosen launcher (support/launchers.py: HPCPIPE_TEST_LAUNCHER; default the venv's mpiexec)."""
    return launchers.prefix(1)[0]


def command(n: int, module: str, args: list[str]) -> list[str]:
    """Return the argv of `mpiexec -n N python -m MODULE ARGS` (or the launcher HPCPIPE_TEST_LAUNCHER names)."""
    return [*launchers.prefix(n), sys.executable, "-m", module, *args]


def run(argv: list[str], timeout: float = 180, env: dict | None = None, cwd: str | Path | None = None):
    """Run a command to completion (never longer than timeout) from cwd (default the repository root).

    env is added to this process's environment. Returns the CompletedProcess (text output).
    """
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd or ROOT,
                          check=False)


def run_command(n: int, module: str, args: list[str], timeout: float = 120, env: dict | None = None,
                cwd: str | Path | None = None):
    """Run `mpiexec -n N python -m MODULE ARGS` with unbuffered ranks (unless PYTHONUNBUFFERED is set already)."""
    env = dict(env or {})
    if "PYTHONUNBUFFERED" not in os.environ:
        env.setdefault("PYTHONUNBUFFERED", "1")
    return run(command(n, module, args), timeout=timeout, env=env, cwd=cwd)


def run_module(module: str, *args, timeout: float = 60, env: dict | None = None, cwd: str | Path | None = None):
    """Run `python -m MODULE ARGS` in one process (no launcher); the arguments may be paths."""
    return run([sys.executable, "-m", module, *map(str, args)], timeout=timeout, env=env, cwd=cwd)


def train(n: int, sections: dict, *more: str, timeout: float = 120, env: dict | None = None,
          cwd: str | Path | None = None):
    """Run `mpiexec -n N python -m hpcpipe.train` with every key of sections as a --set, then the arguments more."""
    return run_command(n, "hpcpipe.train", sets(**sections) + list(more), timeout=timeout, env=env, cwd=cwd)


def one_error(proc, *words: str, code: int = 2, prefix: str = "hpcpipe: error: ", alone: bool = False,
              quiet: bool = False) -> str:
    """Assert a refusal: exit status code, one error line, no traceback; return that line.

    Exactly one line of stderr starts with prefix (and the prefix appears nowhere else); each of words is
    in it. alone: that line is all of stderr (nothing else printed there); quiet: nothing on stdout.
    """
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines() if alone else \
        [line for line in proc.stderr.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1 and lines[0].startswith(prefix), proc.stderr
    assert proc.stderr.count(prefix.rstrip()) == 1, proc.stderr
    for word in words:
        assert word in lines[0], (word, proc.stderr)
    if quiet:
        assert proc.stdout == "", proc.stdout
    return lines[0]


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
    deadline = time.time() + seconds
    left = processes_mentioning(text)
    while left and time.time() < deadline:
        time.sleep(0.1)
        left = processes_mentioning(text)
    return left
