"""A real Slurm: jobs/train.sbatch submitted with sbatch to a single-node slurmctld + slurmd on this machine.

The module fixture installs Debian's slurm-wlm when it is missing
(tests/jobs/local_slurm.sh install: needs root and apt-get), starts the two
daemons with a private config (auth/none, proctrack/linuxproc, task/none,
SlurmdParameters=config_overrides, 8 CPUs) and always stops them, after
cancelling any job the tests left. It skips, with the script's reason, only
where Slurm cannot be installed or started (exit status 3).
There is no accounting (no sacct): jobs are followed with `scontrol show job`
(MinJobAge keeps finished jobs for 600 s) and their output files.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import ROOT, launchers
from support.state import assert_nested_equal, checkpoint_state

pytestmark = pytest.mark.slow

SCRIPT = ROOT / "tests" / "jobs" / "local_slurm.sh"
SBATCH = ROOT / "jobs" / "train.sbatch"
STEPS = 12
TINY_ARGS = (f"--set model.dims=[8,8,8,8,8] --set train.steps={STEPS} --set train.micro_batches=2 "
             "--set train.micro_batch_size=2 --set train.optimizer=adam --set train.lr=0.01 "
             "--set log.progress=false --set log.metrics=m.jsonl")
DONE = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
        "PREEMPTED")


class Slurm:
    """The local Slurm of this module: its SLURM_CONF and the jobs submitted to it."""

    def __init__(self, conf: str):
        self.conf = conf
        self.jobs: list[str] = []

    def env(self, drop: tuple[str, ...] = (), **more: str) -> dict:
        """Environment for Slurm commands and jobs: this Python's bin first on PATH (sbatch exports it)."""
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        base = {k: v for k, v in os.environ.items() if not k.startswith(drop)} if drop else os.environ
        return dict(base, SLURM_CONF=self.conf, PATH=path, PYTHONUNBUFFERED="1", **more)

    def cmd(self, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess:
        """Run a Slurm client command against this Slurm."""
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, env=self.env())

    def sbatch(self, workdir: Path, drop: tuple[str, ...] = (), script: Path = SBATCH, n: int = 8, **env: str) -> str:
        """Submit a job script (jobs/train.sbatch) at n tasks from workdir (without variables starting with `drop`)."""
        result = subprocess.run(["sbatch", "--parsable", "-n", str(n), f"--chdir={workdir}",
                                 f"--output={workdir / 'job.out'}", str(script)],
                                capture_output=True, text=True, timeout=30, env=self.env(drop, **env))
        assert result.returncode == 0, result.stderr
        job = result.stdout.strip().split(";")[0]
        self.jobs.append(job)
        return job

    def job(self, job: str) -> dict[str, str]:
        """Return `scontrol show job -o` of a job as a dict (empty once Slurm forgot it)."""
        result = self.cmd("scontrol", "show", "job", "-o", job)
        return dict(item.split("=", 1) for item in result.stdout.split() if "=" in item)

    def wait(self, job: str, done, seconds: float, what: str) -> dict[str, str]:
        """Poll the job until done(info) is true; fail after `seconds` naming `what` and the last state."""
        deadline = time.time() + seconds
        info = self.job(job)
        while not done(info) and time.time() < deadline:
            time.sleep(0.25)
            info = self.job(job)
        assert done(info), f"job {job}: {what} did not happen in {seconds} s (last state {info.get('JobState')!r}, " \
                           f"reason {info.get('Reason')!r})"
        return info

    def cancel_all(self) -> None:
        """Cancel this module's jobs and wait until none is running (their processes are gone)."""
        for job in self.jobs:
            self.cmd("scancel", job)
        deadline = time.time() + 60
        while time.time() < deadline:
            states = [self.job(job).get("JobState", "") for job in self.jobs]
            if all(s in DONE or s == "" for s in states):
                return
            time.sleep(0.5)


@pytest.fixture(scope="module")
def slurm():
    """A running local Slurm for this module; always stopped afterwards."""
    env = dict(os.environ)
    try:
        for step in ("install", "start"):
            result = subprocess.run(["bash", str(SCRIPT), step], capture_output=True, text=True, timeout=900,
                                    env=env)
            if result.returncode == 3:
                pytest.skip(f"Slurm cannot run on this machine: {result.stderr.strip()}")
            assert result.returncode == 0, f"local_slurm.sh {step} failed: {result.stderr}"
        local = Slurm(result.stdout.strip().splitlines()[-1])
        try:
            yield local
        finally:
            local.cancel_all()
    finally:
        subprocess.run(["bash", str(SCRIPT), "stop"], capture_output=True, text=True, timeout=120, env=env)


def _export(directory: Path, out: Path) -> dict:
    """Export a checkpoint's parameters with `python -m hpcpipe.checkpoint export`; return them by layer."""
    result = subprocess.run([sys.executable, "-m", "hpcpipe.checkpoint", "export", str(directory), str(out)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    import h5py
    with h5py.File(out) as f:
        return {name: {k: f["layers"][name][k][()] for k in f["layers"][name]} for name in f["layers"]}


def _verify(directory: Path) -> str:
    result = subprocess.run([sys.executable, "-m", "hpcpipe.checkpoint", "verify", str(directory)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def uninterrupted(slurm, tmp_path_factory):
    """sbatch jobs/train.sbatch at 8 tasks, run to the end: (job id, work directory, job info)."""
    work = tmp_path_factory.mktemp("slurm-train")
    job = slurm.sbatch(work, HPCPIPE_ARGS=TINY_ARGS, HPCPIPE_CKPT_DIR="ck")
    info = slurm.wait(job, lambda i: i.get("JobState") in DONE, 180, "completion")
    return job, work, info


def test_sbatch_train_completes_with_a_verified_checkpoint(uninterrupted):
    job, work, info = uninterrupted
    out = (work / "job.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", out
    assert f"hpcpipe: trained {STEPS} steps" in out and "(dp=2 pp=4" in out, out
    assert f"(latest: step {STEPS})" in out
    assert f"step {STEPS}" in _verify(work / "ck")


def _preempt_requeue_and_finish(slurm: Slurm, job: str, work: Path, signal_name: str) -> tuple[dict, str, int]:
    """Signal the batch shell after 2 steps, follow the requeue to completion; return (info, output, stopped step)."""
    metrics = work / "m.jsonl"
    deadline = time.time() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2) and time.time() < deadline:
        assert slurm.job(job).get("JobState") not in DONE, (work / "job.out").read_text()
        time.sleep(0.1)
    # what --signal=B:USR1@120 does before the time limit (USR1), or scancel / preemption (TERM): to the batch shell
    sent = slurm.cmd("scancel", f"--signal={signal_name}", "--batch", job)
    assert sent.returncode == 0, sent.stderr
    # Restarts=1 shows while the job is still REQUEUED/COMPLETING; wait until it is pending again (or on)
    slurm.wait(job, lambda i: i.get("Restarts") == "1" and i.get("JobState") in ("PENDING", "RUNNING", *DONE),
               90, "requeue")

    asked: list[bool] = []

    def released(i: dict) -> bool:
        # Slurm holds a requeued job back ~2 minutes (BeginTime). Ask for a start a few seconds out, once:
        # slurmd refuses a relaunch within the second of the old credential's revocation ("Job credential
        # revoked") and the job then fails.
        if i.get("JobState") == "PENDING" and not asked:
            asked.append(slurm.cmd("scontrol", "update", f"JobId={job}", "StartTime=now+3").returncode == 0)
        return i.get("JobState") in DONE

    info = slurm.wait(job, released, 240, "completion after the requeue")
    out = (work / "job.out").read_text()       # --open-mode=append: both runs' output
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0" and info["Restarts"] == "1", out
    assert f"batch shell got SIG{signal_name}" in out, out
    assert "requeueing job" in out and f"hpcpipe job {job} (restart 1)" in out and "--resume" in out, out
    stopped = int(out.split("resumed at step ")[1].split(")")[0])
    assert 2 <= stopped < STEPS
    assert f"step {STEPS}" in _verify(work / "ck")
    return info, out, stopped


def _same_final_state(work: Path, ref_work: Path) -> None:
    """The same final parameters (and optimizer state) as the uninterrupted job, bit for bit."""
    assert_nested_equal(_export(work / "ck", work / "final.h5"), _export(ref_work / "ck", work / "reference.h5"))
    for mine, reference in zip(checkpoint_state(work / "ck"), checkpoint_state(ref_work / "ck"), strict=True):
        assert_nested_equal(mine, reference)


def test_usr1_checkpoints_requeues_and_finishes_like_an_uninterrupted_job(slurm, uninterrupted, tmp_path):
    _, ref_work, _ = uninterrupted
    job = slurm.sbatch(tmp_path, HPCPIPE_ARGS=TINY_ARGS, HPCPIPE_CKPT_DIR="ck", HPCPIPE_STEP_SLEEP="0.3")
    _, out, stopped = _preempt_requeue_and_finish(slurm, job, tmp_path, "USR1")
    assert "training exited with status 75" in out and f"checkpoint of step {stopped}" in out, out
    assert f"stop marker {tmp_path / f'hpcpipe-stop-{job}.json'}: " in out and f'"step": {stopped}' in out, out
    assert not list(tmp_path.glob("hpcpipe-stop-*"))
    _same_final_state(tmp_path, ref_work)


def test_open_mpi_mpirun_sigterm_requeues_through_the_stop_marker(slurm, uninterrupted, tmp_path):
    # the attack: under Open MPI's mpirun every rank checkpoints and exits 75 on SIGTERM, but mpirun returns 1
    _, ref_work, _ = uninterrupted
    mpirun, _ = launchers.openmpi_mpirun()
    root_env = {k: v for k, v in launchers.openmpi_env().items() if not k.startswith("MPI4PY")}
    job = slurm.sbatch(tmp_path, drop=("MPI4PY_",), HPCPIPE_ARGS=TINY_ARGS, HPCPIPE_CKPT_DIR="ck",
                       HPCPIPE_STEP_SLEEP="0.3", HPCPIPE_LAUNCHER=mpirun, **root_env)
    _, out, stopped = _preempt_requeue_and_finish(slurm, job, tmp_path, "TERM")
    assert "Open MPI launcher: MPI4PY_LIBMPI=" in out and "hpcpipe: MPI: Open MPI" in out, out
    assert out.count("hpcpipe: MPI: Open MPI") == 2 and ", 8 ranks" in out, out     # both runs, on Open MPI
    # (rank 0's own "stopped ... checkpoint of step N" line may be lost: mpirun stops forwarding output on SIGTERM)
    launcher_rc = int(out.split("training exited with status ")[1].split()[0])
    assert f"the launcher returned {launcher_rc})" in out and f'"step": {stopped}' in out, out
    _same_final_state(tmp_path, ref_work)


def test_a_plain_scancel_stops_with_a_checkpoint_and_is_not_requeued(slurm, tmp_path):
    """A user's scancel was undone: the script requeued after every exit 75 and the job came back to train on."""
    job = slurm.sbatch(tmp_path, HPCPIPE_ARGS=TINY_ARGS, HPCPIPE_CKPT_DIR="ck", HPCPIPE_STEP_SLEEP="0.3")
    metrics = tmp_path / "m.jsonl"
    deadline = time.time() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2) and time.time() < deadline:
        assert slurm.job(job).get("JobState") not in DONE, (tmp_path / "job.out").read_text()
        time.sleep(0.1)
    assert slurm.cmd("scancel", job).returncode == 0
    info = slurm.wait(job, lambda i: i.get("JobState") in DONE, 90, "the end after scancel")
    time.sleep(3)                 # a requeue, had the script made one, shows by now
    info = slurm.job(job)
    out = (tmp_path / "job.out").read_text()
    assert info["JobState"] == "CANCELLED" and info.get("Restarts") == "0", (info, out)
    assert "batch shell got SIGTERM" in out and f"job {job} is ending (COMPLETING: scancel" in out, out
    assert "stopped with a checkpoint in ck, not requeued" in out, out
    assert "requeueing job" not in out, out
    assert "step " in _verify(tmp_path / "ck")          # the checkpoint it stopped with, complete


def test_sbatch_serve_answers_over_http_and_scancel_drains_it(slurm, tmp_path):
    import json
    import socket
    import urllib.request

    from support.serve import make_weights
    make_weights(tmp_path / "gpt.h5")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    job = slurm.sbatch(tmp_path, script=ROOT / "jobs" / "serve.sbatch", n=4, HPCPIPE_WEIGHTS="gpt.h5",
                       HPCPIPE_PP="2", HPCPIPE_PORT=str(port))
    out = tmp_path / "job.out"
    deadline = time.time() + 120
    while time.time() < deadline and "hpcpipe: serving" not in (out.read_text() if out.exists() else ""):
        time.sleep(0.25)
    text = out.read_text()
    assert f"on http://127.0.0.1:{port}/v1 (dp=2 x pp=2" in text, text
    assert f"ssh -N -L {port}:127.0.0.1:{port}" in text
    body = json.dumps({"prompt": "hello", "max_tokens": 5, "temperature": 0}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    reply = json.loads(urllib.request.urlopen(request, timeout=30).read())
    assert reply["choices"][0]["finish_reason"] == "length" and len(reply["choices"][0]["text"]) == 5
    slurm.cmd("scancel", job)
    slurm.wait(job, lambda info: info.get("JobState") in DONE, 60, "the end after scancel")
    deadline = time.time() + 10
    while time.time() < deadline and "the server exited" not in out.read_text():
        time.sleep(0.25)
    text = out.read_text()
    assert "draining the server" in text and "hpcpipe: stopped (SIGTERM)" in text, text
    assert "the server exited with status 0" in text, text
