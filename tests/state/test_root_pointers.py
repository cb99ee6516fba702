"""The root's ``latest`` after a failed pointer update, and a fresh run into a root of the old layout (issue #32).

* A save commits ``run-R/step-M`` and moves ``run-R/latest``, then fails to move ``ROOT/latest`` (a
  full disk between the two renames). ``--resume`` then refused ("already holds step-M ... would
  overwrite") until checkpoint.dir was set by hand. Every reader now takes the run's newer checkpoint
  when that is unambiguous (``state.root_latest``), ``--resume`` says so in one warning line, and its
  first save moves ``ROOT/latest``; when it is not, the refusal gives the exact ``--set``.
* A fresh run into a root written before run directories (``latest`` = ``step-N``, steps in the root)
  moved that ``latest`` to its own run without a word, and the old run could no longer be resumed: it is
  refused now, before step 0.
"""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest
from support import DATA
from support.configs import merged
from support.launch import one_error, train
from support.state import checkpoint_cli, file_tree

from hpcpipe.checkpoint import info
from hpcpipe.errors import ConfigError
from hpcpipe.state import collective
from hpcpipe.state import directory_protocol as cf
from hpcpipe.state.hdf5_source import checkpoint_source
from hpcpipe.state.root_latest import lagging_root
from hpcpipe.state.sources import resolve_weights
from hpcpipe.train.preflight import check_nothing_newer

TINY = {"model": {"dims": [8, 8, 8, 8]}, "parallel": {"dp": 1, "pp": 2},
        "data": {"synthetic_samples": 32}, "log": {"progress": False},
        "train": {"steps": 4, "micro_batches": 2, "micro_batch_size": 2, "optimizer": "adam"},
        "checkpoint": {"every": 2, "keep": 5}}


def _train(ck_dir, *more, **extra):
    return train(2, merged(TINY, extra, {"checkpoint": {"dir": str(ck_dir)}}), *more)


def _checkpoint(run_dir: Path, step: int, created: float) -> Path:
    """A committed checkpoint of step ``step`` (the fixture's files under a manifest naming that step)."""
    target = run_dir / cf.step_name(step)
    shutil.copytree(DATA / "old-layout-checkpoint" / "step-00000002", target)
    manifest = json.loads((target / cf.MANIFEST).read_text())
    manifest.update(step=step, created_unix=created, run=run_dir.name)
    (target / cf.MANIFEST).write_text(json.dumps(manifest))
    return target


def test_a_save_whose_root_pointer_update_failed_leaves_a_root_every_reader_follows(tmp_path, monkeypatch):
    """The real failure: collective._commit with ROOT/latest's replacement failing (ENOSPC)."""
    root, run = tmp_path / "ck", tmp_path / "ck" / "run-0001"
    _checkpoint(run, 2, 100.0)
    cf.set_latest(run, "step-00000002")
    cf.set_latest(root, "run-0001/step-00000002")
    tmp = run / cf.tmp_name(4)
    shutil.copytree(run / "step-00000002", tmp)
    manifest = json.loads((tmp / cf.MANIFEST).read_text())
    (tmp / cf.MANIFEST).unlink()
    real = cf.set_latest

    def full_disk_for_the_root(where, name, tmp_name=".latest.tmp"):
        if Path(where) == root:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(where, name, tmp_name)

    monkeypatch.setattr(cf, "set_latest", full_disk_for_the_root)
    with pytest.raises(OSError):
        collective._commit(root, run, tmp, 4, dict(manifest, step=4, created_unix=200.0), keep=5)
    monkeypatch.undo()
    assert cf.read_latest(root) == "run-0001/step-00000002" and cf.read_latest(run) == "step-00000004"
    assert resolve_weights(root).path == run / "step-00000004"          # was step 2, and --resume refused
    assert cf.read_latest(root) == "run-0001/step-00000002"              # reading writes nothing
    lag = lagging_root(root)
    assert (lag.named, lag.newer) == ("run-0001/step-00000002", "run-0001/step-00000004")
    assert (f"checkpoint root {str(root)!r}: latest -> run-0001/step-00000002 (behind its run's own latest: "
            f"run-0001/step-00000004 is read instead)\n") in info(root)


def test_resume_continues_the_run_when_the_root_pointer_lags_and_says_so(tmp_path):
    root = tmp_path / "ck"
    assert _train(root).returncode == 0                                          # run-0001: steps 2, 4
    cf.set_latest(root, "run-0001/step-00000002")      # as a save of step 4 that could not move the root leaves it
    kept = {name: file_tree(root / "run-0001" / name) for name in ("step-00000002", "step-00000004")}
    resumed = _train(root, "--resume", train={"steps": 6})
    assert resumed.returncode == 0, resumed.stderr                               # was: refused, exit 2
    assert "resumed at step 4" in resumed.stdout
    warnings = [line for line in resumed.stderr.splitlines() if line.startswith("hpcpipe: warning:")]
    assert warnings == [f"hpcpipe: warning: {str(root / 'latest')!r} names run-0001/step-00000002, behind "
                        f"run-0001's own latest (a save committed run-0001/step-00000004 but could not move the "
                        f"root's pointer); resuming run-0001/step-00000004, whose run's next save moves "
                        f"{str(root / 'latest')!r} forward"]
    assert cf.read_latest(root) == "run-0001/step-00000006" and cf.committed_steps(root / "run-0001") == [2, 4, 6]
    assert {name: file_tree(root / "run-0001" / name) for name in kept} == kept   # nothing overwritten
    assert checkpoint_cli("verify", root).returncode == 0


def test_a_lag_is_not_followed_past_another_runs_newer_checkpoint_and_the_refusal_gives_the_exact_set(tmp_path):
    root = tmp_path / "ck"
    one, two = root / "run-0001", root / "run-0002"
    for run, steps in ((one, (2, 100.0)), (one, (4, 200.0)), (two, (2, 300.0))):
        _checkpoint(run, *steps)
    cf.set_latest(one, "step-00000004")
    cf.set_latest(two, "step-00000002")
    cf.set_latest(root, "run-0001/step-00000002")     # behind run-0001's, and run-0002 wrote after both
    assert lagging_root(root) is None
    source = resolve_weights(root)
    assert source.path == one / "step-00000002"
    with pytest.raises(ConfigError) as caught:
        check_nothing_newer(source)
    assert str(caught.value).endswith(f"already holds step-00000004, which resuming from step 2 would overwrite; to "
                                      f"continue step-00000004, run the same command with --resume --set "
                                      f"'checkpoint.dir=\"{one}\"'")


def test_a_run_pointer_moved_back_by_hand_is_never_followed_forward(tmp_path):
    root, run = tmp_path / "ck", tmp_path / "ck" / "run-0001"
    _checkpoint(run, 2, 100.0)
    _checkpoint(run, 4, 200.0)
    cf.set_latest(run, "step-00000002")
    cf.set_latest(root, "run-0001/step-00000002")
    assert lagging_root(root) is None
    with pytest.raises(ConfigError, match=r"'.*run-0001/latest' names step-00000002 \(moved back by hand\?\): to "
                                          r"continue step-00000004, write that name into it and --resume again"):
        check_nothing_newer(checkpoint_source(run / "step-00000002"))


def test_a_fresh_run_into_a_root_of_the_old_layout_is_refused_and_the_old_run_still_resumes(tmp_path):
    root = tmp_path / "ck"
    shutil.copytree(DATA / "old-layout-checkpoint", root)
    before = file_tree(root)
    old = {"model": {"dims": [8, 8, 8, 8, 8]}, "parallel": {"pp": 2}, "data": {"synthetic_samples": 64},
           "log": {"progress": False}, "train": {"optimizer": "adam", "lr": 0.01, "steps": 3},
           "checkpoint": {"dir": str(root), "every": 2, "keep": 5}}
    line = one_error(train(2, old))                        # was: run-0001 made, latest moved past the old run
    assert line == (f"hpcpipe: error: checkpoint.dir {str(root)!r} holds a run saved before run directories existed "
                    f"(its latest names step-00000002, in the root itself): a fresh run would point that latest at "
                    f"its own checkpoints and --resume could no longer continue the old run; continue it with "
                    f"--resume, or set checkpoint.dir to another directory for a fresh run")
    assert file_tree(root) == before and cf.run_dirs(root) == []
    resumed = train(2, old, "--resume")
    assert resumed.returncode == 0 and "resumed at step 2" in resumed.stdout, resumed.stderr
    assert cf.read_latest(root) == "step-00000003"


def test_a_fresh_run_never_replaces_a_latest_file_that_is_no_checkpoint_pointer(tmp_path):
    """checkpoint.dir holding someone else's file named latest: the first save used to replace it silently."""
    root = tmp_path / "ck"
    root.mkdir()
    (root / "latest").write_text("my notes, not a pointer\n")
    (root / "readme.txt").write_text("keep me\n")
    before = file_tree(root)
    line = one_error(_train(root))
    assert line == (f"hpcpipe: error: checkpoint.dir {str(root)!r}: checkpoint pointer {str(root / 'latest')!r} "
                    f"holds 'my notes, not a pointer', not a step-NNNNNNNN or run-NNNN/step-NNNNNNNN name; a fresh "
                    f"run's first save would replace that file: move it away or set another checkpoint.dir")
    assert file_tree(root) == before and cf.run_dirs(root) == []


def test_a_fresh_run_refuses_a_hugging_face_model_directory_as_checkpoint_dir(tmp_path):
    """checkpoint.dir = the model's own directory: its latest made every later reader (model.init, --weights) take
    the directory for a checkpoint root, the trained step instead of the model."""
    root = tmp_path / "model"
    root.mkdir()
    (root / "config.json").write_text('{"model_type": "llama"}')
    before = file_tree(root)
    line = one_error(_train(root))
    assert line == (f"hpcpipe: error: checkpoint.dir {str(root)!r} is a Hugging Face model directory (config.json): "
                    f"a run's latest pointer there would make every reader (model.init, --weights, checkpoint) take "
                    f"it for a checkpoint root instead of the model; set checkpoint.dir to another directory")
    assert file_tree(root) == before
