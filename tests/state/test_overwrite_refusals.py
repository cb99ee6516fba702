"""End-to-end: the second round of attacks on checkpoints, logs and exports (issue #11 follow-up).

Each case was found by trying to make hpcpipe overwrite or delete what it did not create; each is
now refused before step 0 (exit 2) with the files intact, or works without touching them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import h5py
import numpy as np
from support.configs import merged, sets
from support.launch import command, one_error, run, train
from support.state import file_tree

from hpcpipe.state import directory_protocol as cf

TINY = {"model": {"dims": [8, 8, 8, 8]}, "parallel": {"dp": 1, "pp": 2},
        "data": {"synthetic_samples": 32}, "log": {"progress": False},
        "train": {"steps": 4, "micro_batches": 2, "micro_batch_size": 2, "optimizer": "adam"},
        "checkpoint": {"every": 2, "keep": 5}}


def _train(ck_dir, *more, **extra):
    """Train TINY on 2 ranks with checkpoint.dir = ck_dir; extra sections are merged key by key into TINY's."""
    return train(2, merged(TINY, extra, {"checkpoint": {"dir": str(ck_dir)}}), *more)


def test_checkpoint_dir_that_is_a_step_or_another_runs_directory_is_refused(tmp_path):
    root = tmp_path / "ck"
    assert _train(root).returncode == 0
    before = file_tree(root)
    step_dir = root / cf.read_latest(root)
    one_error(_train(step_dir, "--resume"), "is a checkpoint step directory")       # once deleted its own source
    one_error(_train(step_dir), "is a checkpoint step directory")
    one_error(_train(root / "run-0001"), "is a run directory of", "--resume")        # would nest a run inside it
    assert file_tree(root) == before


def test_resume_never_overwrites_a_later_step_of_its_run(tmp_path):
    root = tmp_path / "ck"
    assert _train(root).returncode == 0                                             # steps 2, 4
    assert _train(root / "run-0001", "--resume", train={"steps": 6}).returncode == 0
    assert cf.read_latest(root) == "run-0001/step-00000006"                        # the root follows
    (root / cf.LATEST).write_text("run-0001/step-00000004\n")                       # pointers left behind
    (root / "run-0001" / cf.LATEST).write_text("step-00000004\n")   # the root's alone is followed (test_root_pointers)
    before = file_tree(root / "run-0001")
    one_error(_train(root, "--resume", train={"steps": 8}), "already holds step-00000006", "would overwrite",
              "names step-00000004 (moved back by hand?): to continue step-00000006, write that name into it")
    assert file_tree(root / "run-0001") == before


def test_training_logs_never_overwrite_what_the_run_reads(tmp_path):
    root = tmp_path / "ck"
    assert _train(root).returncode == 0
    data = tmp_path / "d.h5"
    with h5py.File(data, "w") as f:
        f["x"] = np.ones((32, 8), np.float32)
        f["y"] = np.ones((32, 8), np.float32)
    other = tmp_path / "other"
    before, data_bytes = file_tree(root), data.read_bytes()
    step_file = str(root / cf.read_latest(root) / "stage-000.h5")
    cases = [
        ({"data": {"path": str(data)}, "log": {"trace": str(data)}}, "the data file"),
        ({"model": {"init": str(root)}, "log": {"metrics": step_file}}, "the checkpoint directory"),
        ({"log": {"trace": str(root / cf.LATEST)}}, "the checkpoint pointer"),
        ({"log": {"trace": str(tmp_path / "t.json"), "metrics": str(tmp_path / "t.json")}}, "are the same file"),
    ]
    for extra, words in cases:
        one_error(_train(other, **extra), words)
    assert file_tree(root) == before and data.read_bytes() == data_bytes and not other.exists()


def test_export_and_infer_never_write_over_the_pointers_of_the_checkpoint_they_read(tmp_path):
    root = tmp_path / "ck"
    assert _train(root).returncode == 0
    step_dir = root / cf.read_latest(root)
    before = file_tree(root)
    for out in (root / cf.LATEST, root / "run-0001" / cf.LATEST, tmp_path, f"{tmp_path}/sub/"):
        result = run([sys.executable, "-m", "hpcpipe.checkpoint", "export", str(step_dir), str(out)])
        assert result.returncode == 2 and result.stderr.count("error:") == 1, (out, result.stderr)
    x = tmp_path / "in.h5"
    with h5py.File(x, "w") as f:
        f["x"] = np.ones((8, 8), np.float32)
    result = run(command(2, "hpcpipe.infer", ["--weights", str(step_dir), "--input", str(x), "--output",
                                               str(root / cf.LATEST), "--set", "parallel.pp=2"]))
    assert result.returncode == 2 and "hpcpipe: error:" in result.stderr, result.stderr
    assert file_tree(root) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]          # no temporary left behind


def test_outputs_never_land_on_a_stage_file_that_lives_elsewhere(tmp_path):
    """A stage file may be a symlink to, or a hard link of, a file outside the checkpoint's directories."""
    root = tmp_path / "ck"
    assert _train(root).returncode == 0
    step_dir = root / cf.read_latest(root)
    stage_files = sorted(p for p in step_dir.iterdir() if p.suffix == ".h5")
    outside, linked = tmp_path / "outside.h5", tmp_path / "linked.h5"
    stage_files[0].rename(outside)
    stage_files[0].symlink_to(outside)
    os.link(stage_files[1], linked)
    assert run([sys.executable, "-m", "hpcpipe.checkpoint", "verify", str(root)]).returncode == 0
    before = {p: p.read_bytes() for p in (outside, linked)}
    x = tmp_path / "in.h5"
    with h5py.File(x, "w") as f:
        f["x"] = np.ones((8, 8), np.float32)
    for out in (outside, linked):
        result = run([sys.executable, "-m", "hpcpipe.checkpoint", "export", str(root), str(out)])
        assert result.returncode == 2 and result.stderr.count("error:") == 1, result.stderr
        assert "is a file of the checkpoint" in result.stderr, result.stderr
        result = run(command(2, "hpcpipe.infer", ["--weights", str(root), "--input", str(x), "--output", str(out),
                                                   "--set", "parallel.pp=2"]))
        assert result.returncode == 2 and "is a file of the checkpoint" in result.stderr, result.stderr
    assert {p: p.read_bytes() for p in (outside, linked)} == before
    assert run([sys.executable, "-m", "hpcpipe.checkpoint", "verify", str(root)]).returncode == 0


def test_a_second_run_into_a_run_directory_in_use_is_refused_before_step_0(tmp_path):
    """Two jobs resuming one checkpoint at once deleted and replaced each other's checkpoints, both exit 0."""
    root = tmp_path / "ck"
    assert _train(root).returncode == 0
    sections = {name: dict(values) for name, values in TINY.items()}
    sections["checkpoint"].update(dir=str(root), every=1)
    sections["train"]["steps"] = 12
    env = dict(os.environ, HPCPIPE_STEP_SLEEP="0.25", PYTHONUNBUFFERED="1")
    first = subprocess.Popen(command(2, "hpcpipe.train", sets(**sections) + ["--resume"]), env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (root / "run-0001" / cf.step_name(5)).is_dir():        # the first one is saving by now
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.05)
        second = run(command(2, "hpcpipe.train", sets(**sections) + ["--resume", "--set", "train.lr=0.5"]),
                     timeout=120)
        one_error(second, f"the run directory '{root / 'run-0001'}' is in use by another run (pid ")
        out, err = first.communicate(timeout=120)
    finally:
        first.kill()
    assert first.returncode == 0, err
    assert run([sys.executable, "-m", "hpcpipe.checkpoint", "verify", str(root), "--all"]).returncode == 0
    assert cf.read_latest(root) == f"run-0001/{cf.step_name(12)}"
    # the lock dies with its run: resuming afterwards works
    sections["train"]["steps"] = 13
    assert run(command(2, "hpcpipe.train", sets(**sections) + ["--resume"]), timeout=120).returncode == 0


def test_checkpoint_info_into_a_reader_that_left_stops_quietly(tmp_path):
    root = tmp_path / "ck"
    assert _train(root).returncode == 0
    # `true` leaves before the info is written (Python takes longer to start): the write finds no reader
    line = f"{sys.executable} -m hpcpipe.checkpoint info {root} | true"
    proc = subprocess.run(["bash", "-o", "pipefail", "-c", line], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 141 and proc.stderr == "", proc.stderr      # was: "error: [Errno 32] Broken pipe"


def test_a_latest_that_is_a_directory_is_refused_before_step_0(tmp_path):
    root = tmp_path / "ck"
    (root / cf.LATEST).mkdir(parents=True)
    (root / cf.LATEST / "mine.txt").write_text("keep me")
    one_error(_train(root, checkpoint={"every": 0}), "is not a file")
    assert (root / cf.LATEST / "mine.txt").read_text() == "keep me"


def test_steps_past_99999999_name_readable_checkpoints():
    assert cf.step_name(100_000_000) == "step-100000000"
    assert cf.step_of_dir_name("step-100000000") == (100_000_000, True)


def test_config_that_is_not_a_regular_file_is_refused_without_reading_it(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, words in ((fifo, "is not a regular file"), ("/dev/zero", "is not a regular file")):
        result = run(command(2, "hpcpipe.train", ["--config", str(path)]), timeout=60)
        one_error(result, words)


def test_export_and_import_into_a_folder_that_refuses_files_are_one_line_exit_2(tmp_path):
    # as root /proc passes the permission bits: export was "hpcpipe: error: [Errno 2] No such file or directory:
    # '/proc/.x.tmp-...'", status 1 (after reading the checkpoint), for a weights file and --format hf alike
    from support.serve import make_weights
    weights = tmp_path / "w.h5"
    make_weights(weights)
    cases = {("export", str(weights), "/proc/hpcpipe-x.h5"): "cannot create a file in '/proc'",
             ("export", str(weights), "/proc/hpcpipe-x", "--format", "hf"): "cannot create a directory in '/proc'",
             ("import", str(tmp_path), "/proc/hpcpipe-x.h5"): "import output '/proc/hpcpipe-x.h5': cannot create"}
    for argv, words in cases.items():
        result = run([sys.executable, "-m", "hpcpipe.checkpoint", *argv])
        assert words in one_error(result), argv
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.h5"]
