"""Starting the planner's helper jobs: the MPI launcher command, a launch with a time limit, the MPI probe runs.

The planner measures what it predicts from in processes of their own: the
communication probe (``mpiexec -n 2 python -m hpcpipe.plan.probe``), a bare
rank's memory and the engine calibration's short training runs. This module
finds the launcher (``$HPCPIPE_MPIEXEC``, else ``mpiexec`` beside this Python),
starts a job in its own process group, ends it cleanly on a timeout and says
why it failed in one message (its last lines of stderr).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile

from hpcpipe.errors import ConfigError
from hpcpipe.profiles.comm_model import CommModel

LAUNCHER_ENV = "HPCPIPE_MPIEXEC"
STDERR_LINES = 12


def launcher_command(launcher: str | list[str] | None = None) -> list[str]:
    """Return the MPI launcher's words: the argument, else $HPCPIPE_MPIEXEC, else mpiexec on PATH or beside Python."""
    if launcher is None:
        launcher = os.environ.get(LAUNCHER_ENV, "").strip() or None
    if isinstance(launcher, str):
        launcher = shlex.split(launcher)
    if launcher:
        return list(launcher)
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")   # the mpich wheel's, in a venv
    found = shutil.which("mpiexec") or (beside if os.access(beside, os.X_OK) else None)
    if found is None:
        raise ConfigError(f"no MPI launcher to measure communication with: mpiexec is not on PATH; set "
                          f"{LAUNCHER_ENV} to your launcher, e.g. {LAUNCHER_ENV}=mpiexec or "
                          f"{LAUNCHER_ENV}=\"mpirun --oversubscribe\" (it is run as: LAUNCHER -n 2 python ...)")
    return [found]


def _child_env() -> dict:
    """This process's environment, with a source checkout's hpcpipe first on PYTHONPATH (ranks import the same code)."""
    env = dict(os.environ)
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if os.path.basename(package_root) not in ("site-packages", "dist-packages"):   # installed: found anyway
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _tail(text: str) -> str:
    lines = [line for line in (text or "").strip().splitlines() if line.strip()][-STDERR_LINES:]
    return "\n".join("  | " + line for line in lines) if lines else "  | (no output)"


def launch(words: list[str], args: list[str], what: str, timeout_s: float, cwd: str | None = None,
            ranks: int = 2) -> tuple:
    """Run ``words -n RANKS python -m args`` in a session of its own; return (command text, stdout, stderr).

    ConfigError, naming the command line and the end of its output, when the launcher
    cannot start, the run times out (the launcher and every rank it started are killed)
    or exits non-zero.
    """
    command = [*words, "-n", str(ranks), sys.executable, "-m", *args]
    shown = shlex.join(command)
    try:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=_child_env(), start_new_session=True, cwd=cwd)
    except OSError as exc:
        raise ConfigError(f"cannot start the MPI launcher {words[0]!r} ({exc.strerror or exc}); set "
                          f"{LAUNCHER_ENV} to a working launcher, e.g. {LAUNCHER_ENV}=mpiexec") from None
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        stdout, stderr = proc.communicate()
        raise ConfigError(f"{what} did not finish in {timeout_s:g} s: {shown}\n{_tail(stderr or stdout)}") from None
    except BaseException:      # Ctrl-C or the planner's SIGTERM: the launcher's own session would outlive us
        _kill_group(proc)
        proc.wait()
        raise
    if proc.returncode != 0:
        raise ConfigError(f"{what} failed (exit status {proc.returncode}): {shown}\n{_tail(stderr or stdout)}")
    return shown, stdout, stderr


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def measure_comm(timeout_s: float = 60, launcher: str | list[str] | None = None) -> dict:
    """Run the probe under the MPI launcher on 2 ranks; return its result (the dict CommModel.from_probe fits).

    ConfigError, naming the command line and the end of its output, when the
    launcher is missing, the run fails or times out, or its result is unreadable.
    """
    words = launcher_command(launcher)
    with tempfile.TemporaryDirectory(prefix="hpcpipe-probe-") as folder:
        out = os.path.join(folder, "probe.json")
        shown, stdout, stderr = launch(words, ["hpcpipe.plan.probe", "--out", out], "the communication probe",
                                        timeout_s)
        try:
            with open(out) as f:
                probe = json.load(f)
            CommModel.from_probe(probe)
        except (OSError, ValueError, ConfigError) as exc:
            raise ConfigError(f"the communication probe wrote no usable result ({exc}): {shown}\n"
                              f"{_tail(stderr or stdout)}") from None
    return probe


# the smallest training a rank can run: what it costs before any model-sized array (engine, schedule,
# communicators, MPI's buffers in use, the libraries a training rank imports)
BARE_TRAINING = ["--set", "model.dims=[8,8,8,8,8]", "--set", "parallel.pp=2", "--set", "train.steps=2",
                 "--set", "train.micro_batches=2", "--set", "data.synthetic_samples=16", "--set", 'checkpoint.dir=""',
                 "--set", "log.progress=false"]


def measure_rank_baseline(timeout_s: float = 60, launcher: str | list[str] | None = None) -> int:
    """Peak resident bytes of a rank of a bare 2-rank training run (hpcpipe.train on a model of 8-wide layers)."""
    words = launcher_command(launcher)
    with tempfile.TemporaryDirectory(prefix="hpcpipe-bare-") as folder:
        shown, stdout, stderr = launch(words, ["hpcpipe.train", *BARE_TRAINING], "the bare training run",
                                        timeout_s, cwd=folder)
    match = re.search(r"peak RSS (\d+) MiB per rank", stdout)
    if match is None:
        raise ConfigError(f"the bare training run printed no peak RSS: {shown}\n{_tail(stderr or stdout)}")
    return int(match.group(1)) * 1024 * 1024
