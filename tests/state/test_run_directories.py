"""End-to-end: run directories under checkpoint.dir, resume rules, and the checkpoint CLI on weights files.

Issue #11: a fresh run pruned or shadowed checkpoints it did not write; --resume accepted manifests
verify rejects; --resume of a finished run printed nan; `checkpoint info W.h5` said "does not exist".
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from support import DATA
from support.configs import merged, sets
from support.launch import command, run, train
from support.state import checkpoint_cli, file_tree, flip_byte_in_dataset

from hpcpipe.state import directory_protocol as cf

TINY = {"model": {"dims": [8, 8, 8, 8]}, "parallel": {"dp": 1, "pp": 2},
        "data": {"synthetic_samples": 32}, "log": {"progress": False},
        "train": {"steps": 4, "micro_batches": 2, "micro_batch_size": 2, "optimizer": "adam"},
        "checkpoint": {"every": 1, "keep": 1}}


def _train(ck_dir: Path, *more: str, cwd=None, **extra):
    """Train TINY on 2 ranks with checkpoint.dir = ck_dir; extra sections are merged key by key into TINY's."""
    return train(2, merged(TINY, {"checkpoint": {"dir": str(ck_dir)}}, extra), *more, cwd=cwd)


def test_two_fresh_runs_keep_their_checkpoints_and_resume_continues_the_newer(tmp_path):
    root = tmp_path / "ck"
    first = _train(root, train={"steps": 4})
    assert first.returncode == 0, first.stderr
    run1 = file_tree(root / "run-0001")
    second = _train(root, model={"dims": [8, 6, 6, 8]}, train={"steps": 3})   # another config, same root
    assert second.returncode == 0, second.stderr
    assert "checkpoint(s) to" in second.stdout and "run-0002" in second.stdout
    assert file_tree(root / "run-0001") == run1                              # untouched: nothing pruned or replaced
    assert cf.committed_steps(root / "run-0001") == [4] and cf.committed_steps(root / "run-0002") == [3]
    assert cf.read_latest(root) == "run-0002/step-00000003" and cf.read_latest(root / "run-0001") == "step-00000004"

    resumed = _train(root, "--resume", model={"dims": [8, 6, 6, 8]}, train={"steps": 5})
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed at step 3" in resumed.stdout
    assert cf.committed_steps(root / "run-0002") == [5] and cf.read_latest(root) == "run-0002/step-00000005"
    assert file_tree(root / "run-0001") == run1 and cf.run_dirs(root) == [root / "run-0001", root / "run-0002"]
    manifest = json.loads((root / "run-0002" / "step-00000005" / cf.MANIFEST).read_text())
    assert manifest["run"] == "run-0002"

    # --resume follows ROOT/latest (the newest run); the older run is continued by naming its directory
    wrong = _train(root, "--resume", train={"steps": 6})
    assert wrong.returncode == 2 and "model.dims" in wrong.stderr
    older = _train(root / "run-0001", "--resume", train={"steps": 6})
    assert older.returncode == 0 and "resumed at step 4" in older.stdout, older.stderr
    assert cf.committed_steps(root / "run-0001") == [6] and cf.run_dirs(root / "run-0001") == []
    for path in (root, root / "run-0001", root / "run-0002"):
        assert checkpoint_cli("verify", path).returncode == 0


def test_readme_first_command_twice_then_resume_says_nothing_to_do(tmp_path):
    """`mpiexec -n 8 python -m hpcpipe.train` twice in a row, then --resume of the finished run."""
    for _ in range(2):
        result = run(command(8, "hpcpipe.train", ["--set", "log.progress=false"]), timeout=180, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
    root = tmp_path / "checkpoints"
    assert [d.name for d in cf.run_dirs(root)] == ["run-0001", "run-0002"]
    assert cf.read_latest(root) == "run-0002/step-00000100"
    done = run(command(8, "hpcpipe.train", ["--resume"]), timeout=180, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    # the run's first line names the MPI library; then the one line that matters
    assert done.stdout.strip().splitlines()[1:] == [
        "hpcpipe: nothing to do: 'checkpoints/run-0002/step-00000100' is already at train.steps = 100 "
        "(raise train.steps to continue)"]
    assert "nan" not in done.stdout and cf.committed_steps(root / "run-0002") == [100]


def test_old_layout_root_still_resumes_and_verifies(tmp_path):
    """A root written before run directories: latest = "step-N", step directories in the root itself."""
    made = _train(tmp_path / "new", train={"steps": 2})
    assert made.returncode == 0, made.stderr
    root = tmp_path / "old"
    shutil.copytree(tmp_path / "new" / "run-0001", root)
    manifest_path = root / "step-00000002" / cf.MANIFEST
    manifest = json.loads(manifest_path.read_text())
    del manifest["run"]                                            # old manifests do not name a run
    manifest_path.write_text(json.dumps(manifest))
    assert cf.read_latest(root) == "step-00000002"
    assert checkpoint_cli("verify", root).returncode == 0
    resumed = _train(root, "--resume", train={"steps": 3})
    assert resumed.returncode == 0 and "resumed at step 2" in resumed.stdout, resumed.stderr
    assert cf.read_latest(root) == "step-00000003" and cf.run_dirs(root) == []   # continued in the root itself
    assert cf.committed_steps(root) == [3]
    verified = checkpoint_cli("verify", root)
    assert verified.returncode == 0 and "step 3" in verified.stdout


def _negative_step(step_dir: Path) -> str:
    path = step_dir / cf.MANIFEST
    path.write_text(json.dumps(dict(json.loads(path.read_text()), step=-5)))
    return "step is -5, expected an integer >= 0"


def _bogus_files(step_dir: Path) -> str:
    path = step_dir / cf.MANIFEST
    manifest = json.loads(path.read_text())
    entry = manifest["files"][0]
    manifest["files"] = [dict(entry, name=f"stage-{i:03d}.h5", pp_rank=i) for i in range(200_000)]
    path.write_text(json.dumps(manifest))
    return "'files' has 200000 entries"


def _renamed(step_dir: Path) -> str:
    step_dir.rename(step_dir.parent / "step-00000009")
    cf.set_latest(step_dir.parent, "step-00000009")
    cf.set_latest(step_dir.parent.parent, "run-0001/step-00000009")
    return "is named for step 9 but its manifest says step 2"


@pytest.mark.parametrize("attack", [_negative_step, _bogus_files, _renamed])
def test_resume_refuses_what_verify_refuses(tmp_path, attack):
    root = tmp_path / "ck"
    assert _train(root, train={"steps": 2}).returncode == 0
    reason = attack(root / "run-0001" / "step-00000002")
    verified = checkpoint_cli("verify", root)
    assert verified.returncode == 1 and reason in verified.stderr, verified.stderr
    metrics = tmp_path / "m.jsonl"
    resumed = _train(root, "--resume", train={"steps": 6}, log={"metrics": str(metrics)})
    assert resumed.returncode == 2, resumed.stderr
    assert resumed.stderr.count("hpcpipe: error:") == 1 and reason in resumed.stderr, resumed.stderr
    assert "resumed" not in resumed.stdout and not metrics.exists()          # before any step


def test_info_and_verify_describe_and_check_a_weights_file(tmp_path):
    root = tmp_path / "ck"
    assert _train(root, train={"steps": 2}).returncode == 0
    usage = checkpoint_cli("export", root)                                       # export needs PATH OUT
    assert usage.returncode == 2 and "OUT" in usage.stderr
    out = tmp_path / "W.h5"
    assert checkpoint_cli("export", root, out).returncode == 0
    info = checkpoint_cli("info", out)
    assert info.returncode == 0, info.stderr
    assert "weights file" in info.stdout and "not a checkpoint directory" in info.stdout
    assert "step 2, 3 layers" in info.stdout and "layer 2: bias (8,), weight (8, 8)" in info.stdout
    verified = checkpoint_cli("verify", out)
    assert verified.returncode == 0 and "weights file" in verified.stdout, verified.stderr
    flip_byte_in_dataset(out, "layers/0001/weight")
    bad = checkpoint_cli("verify", out)
    assert bad.returncode == 1 and "W.h5" in bad.stderr and "layers/0001" in bad.stderr, bad.stderr


def test_export_never_writes_over_or_into_what_it_exports(tmp_path):
    root = tmp_path / "ck"
    assert _train(root, train={"steps": 2}).returncode == 0
    step_dir = root / cf.read_latest(root)
    out = tmp_path / "W.h5"
    assert checkpoint_cli("export", root, out).returncode == 0
    before = file_tree(root)
    weights = out.read_bytes()
    for target, source, words in [
        (root / "latest", root, "is inside the checkpoint directory"),
        (step_dir / "stage-000.h5", root, "is inside the checkpoint directory"),
        (root / "new.h5", root, "is inside the checkpoint directory"),
        (tmp_path / "elsewhere.h5", step_dir, None),          # outside: allowed
        (out, out, "is the weights file"),
    ]:
        result = checkpoint_cli("export", source, target)
        if words is None:
            assert result.returncode == 0, result.stderr
            continue
        assert result.returncode == 2, result.stderr
        assert result.stderr.count("hpcpipe: error:") == 1 and words in result.stderr, result.stderr
    assert file_tree(root) == before and out.read_bytes() == weights       # nothing touched
    assert checkpoint_cli("verify", root).returncode == 0
    exported = (tmp_path / "elsewhere.h5").read_bytes()
    again = checkpoint_cli("export", root, tmp_path / "elsewhere.h5")   # an exported model is never replaced
    assert again.returncode == 2 and "already exists; export never replaces a file" in again.stderr, again.stderr
    assert (tmp_path / "elsewhere.h5").read_bytes() == exported


def test_resuming_a_checkpoint_taken_in_another_shuffled_order_warns(tmp_path):
    root = tmp_path / "ck"
    assert _train(root, train={"steps": 2}, data={"shuffle": True}).returncode == 0
    step_dir = root / cf.read_latest(root)
    manifest = json.loads((step_dir / cf.MANIFEST).read_text())
    assert manifest["data"]["order"] == "feistel-splitmix64-8"
    same = _train(root, "--resume", train={"steps": 3}, data={"shuffle": True})
    assert same.returncode == 0 and "warning" not in same.stderr, same.stderr
    step_dir = root / cf.read_latest(root)
    manifest = json.loads((step_dir / cf.MANIFEST).read_text())
    del manifest["data"]["order"]                  # as a checkpoint written before the order had a name
    (step_dir / cf.MANIFEST).write_text(json.dumps(manifest))
    older = _train(root, "--resume", train={"steps": 4}, data={"shuffle": True})
    assert older.returncode == 0, older.stderr
    assert older.stderr.count("hpcpipe: warning:") == 1 and "sample order 'of an older hpcpipe'" in older.stderr
    assert "some samples may repeat" in older.stderr


def _h5_tree(path: Path) -> dict[str, bytes]:
    import h5py
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: out.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
    return out


def test_checkpoint_from_before_the_layout_change_resumes_to_the_old_runs_state(tmp_path):
    root = tmp_path / "ck"
    shutil.copytree(DATA / "old-layout-checkpoint", root)    # written by hpcpipe e2249d1 (see data/README.md)
    old = {"model": {"dims": [8, 8, 8, 8, 8]}, "parallel": {"pp": 2}, "data": {"synthetic_samples": 64},
           "log": {"progress": False}, "train": {"optimizer": "adam", "lr": 0.01, "steps": 4},
           "checkpoint": {"dir": str(root), "every": 2, "keep": 5}}
    assert checkpoint_cli("verify", root).returncode == 0
    result = run(command(4, "hpcpipe.train", sets(**old) + ["--resume"]), timeout=120)
    assert result.returncode == 0, result.stderr
    assert "(resumed at step 2)" in result.stdout
    assert cf.read_latest(root) == "step-00000004"            # an old-layout root keeps its layout
    exported = tmp_path / "step4.h5"
    assert checkpoint_cli("export", root, exported, "--optimizer").returncode == 0
    mine, theirs = _h5_tree(exported), _h5_tree(DATA / "old-layout-step4.h5")
    assert sorted(mine) == sorted(theirs) and any(k.startswith("optimizer/") for k in mine)
    # parameters and Adam state equal the old run's to float32 rounding: the fixture was computed on another
    # machine, whose BLAS and SIMD kernels round the last bit differently (bit for bit on the same CPU)
    for k in theirs:
        np.testing.assert_allclose(mine[k], theirs[k], rtol=1e-5, atol=1e-7, err_msg=k)


def test_checkpoint_tool_on_a_missing_path_is_a_usage_error(tmp_path):
    for verb in ("verify", "info"):
        result = checkpoint_cli(verb, tmp_path / "nock")
        assert result.returncode == 2 and result.stderr.count("hpcpipe: error:") == 1
        assert "does not exist" in result.stderr
    result = checkpoint_cli("export", tmp_path / "nock", tmp_path / "out.h5")
    assert result.returncode == 2 and not (tmp_path / "out.h5").exists()


@pytest.mark.parametrize("target,words", [
    ("nodir/x.h5", "export output directory '{tmp}/nodir' does not exist (for export output '{tmp}/nodir/x.h5')"),
    ("", "export output is empty: name the file to write"),                         # was: "'' is a directory"
    ("fifo", "export output '{tmp}/fifo' exists and is a named pipe, not a regular file"),
    ("notes.txt/x.h5", "export output '{tmp}/notes.txt/x.h5' is not writable: '{tmp}/notes.txt' is not a directory"),
])
def test_a_bad_export_target_is_one_line_exit_2_before_the_checkpoint_is_read(tmp_path, target, words):
    source = tmp_path / "ck"
    shutil.copytree(DATA / "old-layout-checkpoint", source)
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "notes.txt").write_text("mine\n")
    step = source / "step-00000002"
    for stage_file in step.glob("*.h5"):   # garbage: a target checked only after reading would fail on these
        stage_file.write_bytes(b"not the stage file\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    result = checkpoint_cli("export", source, str(tmp_path / target) if target else "")
    assert result.returncode == 2, result.stderr                  # was 1 for nodir/x.h5, naming a temporary file
    assert result.stderr == f"hpcpipe: error: {words.format(tmp=tmp_path)}\n" or \
        result.stderr.startswith(f"hpcpipe: error: {words.format(tmp=tmp_path)};"), result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before and (tmp_path / "notes.txt").read_text() == "mine\n"


def test_a_named_pipe_given_as_the_checkpoint_is_named_as_what_it_is(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    result = checkpoint_cli("export", tmp_path / "fifo", tmp_path / "x.h5")
    assert result.returncode == 1, result.stderr
    assert f"weights path '{tmp_path / 'fifo'}' is a named pipe, not a weights file or a checkpoint" in result.stderr
    assert "does not exist" not in result.stderr and not (tmp_path / "x.h5").exists()


@pytest.mark.parametrize("command", ["info", "verify"])
def test_info_and_verify_name_a_named_pipe_as_what_it_is(tmp_path, command):
    """They said "checkpoint '.../fifo' does not exist" of a path that is there."""
    os.mkfifo(tmp_path / "fifo")
    result = checkpoint_cli(command, tmp_path / "fifo")
    assert result.returncode == 1, result.stderr
    assert f"checkpoint '{tmp_path / 'fifo'}' is a named pipe, not a checkpoint directory or a weights file" \
        in result.stderr, result.stderr
    assert "does not exist" not in result.stderr
