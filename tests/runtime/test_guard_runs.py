"""End-to-end: the real `mpiexec -n 8 python -m hpcpipe.train` stopped by signals, stalls and NaNs.

Every run is tied to its tmp_path (in its arguments or environment), so that
after it ends the tests can check that no process of it is left behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from support import ROOT, launchers
from support.configs import sets
from support.launch import command, run, wait_until_gone
from support.state import assert_nested_equal, checkpoint_state, metrics_losses

from hpcpipe import errors
from hpcpipe.state import directory_protocol as cf

pytestmark = pytest.mark.slow

STEPS = 30
TINY = {"model": {"dims": [8, 8, 8, 8, 8]}, "data": {"synthetic_samples": 64},
        "train": {"steps": STEPS, "micro_batches": 2, "micro_batch_size": 2, "optimizer": "adam", "lr": 0.01},
        "checkpoint": {"every": 0}, "log": {"progress": False}}


def _args(tmp: Path, **extra) -> list[str]:
    return sets(**TINY) + sets(checkpoint={"dir": str(tmp / "ck")}, log={"metrics": str(tmp / "m.jsonl")}) + \
        sets(**extra)


def _env(tmp: Path, **more) -> dict:
    pid_dir = tmp / "pids"
    pid_dir.mkdir(exist_ok=True)
    return dict(os.environ, HPCPIPE_PID_DIR=str(pid_dir), PYTHONUNBUFFERED="1",
                HPCPIPE_STOP_MARKER=str(tmp / "stop.json"), **more)


def _start(tmp: Path, env: dict, *more, **extra) -> subprocess.Popen:
    return subprocess.Popen(command(8, "hpcpipe.train", _args(tmp, **extra) + list(more)), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)


def _wait_for_steps(proc: subprocess.Popen, metrics: Path, n: int, seconds: float = 120) -> None:
    deadline = time.time() + seconds
    while proc.poll() is None and time.time() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"the run did not reach {n} steps (exit status {proc.poll()})")


def _finish(proc: subprocess.Popen, seconds: float) -> tuple[str, str, float]:
    """Wait up to `seconds` for the run to end; return (stdout, stderr, seconds it took)."""
    t0 = time.time()
    try:
        out, err = proc.communicate(timeout=seconds)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return out, err, time.time() - t0


def _rank_pid(tmp: Path, rank: int) -> int:
    path = tmp / "pids" / f"rank-{rank}.pid"
    deadline = time.time() + 60
    while not path.exists() and time.time() < deadline:
        time.sleep(0.05)
    return int(path.read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run: its final checkpoint's (parameters, optimizer state) and per-step losses."""
    tmp = tmp_path_factory.mktemp("reference")
    result = run(command(8, "hpcpipe.train", _args(tmp)))
    assert result.returncode == 0, result.stderr
    return checkpoint_state(tmp / "ck"), metrics_losses(tmp / "m.jsonl")


@pytest.mark.parametrize("how", ["USR1 to mpiexec", "TERM to mpiexec", "TERM to one rank"])
def test_stop_signal_checkpoints_exits_75_and_resume_matches_uninterrupted(reference, tmp_path, how):
    proc = _start(tmp_path, _env(tmp_path, HPCPIPE_STEP_SLEEP="0.1"))
    _wait_for_steps(proc, tmp_path / "m.jsonl", 3)
    if how.endswith("to mpiexec"):
        proc.send_signal(signal.SIGUSR1 if how.startswith("USR1") else signal.SIGTERM)
    else:
        os.kill(_rank_pid(tmp_path, 5), signal.SIGTERM)
    out, err, took = _finish(proc, 60)
    if how == "TERM to mpiexec" and launchers.chosen() == "openmpi":
        # Open MPI's mpirun reports 1 although every rank exited 75: the stop marker is the contract
        assert proc.returncode in (errors.EXIT_PREEMPTED, 1), err
    else:
        assert proc.returncode == errors.EXIT_PREEMPTED, err
    assert took < 30
    stopped = int(cf.read_latest(tmp_path / "ck").rsplit("step-", 1)[1])   # latest names run-0001/step-N
    assert 3 <= stopped < STEPS
    marker = json.loads((tmp_path / "stop.json").read_text())     # written by world rank 0 after the checkpoint
    assert marker["status"] == 75 and marker["step"] == stopped and marker["checkpoint_dir"] == str(tmp_path / "ck")
    assert "SIG" in marker["reason"] or "not here" in marker["reason"]
    assert f"after step {stopped} of {STEPS}" in out and "exit status 75" in out, out
    assert len(metrics_losses(tmp_path / "m.jsonl")) == stopped           # checkpoint = last finished step
    assert wait_until_gone(str(tmp_path), 10) == []

    resumed = run(command(8, "hpcpipe.train", _args(tmp_path) + ["--resume"]))
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed at step {stopped}" in resumed.stdout
    (ref_params, ref_opt), ref_losses = reference
    params, opt = checkpoint_state(tmp_path / "ck")
    assert_nested_equal(params, ref_params)
    assert_nested_equal(opt, ref_opt)
    assert metrics_losses(tmp_path / "m.jsonl") == ref_losses


def test_sigint_on_mpiexec_ends_the_whole_job_within_30_s(tmp_path):
    proc = _start(tmp_path, _env(tmp_path, HPCPIPE_STEP_SLEEP="0.2"))
    _wait_for_steps(proc, tmp_path / "m.jsonl", 2)
    t0 = time.time()
    proc.send_signal(signal.SIGINT)
    out, err, _ = _finish(proc, 30)
    if launchers.chosen() == "openmpi":
        # Open MPI's mpirun turns Ctrl-C into SIGTERM to every rank: they stop with a checkpoint, mpirun says 1
        assert proc.returncode == 1, err
        assert "(SIGTERM here)" in out and "exit status 75" in out, out
        assert json.loads((tmp_path / "stop.json").read_text())["status"] == 75
    else:
        assert proc.returncode == errors.EXIT_INTERRUPTED, err
        assert "interrupted (SIGINT); ending the job (exit status 130)" in err, err   # was "error: KeyboardInterrupt: "
    assert wait_until_gone(str(tmp_path), 30 - (time.time() - t0)) == [], "processes left after Ctrl-C"
    assert time.time() - t0 < 30


def test_stalled_rank_triggers_the_watchdog(tmp_path):
    timeout = 4.0
    env = _env(tmp_path, HPCPIPE_STALL="rank=6,step=3,seconds=600")
    proc = _start(tmp_path, env, run={"stall_timeout": timeout})
    _wait_for_steps(proc, tmp_path / "m.jsonl", 1)
    t0 = time.time()
    _, err, _ = _finish(proc, timeout + 60)
    assert proc.returncode == errors.EXIT_STALLED, err
    assert time.time() - t0 < timeout + 30
    assert wait_until_gone(str(tmp_path), 10) == [], "processes left after the watchdog abort"
    # the stuck rank (world rank 6 = dp01-pp02) says where it is stuck, in the test hook
    assert "[dp01-pp02] watchdog: no progress" in err, err
    stuck = [line for line in err.splitlines() if line.startswith("[dp01-pp02]")]
    assert any("stall_injection" in line for line in stuck), err
    assert any("Thread" in line for line in stuck)
    # the other ranks that dumped before the abort reached them are seen waiting in communication
    others = [line for line in err.splitlines() if line.startswith("[dp") and not line.startswith("[dp01-pp02]")]
    assert not others or any("comm.py" in line and "in wait" in line for line in others), err


def test_injected_nan_is_skipped_and_training_goes_on(reference, tmp_path):
    result = run(command(8, "hpcpipe.train", _args(tmp_path)), env={"HPCPIPE_NAN": "rank=2,step=4,count=2"})
    assert result.returncode == 0, result.stderr
    assert "2 step(s) skipped" in result.stdout
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("skipped")] == [4, 5]
    assert all(r["grad_norm"] is None and r["bad_ranks"] == 1 for r in records if r.get("skipped"))
    _, ref_losses = reference
    losses = metrics_losses(tmp_path / "m.jsonl")
    assert all(losses[s] == ref_losses[s] for s in range(5))       # same until the first skipped update


def test_m_bad_steps_in_a_row_abort_with_status_77(tmp_path):
    result = run(command(8, "hpcpipe.train", _args(tmp_path, train={"max_bad_steps": 3})), timeout=120,
                 env={"HPCPIPE_NAN": "rank=7,step=2,count=100,what=loss"})
    assert result.returncode == errors.EXIT_DIVERGED, result.stderr
    assert result.stderr.count("3 steps in a row (steps 3..5, the metrics' \"step\" 2..4) had a non-finite "
                               "loss") == 1, result.stderr
    assert len(metrics_losses(tmp_path / "m.jsonl")) == 5
    assert not (tmp_path / "ck").exists()
    assert wait_until_gone(str(tmp_path), 10) == []


@pytest.mark.parametrize("how", ["USR1 to mpiexec", "USR1 to every rank"])
def test_stop_signal_during_startup_stops_after_step_0_with_a_checkpoint(tmp_path, how):
    # each rank writes its pid file right after installing the stop handlers, before NumPy, mpi4py
    # (MPI_Init), planning and the Trainer: signalling then lands in the slow part of start-up
    proc = _start(tmp_path, _env(tmp_path))
    t0 = time.time()
    pids = [_rank_pid(tmp_path, r) for r in range(8)]
    if how == "USR1 to mpiexec":
        proc.send_signal(signal.SIGUSR1)
    else:
        for pid in pids:
            os.kill(pid, signal.SIGUSR1)
    signalled = time.time() - t0
    out, err, _ = _finish(proc, 120)
    assert proc.returncode == errors.EXIT_PREEMPTED, f"{out}\n{err}"
    assert "BAD TERMINATION" not in out + err
    assert f"stopped for a stop signal on 8 of 8 rank(s) (SIGUSR1 here) after step 1 of {STEPS}" in out, \
        f"signalled {signalled:.2f} s after launch:\n{out}"
    assert cf.read_latest(tmp_path / "ck") == f"run-0001/{cf.step_name(1)}"
    assert len(metrics_losses(tmp_path / "m.jsonl")) == 1
    assert wait_until_gone(str(tmp_path), 10) == []


def test_repeated_stop_signals_still_end_in_75(tmp_path):
    # the handlers used to be restored while the ranks shut down, so the 3rd or 4th signal killed a rank
    # (BAD TERMINATION, exit 10 or 15) although the checkpoint was complete
    proc = _start(tmp_path, _env(tmp_path, HPCPIPE_STEP_SLEEP="0.3"))
    _wait_for_steps(proc, tmp_path / "m.jsonl", 2)
    for _ in range(8):
        if proc.poll() is not None:
            break
        proc.send_signal(signal.SIGUSR1)
        time.sleep(0.15)
    out, err, _ = _finish(proc, 60)
    if launchers.chosen() != "openmpi":
        assert proc.returncode == errors.EXIT_PREEMPTED, err
    assert "BAD TERMINATION" not in out + err and "exit status 75" in out, out + err
    assert json.loads((tmp_path / "stop.json").read_text())["status"] == 75


def test_the_diverged_steps_are_numbered_as_the_progress_lines_that_skipped_them(tmp_path):
    """The console said 'step 2/20 ... SKIPPED' .. 'step 6/20 ... SKIPPED' and then 'steps 1..5' (the metrics'
    numbering), 'the parameters are still those from before step 1' (the console's step 2 made them)."""
    result = run(command(2, "hpcpipe.train", sets(parallel={"pp": 2}, train={"steps": 20, "lr": 1e30},
                                                    checkpoint={"dir": ""}, log={"progress": True})), timeout=120)
    assert result.returncode == errors.EXIT_DIVERGED, result.stderr
    skipped = [line.split("] step ")[1].split()[0] for line in result.stdout.splitlines() if "SKIPPED" in line]
    assert skipped == ["2/20", "3/20", "4/20", "5/20", "6/20"], result.stdout
    assert "5 steps in a row (steps 2..6, the metrics' \"step\" 1..5) had a non-finite loss or gradient " \
           "(train.max_bad_steps = 5); the parameters are still those after step 1;" in result.stderr, result.stderr
    assert "RuntimeWarning" not in result.stderr         # NumPy's overflow warnings named a line of nn/core


def test_a_run_that_diverges_from_its_first_step_says_its_parameters_are_the_starting_ones(tmp_path):
    """The first step already non-finite: the message said 'the parameters are still those after step 0'."""
    import h5py
    import numpy as np
    with h5py.File(tmp_path / "big.h5", "w") as f:
        f["x"] = np.full((32, 4), 1e30, np.float32)      # finite, but its squared error overflows float32
        f["y"] = np.zeros((32, 2), np.float32)
    result = run(command(2, "hpcpipe.train", sets(parallel={"pp": 2}, model={"dims": [4, 8, 2]},
                                                    data={"path": str(tmp_path / "big.h5")},
                                                    train={"steps": 10, "micro_batches": 2, "micro_batch_size": 2},
                                                    checkpoint={"dir": ""}, log={"progress": False})), timeout=120)
    assert result.returncode == errors.EXIT_DIVERGED, result.stderr
    assert "(steps 1..5, the metrics' \"step\" 0..4)" in result.stderr, result.stderr
    assert "the parameters are still those the run started with; no checkpoint written" in result.stderr
