"""One stage's file of a checkpoint given where a whole model belongs (generate --weights, train's model.init) is
named as such with the step directory to pass (a new-user run: "has layers [0, 1, 2] but the model has 6 layer
groups", which did not say what the file was)."""

from __future__ import annotations

import pytest
from support.launch import one_error, run_command, run_module, train


@pytest.fixture(scope="module")
def step_dir(tmp_path_factory):
    """A tiny GPT trained 2 steps at pp = 2: a step directory with two stages' files."""
    tmp = tmp_path_factory.mktemp("stage-file")
    proc = train(2, {"model": {"kind": "gpt"}, "parallel": {"pp": 2, "dp": 1}, "train": {"steps": 2},
                     "checkpoint": {"every": 2, "dir": str(tmp / "ck")}})
    assert proc.returncode == 0, proc.stderr
    found = sorted((tmp / "ck").glob("run-*/step-*"))
    assert len(found) == 1 and (found[0] / "stage-001.h5").is_file(), found
    return found[0]


@pytest.mark.parametrize("stage", ["stage-000.h5", "stage-001.h5"])
def test_generate_names_a_stage_file(step_dir, stage):
    proc = run_module("hpcpipe.generate", "--weights", step_dir / stage, "--prompt", "hi", "--max-new-tokens", "2")
    one_error(proc, "one stage's file of the checkpoint", "--weights reads a whole model",
              f"pass the step directory {str(step_dir)!r}")


def test_model_init_names_a_stage_file(step_dir, tmp_path):
    proc = run_command(1, "hpcpipe.train", ["--set", 'model.kind="gpt"', "--set", "parallel.pp=1", "--set",
                                            "parallel.dp=1", "--set", "train.steps=1", "--set", 'checkpoint.dir=""',
                                            "--set", f'model.init="{step_dir / "stage-000.h5"}"'], cwd=tmp_path)
    one_error(proc, "one stage's file of the checkpoint", "model.init reads a whole model", str(step_dir))


def test_verify_checks_one_stage_file(step_dir, tmp_path):
    """verify of one stage's file checks it against its step's manifest and reads its layers (it said "has layers
    [3, 4, 5] but the model has 6 layer groups", exit 1, of a good file); alone, its layers' shapes and data."""
    import shutil

    import h5py
    ok = run_module("hpcpipe.checkpoint", "verify", step_dir / "stage-001.h5")
    assert ok.returncode == 0, ok.stderr
    assert "layers [3, 4, 5] of 6, one stage's file of the checkpoint" in ok.stdout, ok.stdout
    alone = tmp_path / "alone.h5"
    shutil.copy(step_dir / "stage-001.h5", alone)
    ok = run_module("hpcpipe.checkpoint", "verify", alone)
    assert ok.returncode == 0 and "layers [3, 4, 5] of 6, not a whole model" in ok.stdout, (ok.stdout, ok.stderr)
    bad = tmp_path / "bad"
    shutil.copytree(step_dir, bad)
    with h5py.File(bad / "stage-001.h5", "r+") as f:
        f["layers/0004/attn/proj/bias"][0] += 1.0
    one_error(run_module("hpcpipe.checkpoint", "verify", bad / "stage-001.h5"), "fails its SHA-256 check", code=1)


def test_verify_names_a_file_its_step_directory_does_not_list(step_dir, tmp_path):
    """A stage file copied into a step directory under another name is no file of that checkpoint: verify said so
    with a StopIteration traceback (the manifest lookup had no default)."""
    import shutil
    copy = tmp_path / "copy"
    shutil.copytree(step_dir, copy)
    shutil.copy(copy / "stage-001.h5", copy / "backup.h5")
    one_error(run_module("hpcpipe.checkpoint", "verify", copy / "backup.h5"), "does not list it",
              f"verify the step directory {str(copy)!r}", code=1)
