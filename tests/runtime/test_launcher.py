"""End-to-end: what depends on the launcher (HPCPIPE_TEST_LAUNCHER=mpich|openmpi, see tests/support/launchers.py).

The MPI line each run prints first, progress output in a redirected log
(Open MPI hands its ranks a pty even then), and jobs/train.sbatch run by
plain bash (no Slurm) to pin the stop-marker contract: a stopped run is
status 75 whatever the launcher returns, and a stale marker fakes nothing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import ROOT, launchers
from support.configs import sets
from support.launch import command, wait_until_gone

from hpcpipe.state import directory_protocol as cf

pytestmark = pytest.mark.slow

SBATCH = ROOT / "jobs" / "train.sbatch"
TINY = {"model": {"dims": [8, 8, 8, 8, 8]}, "data": {"synthetic_samples": 64},
        "train": {"micro_batches": 2, "micro_batch_size": 2, "optimizer": "adam", "lr": 0.01},
        "checkpoint": {"every": 0}}
TINY_ARGS = ("--set model.dims=[8,8,8,8,8] --set data.synthetic_samples=64 --set train.micro_batches=2 "
             "--set train.micro_batch_size=2 --set train.optimizer=adam --set log.progress=false "
             "--set log.metrics=m.jsonl")


def _library() -> str:
    return "Open MPI" if launchers.chosen() == "openmpi" else "MPICH"


def test_first_line_names_the_mpi_library_the_ranks_loaded(tmp_path):
    argv = command(8, "hpcpipe.train", sets(**TINY) + sets(train={"steps": 2}, log={"progress": False},
                                                         checkpoint={"dir": ""}))
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=180, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    first = lines[0]
    assert first.startswith(f"hpcpipe: MPI: {_library()} ") and first.endswith(", 8 ranks"), first
    assert sum(line.startswith("hpcpipe: MPI:") for line in lines) == 1          # rank 0 only
    libmpi = first.split("(libmpi at ")[1].split(";")[0]
    assert Path(libmpi).is_file() and "libmpi.so" in libmpi, first
    assert ("openmpi ABI" in first) == (launchers.chosen() == "openmpi") or "built " in first, first


def test_progress_redirected_to_a_file_has_no_carriage_returns(tmp_path):
    argv = command(8, "hpcpipe.train", sets(**TINY) + sets(train={"steps": 6}, log={"progress": True, "every": 1},
                                                         checkpoint={"dir": ""}))
    log = tmp_path / "job.out"
    with open(log, "w") as out:
        proc = subprocess.run(argv, stdout=out, stderr=subprocess.PIPE, text=True, timeout=180, cwd=tmp_path,
                              check=False)
    assert proc.returncode == 0, proc.stderr
    text = log.read_bytes()
    assert b"\r" not in text, text[:400]
    assert [line.split("] ")[1].split(" loss")[0] for line in text.decode().splitlines() if line.startswith("[")] \
        == [f"step {i}/6" for i in range(1, 7)]


def test_progress_on_a_terminal_redraws_under_open_mpi(tmp_path):
    if launchers.chosen() != "openmpi":
        pytest.skip("MPICH's hydra gives ranks pipes, never a terminal: plain lines there")
    argv = command(8, "hpcpipe.train", sets(**TINY) + sets(train={"steps": 4}, log={"progress": True, "every": 1},
                                                         checkpoint={"dir": ""}))
    quoted = " ".join(f"'{a}'" for a in argv)
    proc = subprocess.run(["script", "-qec", quoted, "/dev/null"], capture_output=True, timeout=180,
                          cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.count(b"\r[") >= 3, proc.stdout        # redrawn in place when a person watches


def _sbatch_env(tmp: Path, **more: str) -> dict:
    """Environment of jobs/train.sbatch run by bash outside Slurm, with the chosen launcher."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MPI4PY_", "HPCPIPE_"))}
    if launchers.chosen() == "openmpi":
        mpirun, _ = launchers.openmpi_mpirun()
        env.update({k: v for k, v in launchers.openmpi_env().items() if not k.startswith("MPI4PY")})
        launcher = mpirun     # the script itself must point mpi4py at Open MPI's libmpi
    else:
        launcher = launchers.mpich_mpiexec()
    pid_dir = tmp / "pids"
    pid_dir.mkdir(exist_ok=True)
    env.update(SLURM_NTASKS="8", SLURM_JOB_ID="4242", HPCPIPE_LAUNCHER=launcher, HPCPIPE_REQUEUE="0",
               HPCPIPE_CKPT_DIR="ck", HPCPIPE_PID_DIR=str(pid_dir), PYTHONUNBUFFERED="1", **more)
    return env


def test_sbatch_script_stopped_by_sigterm_reports_75_from_the_stop_marker(tmp_path):
    env = _sbatch_env(tmp_path, HPCPIPE_ARGS=TINY_ARGS + " --set train.steps=200", HPCPIPE_STEP_SLEEP="0.2")
    marker = tmp_path / "hpcpipe-stop-4242.json"
    proc = subprocess.Popen(["bash", str(SBATCH)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=tmp_path)
    metrics = tmp_path / "m.jsonl"
    deadline = time.time() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3) and time.time() < deadline:
        assert proc.poll() is None
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)          # what scancel / preemption does to the batch shell
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 75, out
    launcher_rc = int(out.split("training exited with status ")[1].split()[0])
    if launchers.chosen() == "openmpi":       # the attack: Open MPI's mpirun says 1 though every rank said 75
        assert "Open MPI launcher: MPI4PY_LIBMPI=" in out and "hpcpipe: MPI: Open MPI" in out, out
    else:
        assert launcher_rc == 75, out
    stopped = int(cf.read_latest(tmp_path / "ck").rsplit("step-", 1)[1])   # latest names run-NNNN/step-N
    assert f"stop marker {marker}: " in out and f"the launcher returned {launcher_rc})" in out, out
    record = json.loads(out.split(f"stop marker {marker}: ")[1].split("; treating")[0])
    assert record["status"] == 75 and record["step"] == stopped and record["job_id"] == "4242", out
    assert not marker.exists()                # the script's own file, removed once read
    assert wait_until_gone(str(tmp_path), 20) == []


def test_sbatch_script_ignores_a_stale_stop_marker(tmp_path):
    stale = tmp_path / "stale.json"
    stale.write_text('{"status": 75, "step": 3}\n')          # left by an earlier, killed run
    env = _sbatch_env(tmp_path, HPCPIPE_ARGS=TINY_ARGS + " --set train.steps=3", HPCPIPE_STOP_MARKER="stale.json")
    proc = subprocess.run(["bash", str(SBATCH)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=180,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "training exited with status 0" in proc.stdout and "stop marker" not in proc.stdout, proc.stdout
    assert "hpcpipe: trained 3 steps" in proc.stdout and not stale.exists()


@pytest.mark.parametrize("procid", ["0", "3"])
def test_srun_without_the_mpi_plugin_is_one_line_naming_the_cause(tmp_path, procid):
    """srun without --mpi=pmi2/pmix starts N singletons: each said "world size 1 is not divisible by parallel.pp (4)"
    (8 copies in a real Slurm job, tests/jobs/local_slurm.sh, srun --kill-on-bad-exit=1 -n 8), hiding the cause.
    Task 0 now says it once; the other tasks exit 2 silently."""
    if any(name in os.environ for name in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "SLURM_STEP_NUM_TASKS")):
        pytest.skip("pytest runs under a launcher: the command would be a rank's child, which runs alone by design")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PMI_", "OMPI_", "PMIX_"))}
    env.update({"SLURM_STEP_NUM_TASKS": "8", "SLURM_NTASKS": "8", "SLURM_PROCID": procid,
                "PYTHONPATH": str(ROOT / "src")})
    result = subprocess.run([sys.executable, "-m", "hpcpipe.train", "--set", "train.steps=1"], env=env,
                            cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "not divisible" not in result.stderr, result.stderr
    if procid == "0":
        assert result.stderr.count("error:") == 1 and "srun started 8 tasks (SLURM_STEP_NUM_TASKS=8) but MPI sees " \
            "each one alone (world size 1): srun needs the PMI plugin of this MPI" in result.stderr, result.stderr
    else:
        assert "error:" not in result.stderr, result.stderr
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize("env,words", [
    ({"SLURM_STEP_NUM_TASKS": "4"}, "srun started 4 tasks"),
    ({"PMI_SIZE": "2", "SLURM_STEP_NUM_TASKS": "1"}, "the launcher started 2 processes (PMI_SIZE=2)"),
    ({"OMPI_COMM_WORLD_SIZE": "8"}, "the launcher does not belong to the MPI library"),
    ({"PMI_SIZE": "1", "SLURM_STEP_NUM_TASKS": "4"}, ""),    # hydra's mpiexec -n 1 inside an srun step: fine
    ({"SLURM_NTASKS": "8"}, ""),          # a batch shell's allocation, not a launch: python run there alone
    ({"SLURM_STEP_NUM_TASKS": "4", "SLURM_PTY_PORT": "40123"}, ""),    # srun -n 4 --pty bash: a shell in task 0
    ({}, ""),
])
def test_launcher_mismatch_reads_the_step_not_the_allocation(env, words):
    from hpcpipe.runtime.launcher import launcher_mismatch
    assert launcher_mismatch(2, "X", env, parent_has=False) == ""
    message = launcher_mismatch(1, "X", env, parent_has=False)
    assert (words in message and "(X)" in message) if words else message == ""
    # a rank's child (its parent holds the variables) runs alone by design
    assert launcher_mismatch(1, "X", env, parent_has=True) == ""


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0, reason="needs root to start a process as nobody")
def test_a_task_whose_parent_belongs_to_another_user_counts_as_the_launcher_s(tmp_path):
    """srun's slurmstepd runs as root: a user's task cannot read its environment (Permission denied, checked on the
    local Slurm as nobody). The checks read that as 'maybe a rank's child' and never fired for a real user, only
    for root; a parent of another user cannot be the user's rank, so it counts as the launcher."""
    script = ("from hpcpipe.runtime.launcher import launcher_mismatch, one_process_problem\n"
              "print(one_process_problem('hpcpipe.evaluate', {'PMI_SIZE': '2'}))\n"
              "print(launcher_mismatch(1, 'X', {'SLURM_STEP_NUM_TASKS': '4'}))\n")
    # this test's process (root) is the parent of a process that runs as nobody, as slurmstepd is of a task; the
    # module needs no package outside the standard library, so any Python that nobody may run will do
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}
    tmp_path.chmod(0o777)
    for python in (sys.executable, "/usr/bin/python3"):
        try:
            if subprocess.run([python, "-c", "import hpcpipe.runtime.launcher"], env=env, cwd=tmp_path,
                              user="nobody", capture_output=True, check=False).returncode == 0:
                break
        except OSError:     # e.g. a Python under /root, which nobody may not run
            continue
    else:
        pytest.skip("no Python here that the user nobody may run with this checkout")
    result = subprocess.run([python, "-c", script], env=env, cwd=tmp_path, user="nobody", capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert "the launcher started 2" in result.stdout and "srun started 4 tasks" in result.stdout, result.stdout


def test_a_launcher_started_by_another_is_told_by_the_value_its_ranks_were_given(tmp_path):
    """Hydra's proxies and Open MPI's daemons are started by srun on a multi-node job: they hold srun's
    SLURM_STEP_NUM_TASKS (and PMI_SIZE = the node count under srun --mpi=pmi2), and their ranks a PMI_SIZE of
    their own. The checks asked whether the parent held any size variable, so a proxy passed for a rank and
    neither check fired there; now the parent must hold the very name=value the process found."""
    script = ("from hpcpipe.runtime.launcher import launcher_mismatch, one_process_problem\n"
              "print(repr(one_process_problem('hpcpipe.evaluate')))\n"
              "print(repr(launcher_mismatch(1, 'X')))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PMI_", "OMPI_", "PMIX_"))}
    env.update({"PYTHONPATH": str(ROOT / "src"), "SLURM_STEP_NUM_TASKS": "3", "PMI_SIZE": "3"})
    # the shell stands for the proxy (an srun task); it starts its rank with the job's PMI_SIZE, and waits for it
    launch = f"PMI_SIZE=2 {sys.executable} -c \"$SCRIPT\"; status=$?; exit $status"
    proxy = subprocess.run(["sh", "-c", launch], env={**env, "SCRIPT": script}, cwd=tmp_path, capture_output=True,
                           text=True, timeout=120, check=False)
    assert proxy.returncode == 0, proxy.stderr
    assert "the launcher started 2: each would do the whole job" in proxy.stdout, proxy.stdout
    assert "the launcher started 2 processes (PMI_SIZE=2)" in proxy.stdout, proxy.stdout
    # a rank's child inherits the rank's own values: it still runs alone
    child = subprocess.run(["sh", "-c", f"{sys.executable} -c \"$SCRIPT\"; status=$?; exit $status"],
                           env={**env, "PMI_SIZE": "2", "SCRIPT": script}, cwd=tmp_path, capture_output=True,
                           text=True, timeout=120, check=False)
    assert child.returncode == 0 and child.stdout.split("\n")[:2] == ["None", "''"], (child.stdout, child.stderr)
