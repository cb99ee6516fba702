"""End-to-end: the real `mpiexec -n 8 python -m hpcpipe.train` and `python -m hpcpipe.checkpoint` commands.

Crash with kill -9 and resume bit-exactly, crash in the middle of a save,
corrupt checkpoints refused naming the file, and the digits example.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import ROOT
from support.configs import merged, sets
from support.launch import command, pids_alive, run, train, wait_until_gone
from support.state import (
    assert_nested_equal,
    checkpoint_cli,
    checkpoint_state,
    flip_byte_in_dataset,
    metrics_losses,
    small_tmpfs,
)

from hpcpipe.state import directory_protocol as cf

pytestmark = pytest.mark.slow

STEPS = 12
TINY = {"model": {"dims": [8, 8, 8, 8, 8]},
        "data": {"synthetic_samples": 40, "shuffle": True},   # 40 / (2 x 2 x 2) = 5 steps per epoch
        "train": {"steps": STEPS, "micro_batches": 2, "micro_batch_size": 2, "optimizer": "adam", "lr": 0.01},
        "checkpoint": {"every": 2, "keep": 2}, "log": {"progress": False}}


def _sections(ck_dir: Path, metrics: Path, **extra) -> dict:
    return merged(TINY, {"checkpoint": {"dir": str(ck_dir)}, "log": {"metrics": str(metrics)}}, extra)


def _train(ck_dir, metrics, *more, env=None, timeout=180, **extra):
    return train(8, _sections(ck_dir, metrics, **extra), *more, env=env, timeout=timeout)


RUN = "run-0001"          # a fresh run's directory under checkpoint.dir


def _latest_step(ck_dir: Path) -> int | None:
    """The step ck_dir/latest names (it names run-NNNN/step-NNNNNNNN), None when there is none yet."""
    name = cf.read_latest(ck_dir)
    return None if name is None else int(name.rsplit("step-", 1)[1])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 12-step run at dp=2 x pp=4: (checkpoint dir, {step: loss})."""
    base = tmp_path_factory.mktemp("reference")
    result = _train(base / "ck", base / "m.jsonl")
    assert result.returncode == 0, result.stderr
    return base / "ck", metrics_losses(base / "m.jsonl")


def _assert_same_as_reference(reference, ck_dir, metrics):
    ref_dir, ref_losses = reference
    assert metrics_losses(metrics) == ref_losses          # every step's loss, bit for bit
    assert cf.read_latest(ck_dir) == f"{RUN}/{cf.step_name(STEPS)}"    # resumed into the same run directory
    assert cf.run_dirs(ck_dir) == [ck_dir / RUN]
    ref_params, ref_opt = checkpoint_state(ref_dir)
    params, opt = checkpoint_state(ck_dir)
    assert_nested_equal(params, ref_params)
    assert_nested_equal(opt, ref_opt)


def test_kill_9_one_rank_then_resume_is_bit_identical(reference, tmp_path):
    ck_dir, metrics, pid_dir = tmp_path / "ck", tmp_path / "m.jsonl", tmp_path / "pids"
    pid_dir.mkdir()
    env = dict(os.environ, HPCPIPE_PID_DIR=str(pid_dir), HPCPIPE_STEP_SLEEP="0.3")
    proc = subprocess.Popen(command(8, "hpcpipe.train", sets(**_sections(ck_dir, metrics))), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        deadline = time.time() + 120
        while _latest_step(ck_dir) != 4 and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None, "the run ended before it could be killed"
        victim = int((pid_dir / "rank-5.pid").read_text())
        killed_at = time.time()
        os.kill(victim, signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode != 0
    # the whole job (mpiexec, its proxies, the 7 other ranks) is gone within 30 s of the kill
    left = wait_until_gone(str(tmp_path), 30 - (time.time() - killed_at))
    # a rank that is still exiting has an empty cmdline but is not yet a zombie: wait for it within the 30 s too
    alive = pids_alive(pid_dir)
    while alive and time.time() - killed_at < 30:
        time.sleep(0.1)
        alive = pids_alive(pid_dir)
    assert left == [] and alive == [], f"left behind after the kill: {left} {alive}"
    assert time.time() - killed_at < 30
    crashed_at = _latest_step(ck_dir)
    assert crashed_at is not None and 4 <= crashed_at < STEPS
    assert 0 < len(metrics_losses(metrics)) < STEPS

    result = _train(ck_dir, metrics, "--resume")
    assert result.returncode == 0, result.stderr
    assert f"resumed at step {crashed_at}" in result.stdout
    _assert_same_as_reference(reference, ck_dir, metrics)


@pytest.mark.parametrize("point, rank", [("write", 2), ("commit", 0)])
def test_crash_during_save_leaves_latest_complete(reference, tmp_path, point, rank):
    ck_dir, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    env = {"HPCPIPE_CRASH_IN_SAVE": f"step=6,rank={rank},point={point}"}
    result = _train(ck_dir, metrics, env=env)
    assert result.returncode != 0
    run_dir = ck_dir / RUN
    assert _latest_step(ck_dir) == 4 and cf.read_latest(run_dir) == cf.step_name(4)
    assert (run_dir / cf.tmp_name(6)).is_dir()                         # the interrupted save is left over ...
    assert not (run_dir / cf.step_name(6)).exists()
    verified = checkpoint_cli("verify", ck_dir)
    assert verified.returncode == 0 and "step 4" in verified.stdout, verified.stderr   # ... and ignored
    assert "leftover" in checkpoint_cli("info", ck_dir).stdout

    result = _train(ck_dir, metrics, "--resume")
    assert result.returncode == 0, result.stderr
    assert "resumed at step 4" in result.stdout
    assert cf.leftovers(run_dir) == []                                  # cleaned
    assert cf.committed_steps(run_dir) == [10, 12]                      # keep = 2
    _assert_same_as_reference(reference, ck_dir, metrics)


def _corrupt_truncate(step_dir):
    path = step_dir / "stage-001.h5"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return "stage-001.h5", "truncated"


def _corrupt_flip(step_dir):
    flip_byte_in_dataset(step_dir / "stage-002.h5", "optimizer/layers/0002/exp_avg/weight")
    return "stage-002.h5", "SHA-256"


def _corrupt_missing(step_dir):
    (step_dir / "stage-003.h5").unlink()
    return "stage-003.h5", "missing"


def _corrupt_foreign(step_dir):
    other = step_dir.parent / cf.step_name(10) / "stage-000.h5"      # same run, another step
    shutil.copy(other, step_dir / "stage-000.h5")
    return "stage-000.h5", "SHA-256"


def _corrupt_manifest(step_dir):
    (step_dir / cf.MANIFEST).write_text('{"format": "hpcpipe-checkpoint", "form')
    return "manifest.json", "not valid JSON"


CORRUPTIONS = {"truncated": _corrupt_truncate, "bit-flipped": _corrupt_flip, "missing": _corrupt_missing,
               "foreign": _corrupt_foreign, "manifest": _corrupt_manifest}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_verify_refuses_each_corruption_naming_the_file(reference, tmp_path, case):
    ck_dir = tmp_path / "ck"
    shutil.copytree(reference[0], ck_dir)
    name, reason = CORRUPTIONS[case](ck_dir / RUN / cf.step_name(STEPS))
    result = checkpoint_cli("verify", ck_dir)
    assert result.returncode == 1
    assert name in result.stderr and reason in result.stderr, result.stderr
    export = checkpoint_cli("export", ck_dir, tmp_path / "out.h5")
    assert export.returncode == 1 and name in export.stderr and not (tmp_path / "out.h5").exists()


@pytest.mark.parametrize("case", ["bit-flipped", "missing"])
def test_resume_refuses_corruption_with_one_message_and_no_hang(reference, tmp_path, case):
    ck_dir = tmp_path / "ck"
    shutil.copytree(reference[0], ck_dir)
    name, reason = CORRUPTIONS[case](ck_dir / RUN / cf.step_name(STEPS))
    result = _train(ck_dir, tmp_path / "m.jsonl", "--resume", timeout=120, train={"steps": 16})
    assert result.returncode == 2, result.stderr
    assert result.stderr.count(name) == 1 and reason in result.stderr, result.stderr   # one rank prints
    assert not (tmp_path / "m.jsonl").exists()                                         # nothing trained


def test_export_and_info_and_init_from_exported_file(reference, tmp_path):
    ref_dir, _ = reference
    out = tmp_path / "all.h5"
    result = checkpoint_cli("export", ref_dir, out)
    assert result.returncode == 0, result.stderr
    import h5py
    with h5py.File(out) as f:
        assert sorted(f["layers"]) == ["0000", "0001", "0002", "0003"] and f.attrs["step"] == STEPS
    info = checkpoint_cli("info", ref_dir)
    assert "step 12" in info.stdout and "dp=2 pp=4" in info.stdout and "stage-003.h5" in info.stdout
    # a run at another layout initialised from the exported file starts from exactly those weights:
    # its first loss equals a sequential NumPy forward of the exported weights on batch 0
    metrics = tmp_path / "m.jsonl"
    result = _train(tmp_path / "ck2", metrics, model={"init": str(out)}, parallel={"pp": 2}, train={"steps": 1})
    assert result.returncode == 0, result.stderr
    import numpy as np

    from hpcpipe.config import from_dict
    from hpcpipe.evaluate import forward
    from hpcpipe.state.sources import resolve_weights
    from hpcpipe.train.data import SyntheticData, step_samples
    cfg = from_dict({k: v for k, v in TINY.items() if k in ("model", "data", "train")})
    source = resolve_weights(out)
    data = SyntheticData(cfg)
    idx = step_samples(0, 16, len(data), True, 0)   # dp = 4 at pp = 2: 4 x 2 x 2 samples
    pred = forward(source.read([0, 1, 2, 3]), source.model, data.read_x(idx))
    expected = float(np.mean((pred.astype(np.float64) - data.read_y(idx)) ** 2))
    assert abs(metrics_losses(metrics)[0] - expected) < 1e-5 * expected


def test_bad_init_file_is_a_clear_error(tmp_path):
    import numpy as np

    from hpcpipe.state.weights import write_weights
    bad = tmp_path / "w.h5"
    write_weights(bad, {i: {"weight": np.zeros((8, 8), np.float32), "bias": np.zeros(8, np.float32)}
                        for i in range(3)}, n_layers=3)
    result = _train(tmp_path / "ck", tmp_path / "m.jsonl", model={"init": str(bad)}, timeout=60)
    assert result.returncode == 2
    assert "w.h5" in result.stderr and "holds 3 layers" in result.stderr and result.stderr.count("error") == 1


@pytest.fixture
def tmpfs(tmp_path):
    """A 200 KiB tmpfs mounted at tmp_path/full (root only), unmounted afterwards."""
    with small_tmpfs(tmp_path / "full", "200k") as mnt:
        yield mnt


def test_disk_full_during_a_checkpoint_is_one_message_exit_1_and_cleaned(tmpfs, tmp_path):
    """Issue #11: a 200 KiB checkpoint.dir with every = 1 segfaulted (exit 11) after h5py tracebacks."""
    wide = {"checkpoint": {"every": 1}}   # about 130 KiB a checkpoint: the second does not fit
    result = _train(tmpfs, tmp_path / "m.jsonl", timeout=120, **wide)
    assert result.returncode == 1, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if not line.startswith("hpcpipe: warning:")]
    assert len(errors) == 1, result.stderr                       # one line: no tracebacks, no HDF5 noise
    # said before step 0: two checkpoints kept plus the one being written do not fit
    assert len(lines) == 2 and "a later save may not fit" in lines[0], result.stderr
    assert f"checkpoint.dir '{tmpfs}' has " in errors[0] and "free, the checkpoint of step 2 needs about" in errors[0]
    assert "step-00000001 is kept" in errors[0]
    run_dir = tmpfs / RUN
    # the partial save is gone (a .lock file may stay: the lock itself died with the run, see state/run_lock.py)
    assert cf.leftovers(run_dir) == [] and [p.name for p in run_dir.iterdir()] \
        and not any(p.name.startswith(".") and p.name != ".lock" for p in run_dir.iterdir())
    assert cf.read_latest(tmpfs) == f"{RUN}/{cf.step_name(1)}"          # the previous latest is kept ...
    verified = checkpoint_cli("verify", tmpfs)
    assert verified.returncode == 0 and "step 1" in verified.stdout       # ... and complete


def test_a_checkpoint_dir_too_small_for_one_checkpoint_is_refused_before_step_0(tmpfs, tmp_path):
    """A 2 MiB directory for a 3 MiB checkpoint was found only at the first save, after the whole run."""
    wide = {"model": {"dims": [128, 128, 128, 128, 128]}, "train": {"optimizer": "adam"}}   # about 780 KiB
    result = _train(tmpfs, tmp_path / "m.jsonl", timeout=120, **wide)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("hpcpipe: error:") == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"checkpoint.dir '{tmpfs}' has " in result.stderr and "nothing was trained" in result.stderr
    assert "step 1/" not in result.stdout and list(tmpfs.iterdir()) == []


@pytest.mark.parametrize("case", ["file", "parent-file", "read-only"])
def test_unusable_checkpoint_dir_is_refused_before_step_0(tmp_path, case):
    """Issue #11: a checkpoint.dir that is a file or read-only failed only after every step had run."""
    blocker = tmp_path / "afile"
    blocker.write_text("not a directory")
    target = {"file": blocker, "parent-file": blocker / "ck", "read-only": tmp_path / "ro" / "ck"}[case]
    if case == "read-only":   # root ignores permission bits: a read-only file system then
        (tmp_path / "ro").mkdir(mode=0o555)
        mount = ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(tmp_path / "ro")]
        if os.geteuid() == 0 and subprocess.run(mount, capture_output=True, check=False).returncode != 0:
            pytest.skip("cannot mount a read-only tmpfs as root here")
    try:
        result = _train(target, tmp_path / "m.jsonl", timeout=60)
    finally:
        if case == "read-only" and os.geteuid() == 0:
            subprocess.run(["umount", "-l", str(tmp_path / "ro")], capture_output=True, check=False)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("hpcpipe: error:") == 1 and "checkpoint.dir" in result.stderr, result.stderr
    assert str(target) in result.stderr
    assert not (tmp_path / "m.jsonl").exists()                      # refused before step 0
    assert blocker.read_text() == "not a directory"


def test_digits_example_reaches_95_percent_held_out(tmp_path):
    pytest.importorskip("sklearn")
    data = tmp_path / "data"
    made = run([sys.executable, "examples/digits_to_hdf5.py", "--out", str(data)], timeout=120)
    assert made.returncode == 0, made.stderr
    ck_dir = tmp_path / "ck"
    result = run(command(8, "hpcpipe.train", ["--config", "configs/digits.toml"] + sets(
        data={"path": str(data / "digits-train.h5")}, checkpoint={"dir": str(ck_dir)},
        log={"progress": False})), timeout=300)
    assert result.returncode == 0, result.stderr
    evaluated = run([sys.executable, "-m", "hpcpipe.evaluate", "--weights", str(ck_dir), "--data",
                     str(data / "digits-test.h5")], timeout=60)
    assert evaluated.returncode == 0, evaluated.stderr
    import json
    report = json.loads(evaluated.stdout)
    print(f"digits held-out accuracy {report['accuracy']:.4f} on {report['n']} images")
    assert report["n"] == 360 and report["accuracy"] > 0.95
