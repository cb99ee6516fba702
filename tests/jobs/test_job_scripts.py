"""The Slurm batch scripts refuse a bad HPCPIPE_PP before any arithmetic or launch (no Slurm, no MPI needed), and
jobs/train.sbatch run with bash outside Slurm ends as a job would (no Slurm job id to ask about)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from support import ROOT

SCRIPTS = ["train.sbatch", "infer.sbatch", "serve.sbatch"]


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("pp", ["0", "-2", "abc", "3x", "", "PATH[$(touch {marker})]"])
def test_a_bad_pipeline_depth_is_exit_2_and_never_evaluated(tmp_path, script, pp):
    marker = tmp_path / "evaluated"
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "SLURM_NTASKS": "4", "HPCPIPE_WEIGHTS": "w.h5",
           "HPCPIPE_INPUT": "in.h5", "HPCPIPE_PP": pp.format(marker=marker),
           "HPCPIPE_LAUNCHER": str(tmp_path / "no-such-launcher")}
    result = subprocess.run(["bash", str(ROOT / "jobs" / script)], capture_output=True, text=True, env=env,
                            cwd=tmp_path, timeout=60, check=False)
    out = result.stdout + result.stderr
    if pp == "":          # empty means unset: the default depth 4 divides 4 tasks, so the script goes on
        assert "HPCPIPE_PP must be" not in out
        return
    assert result.returncode == 2, out
    assert f"HPCPIPE_PP must be a positive integer (pipeline stages); got '{env['HPCPIPE_PP']}'" in out
    assert "((" not in out and "syntax error" not in out      # refused before bash's arithmetic saw it
    assert not marker.exists()                               # was: the $(...) ran inside (( ))


@pytest.mark.parametrize("script", ["train.sbatch", "serve.sbatch"])
@pytest.mark.parametrize("tp,words", [("0", "HPCPIPE_TP must be a positive integer"),
                                      ("$(touch {marker})", "HPCPIPE_TP must be a positive integer"),
                                      ("3", "is not a multiple of HPCPIPE_PP=2 x HPCPIPE_TP=3")])
def test_a_bad_tensor_parallel_width_is_exit_2_and_never_evaluated(tmp_path, script, tp, words):
    marker = tmp_path / "evaluated"
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "SLURM_NTASKS": "4", "HPCPIPE_WEIGHTS": "w.h5",
           "HPCPIPE_PP": "2", "HPCPIPE_TP": tp.format(marker=marker),
           "HPCPIPE_LAUNCHER": str(tmp_path / "no-such-launcher")}
    result = subprocess.run(["bash", str(ROOT / "jobs" / script)], capture_output=True, text=True, env=env,
                            cwd=tmp_path, timeout=60, check=False)
    out = result.stdout + result.stderr
    assert result.returncode == 2 and words in out, out
    assert not marker.exists()


@pytest.mark.parametrize("script,given,knob", [
    ("train.sbatch", "--set parallel.pp=1", "use HPCPIPE_PP and HPCPIPE_TP"),
    ("train.sbatch", "--set=parallel.dp=2", "use HPCPIPE_PP and HPCPIPE_TP"),
    ("train.sbatch", '--set checkpoint.dir="myck"', "use HPCPIPE_CKPT_DIR"),
    ("serve.sbatch", "--set parallel.tp=2", "use HPCPIPE_PP and HPCPIPE_TP"),
    ("infer.sbatch", "--set parallel.pp=1", "use HPCPIPE_PP"),
])
def test_a_key_the_script_sets_itself_in_hpcpipe_args_is_refused(tmp_path, script, given, knob):
    """HPCPIPE_ARGS="--set parallel.pp=1 --set checkpoint.dir=..." ran at pp = 4 into checkpoints/<job name>:
    the script's own --set came last and won without a word."""
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "SLURM_NTASKS": "4", "HPCPIPE_WEIGHTS": "w.h5",
           "HPCPIPE_INPUT": "in.h5", "HPCPIPE_ARGS": f"--set train.steps=2 {given}",
           "HPCPIPE_LAUNCHER": str(tmp_path / "no-such-launcher")}
    result = subprocess.run(["bash", str(ROOT / "jobs" / script)], capture_output=True, text=True, env=env,
                            cwd=tmp_path, timeout=60, check=False)
    out = result.stdout + result.stderr
    key = given.split()[-1].removeprefix("--set=")
    assert result.returncode == 2 and f"HPCPIPE_ARGS sets {key}, which this script sets" in out and knob in out, out
    assert "HPCPIPE_LAUNCHER must be" not in out          # refused before the launch is even prepared


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_expansion_of_an_array_that_may_be_empty_is_guarded_for_bash_before_4_4(script):
    """Under set -u bash before 4.4 (RHEL/CentOS 7 ship 4.2) stops at "${A[@]}" of an empty array ("A[@]: unbound
    variable"): the scripts expanded GIVEN (empty without HPCPIPE_ARGS) and train's RESUME (empty without a
    resume) that way, so a plain `sbatch jobs/train.sbatch` failed there at once. No bash 4.3 is at hand to run
    them, so the rule is read off the text: every array the script empties or reads into is expanded as
    ${A[@]+"${A[@]}"} (the same words in every bash)."""
    text = (ROOT / "jobs" / script).read_text()
    assert "set -u" in text
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    arrays = set(re.findall(r"\b(\w+)=\(\)", code)) | set(re.findall(r"read -r?a (\w+)", code))
    assert "GIVEN" in arrays
    for name in sorted(arrays):
        for match in re.finditer(r"\$\{" + name + r"\[[@*]\](?!\+)", code):    # not the guard's own test
            before = code[max(0, match.start() - len(name) - 8):match.start()]
            assert before.endswith(f"${{{name}[@]+\"") or before.endswith(f"${{{name}[*]+\""), \
                (name, code[match.start() - 20:match.end() + 20])


@pytest.mark.parametrize("script,knobs,layout", [
    ("train.sbatch", {"HPCPIPE_PP": "2", "HPCPIPE_TP": "2"}, "(dp=2 x pp=2 x tp=2)"),
    ("serve.sbatch", {"HPCPIPE_PP": "1", "HPCPIPE_TP": "4"}, "(dp=2 x pp=1 x tp=4)"),
])
def test_the_launch_line_states_the_layout_with_tensor_parallelism(tmp_path, script, knobs, layout):
    """With HPCPIPE_TP = 2 the line said dp=4 x pp=2 for 8 tasks (tasks / pp), twice the replicas that ran."""
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "SLURM_NTASKS": "8", "HPCPIPE_WEIGHTS": "w.h5",
           "HPCPIPE_LAUNCHER": str(tmp_path / "mpiexec"), **knobs}    # no such file: the launch itself fails
    result = subprocess.run(["bash", str(ROOT / "jobs" / script)], capture_output=True, text=True, env=env,
                            cwd=tmp_path, timeout=60, check=False)
    out = result.stdout + result.stderr
    assert layout in out and "unbound variable" not in out, out


@pytest.mark.parametrize("knob,value", [("HPCPIPE_RESUME", "true"), ("HPCPIPE_RESUME", "yes"),
                                         ("HPCPIPE_REQUEUE", "yes"), ("HPCPIPE_REQUEUE", "true")])
def test_a_resume_or_requeue_knob_outside_its_values_is_refused(tmp_path, knob, value):
    """HPCPIPE_RESUME=true started a fresh run beside the checkpoint (only "1" resumed), HPCPIPE_REQUEUE=yes
    never requeued (only "1" did); both without a word."""
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "SLURM_NTASKS": "4", knob: value,
           "HPCPIPE_LAUNCHER": str(tmp_path / "mpiexec")}     # no such file: a launch would fail, not hang
    result = subprocess.run(["bash", str(ROOT / "jobs" / "train.sbatch")], capture_output=True, text=True, env=env,
                            cwd=tmp_path, timeout=60, check=False)
    out = result.stdout + result.stderr
    assert result.returncode == 2 and f"{knob} must be" in out and f"got '{value}'" in out, out
    assert "python -m hpcpipe.train" not in out          # refused before the launch


def test_train_script_outside_slurm_finishes_and_stops_cleanly(tmp_path):
    """Run with bash outside Slurm (no job id): a finished run exits 0, a stop on SIGUSR1 exits 75 with its
    checkpoint, and neither says anything about an unbound SLURM_JOB_ID (the script asked scontrol about it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    # the task count as a user states it; the launcher beside this Python (the venv's mpiexec)
    env.update({"SLURM_NTASKS": "2", "HPCPIPE_PP": "2", "HOME": str(tmp_path), "PYTHONPATH": str(ROOT / "src"),
                "HPCPIPE_CKPT_DIR": str(tmp_path / "ck"), "HPCPIPE_ARGS": "--set train.steps=2",
                "PATH": os.path.dirname(sys.executable) + os.pathsep + env["PATH"]})
    done = subprocess.run(["bash", str(ROOT / "jobs" / "train.sbatch")], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300, check=False)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "unbound variable" not in out and "training exited with status 0" in out
    env["HPCPIPE_ARGS"] = "--set train.steps=100000 --set checkpoint.every=1000000"
    log = tmp_path / "stop.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(["bash", str(ROOT / "jobs" / "train.sbatch")], stdout=f, stderr=subprocess.STDOUT,
                                text=True, env=env, cwd=tmp_path, start_new_session=True)
        try:
            deadline = time.time() + 240
            while "step" not in log.read_text().split("python -m hpcpipe.train", 1)[-1] and time.time() < deadline:
                assert proc.poll() is None, log.read_text()
                time.sleep(0.5)
            proc.send_signal(signal.SIGUSR1)
            assert proc.wait(240) == 75, log.read_text()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    out = log.read_text()
    assert "unbound variable" not in out, out
    assert "not a Slurm job: nothing to requeue; run again with HPCPIPE_RESUME=1 to continue" in out, out
