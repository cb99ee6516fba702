"""Unit tests: the run's MPI description line, the terminal rule of the progress bar, the stop marker."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

from hpcpipe.runtime import runenv, stop_marker

MPICH = "MPICH Version:      5.0.2\nMPICH Release date: Fri Oct  3 2025\nMPICH ABI:          17:2:5\n"
OPEN_MPI = "Open MPI v4.1.4, package: Debian OpenMPI, ident: 4.1.4, repo rev: v4.1.4, May 26, 2022\x00"
MAPS = """\
7f0000000000-7f0000001000 r--p 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6
7f0000002000-7f0000003000 r--p 00000000 08:01 2 /venv/lib/libmpi_abi.so.1
7f0000004000-7f0000005000 r-xp 00000000 08:01 3 /usr/lib/x86_64-linux-gnu/libmpi.so.40.30.4
7f0000006000-7f0000007000 r-xp 00000000 08:01 4 /usr/lib/x86_64-linux-gnu/libmpi_cxx.so.40
"""


def test_library_name_is_the_first_line_of_the_version_text():
    assert runenv.library_name(MPICH) == "MPICH 5.0.2"
    assert runenv.library_name(OPEN_MPI) == "Open MPI v4.1.4"
    assert runenv.library_name("") == "unknown MPI library"


def test_loaded_libmpi_is_the_mapped_libmpi_not_its_companions():
    assert runenv.loaded_libmpi(MAPS) == "/usr/lib/x86_64-linux-gnu/libmpi.so.40.30.4"
    assert runenv.loaded_libmpi("7f-7f r--p 0 08:01 1 /venv/lib/libmpi.so.12\n") == "/venv/lib/libmpi.so.12"
    assert runenv.loaded_libmpi(MAPS.replace("libmpi.so.40.30.4", "libfoo.so")) == ""


def test_mpi4py_build_names_the_wheel_abi_or_the_compiler_of_a_source_build():
    wheel = "/v/mpi4py/MPI.openmpi.cpython-311-x86_64-linux-gnu.so"
    assert runenv.mpi4py_build(wheel, {}, "4.1.2") == "mpi4py 4.1.2 wheel, openmpi ABI"
    source = "/v/mpi4py/MPI.cpython-311-x86_64-linux-gnu.so"
    assert runenv.mpi4py_build(source, {"mpicc": "/usr/bin/mpicc"}, "4.1.2") == "mpi4py 4.1.2 built with /usr/bin/mpicc"
    assert runenv.mpi4py_build(source, {}, "4.1.2") == "mpi4py 4.1.2 built from source"


def test_mpi_line_is_one_line_with_library_path_build_and_ranks():
    line = runenv.mpi_line(OPEN_MPI, 8, "/usr/lib/libmpi.so.40", "mpi4py 4.1.2 wheel, openmpi ABI")
    assert line == ("hpcpipe: MPI: Open MPI v4.1.4 (libmpi at /usr/lib/libmpi.so.40; mpi4py 4.1.2 wheel, "
                    "openmpi ABI), 8 ranks")
    assert "\n" not in runenv.mpi_line(MPICH, 1, "", "mpi4py") and ", 1 rank" in runenv.mpi_line(MPICH, 1, "", "")


class _Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_terminal_rule_outside_open_mpi_is_isatty(monkeypatch):
    monkeypatch.delenv("OMPI_COMM_WORLD_SIZE", raising=False)
    assert runenv.stdout_is_terminal(_Stream(True)) is True
    assert runenv.stdout_is_terminal(_Stream(False)) is False


def test_under_open_mpi_a_pty_is_not_enough_the_launcher_must_write_to_a_terminal(monkeypatch):
    # the attack: Open MPI hands each rank a pty while mpirun's own stdout is a log file
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "8")
    monkeypatch.setattr(runenv, "launcher_stdout_is_terminal", lambda: False)
    assert runenv.stdout_is_terminal(_Stream(True)) is False
    monkeypatch.setattr(runenv, "launcher_stdout_is_terminal", lambda: True)
    assert runenv.stdout_is_terminal(_Stream(True)) is True
    assert runenv.stdout_is_terminal(_Stream(False)) is False


def test_launcher_stdout_is_found_by_walking_up_to_a_process_named_mpirun(tmp_path):
    # a fake launcher named mpirun whose stdout is a file, with a child that asks
    launcher = tmp_path / "mpirun"
    launcher.write_text(f'#!/bin/sh\n"{sys.executable}" -c "$1"\n')     # the shell stays, named mpirun
    launcher.chmod(0o755)
    probe = ("import sys; from hpcpipe.runtime import runenv; "
             "sys.stderr.write(str(runenv.launcher_stdout_is_terminal()))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    with open(tmp_path / "log", "w") as log:
        proc = subprocess.run([str(launcher), probe], stdout=log, stderr=subprocess.PIPE, text=True, env=env,
                              timeout=60, check=False)
    assert proc.stderr == "False"
    # the same launcher writing to a real terminal (script(1) gives it a pty)
    proc = subprocess.run(["script", "-qec", f"{launcher} '{probe}' 2>{tmp_path / 'err'}", "/dev/null"],
                          capture_output=True, text=True, env=env, timeout=60, check=False)
    assert (tmp_path / "err").read_text() == "True", proc.stdout


def test_terminal_paths():
    assert runenv.is_terminal_path("/dev/pts/3") and runenv.is_terminal_path("/dev/tty1")
    assert not runenv.is_terminal_path("pipe:[1234]") and not runenv.is_terminal_path("/tmp/job.out")


def test_stop_marker_only_when_asked_and_its_contents(tmp_path):
    assert stop_marker.write_stop_marker(7, "a stop signal", "ck", env={}) == ""
    path = tmp_path / "stop.json"
    env = {"HPCPIPE_STOP_MARKER": str(path), "SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "1"}
    assert stop_marker.write_stop_marker(7, "a stop signal on 1 of 8 rank(s)", "ck", env=env) == str(path)
    record = json.loads(path.read_text())
    assert record["status"] == 75 and record["step"] == 7 and record["checkpoint_dir"] == "ck"
    assert record["job_id"] == "42" and record["restart"] == "1" and "a stop signal" in record["reason"]
    assert [p.name for p in tmp_path.iterdir()] == ["stop.json"]          # no temporary file left


def test_unwritable_stop_marker_warns_and_keeps_going(tmp_path, capsys):
    env = {"HPCPIPE_STOP_MARKER": str(tmp_path / "missing-dir" / "stop.json")}
    assert stop_marker.write_stop_marker(3, "x", "ck", env=env) == ""
    err = capsys.readouterr().err
    assert "hpcpipe: warning: cannot write the stop marker HPCPIPE_STOP_MARKER=" in err and "75 stands" in err
    assert not (tmp_path / "missing-dir").exists()


def _threads_seen(env: dict) -> str:
    import os
    import subprocess
    import sys
    base = {k: v for k, v in os.environ.items()
            if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS",
                         "HPCPIPE_THREADS", "HPCPIPE_AUTO_THREADS", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE",
                         "SLURM_NTASKS_PER_NODE", "PMI_LOCAL_SIZE", "MPI_LOCAL_NRANKS")}
    code = "import os, hpcpipe; print(os.environ['OMP_NUM_THREADS'], os.environ['OPENBLAS_NUM_THREADS'])"
    return subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_a_parents_automatic_thread_count_is_not_taken_for_the_users():
    import os
    cores = len(os.sched_getaffinity(0))
    share = str(max(1, cores // 4))
    # a driver that imported hpcpipe (one local process: all cores) then started 4 ranks: each computes its share
    assert _threads_seen({"OMP_NUM_THREADS": str(cores), "OPENBLAS_NUM_THREADS": str(cores),
                          "HPCPIPE_AUTO_THREADS": str(cores), "MPI_LOCALNRANKS": "4"}) == f"{share} {share}"
    # the user's own setting is kept, even when it equals what hpcpipe would have chosen
    assert _threads_seen({"OMP_NUM_THREADS": "3", "OPENBLAS_NUM_THREADS": "3", "MPI_LOCALNRANKS": "4"}) == "3 3"
    # one variable the user's, the other hpcpipe's from the parent
    mine = str(cores + 1)
    assert _threads_seen({"OMP_NUM_THREADS": mine, "OPENBLAS_NUM_THREADS": str(cores),
                          "HPCPIPE_AUTO_THREADS": str(cores), "MPI_LOCALNRANKS": "4"}) == f"{mine} {share}"
    # nothing set: the share of the local ranks
    assert _threads_seen({"MPI_LOCALNRANKS": "4"}) == f"{share} {share}"
