"""Unit tests of the pure state code: weights files, the checkpoint directory protocol, resolving, data checks."""

from __future__ import annotations

import copy
import json
import os
import types
from pathlib import Path

import h5py
import numpy as np
import pytest
from support.state import flip_byte_in_dataset, small_tmpfs

from hpcpipe.config import from_dict
from hpcpipe.errors import ConfigError
from hpcpipe.nn.mlp.model import initial_arrays, layer_specs
from hpcpipe.state import directory_protocol as cf
from hpcpipe.state import manifest as ckpt_check
from hpcpipe.state.sources import resolve_weights
from hpcpipe.state.weights import check_weights, read_layers, read_optimizer, write_weights
from hpcpipe.train.data import check_data_file, step_samples

CFG = from_dict({"model": {"dims": [6, 5, 4, 3]}, "parallel": {"pp": 1}})
SPECS = layer_specs(CFG)


def _arrays():
    return initial_arrays(SPECS, [0, 1, 2], seed=3, dtype="float32")


def test_weights_round_trip_with_optimizer_state(tmp_path):
    path = tmp_path / "w.h5"
    arrays = _arrays()
    opt = {i: {"exp_avg": {k: v + 1 for k, v in arrays[i].items()}} for i in arrays}
    write_weights(path, arrays, n_layers=3, step=7, optimizer=opt, optimizer_attrs={"name": "adam", "steps": 7})
    check_weights(path, SPECS)
    back = read_layers(path, [2, 0])
    for i in (0, 2):
        for name in ("weight", "bias"):
            assert np.array_equal(back[i][name], arrays[i][name])
    attrs, state = read_optimizer(path, [1])
    assert attrs == {"name": "adam", "steps": 7}
    assert np.array_equal(state[1]["exp_avg"]["weight"], arrays[1]["weight"] + 1)
    with h5py.File(path) as f:   # the layout of docs/state.md, checksummed
        assert f["layers/0001/weight"].shape == (5, 4) and f["layers/0001/weight"].fletcher32
        assert f.attrs["format"] == "hpcpipe" and f.attrs["n_layers"] == 3 and f.attrs["step"] == 7


def test_bit_flip_in_weights_file_is_refused_naming_it(tmp_path):
    path = tmp_path / "w.h5"
    write_weights(path, _arrays(), n_layers=3)
    flip_byte_in_dataset(path, "layers/0001/weight")
    check_weights(path, SPECS)   # metadata is intact ...
    with pytest.raises(ConfigError, match=r"w\.h5.*layers/0001.*corrupt"):   # ... the data is not
        read_layers(path, [1])
    read_layers(path, [0, 2])    # other layers still read


@pytest.mark.parametrize("change, message", [
    (lambda a: a.pop(2), r"has layers \[0, 1\] but the model has 3"),
    (lambda a: a[1].update(weight=np.zeros((5, 5), np.float32)),
     r"layers/0001/weight has shape \(5, 5\), the model needs \(5, 4\)"),
    (lambda a: a[0].pop("bias"), r"layer 0 holds \['weight'\], the model needs \['bias', 'weight'\]"),
])
def test_check_weights_names_the_mismatch(tmp_path, change, message):
    arrays = _arrays()
    change(arrays)
    path = tmp_path / "w.h5"
    write_weights(path, arrays, n_layers=3)
    with pytest.raises(ConfigError, match=message):
        check_weights(path, SPECS)


def test_foreign_and_truncated_weights_files_are_refused(tmp_path):
    foreign = tmp_path / "foreign.h5"
    with h5py.File(foreign, "w") as f:
        f["layers/0000/weight"] = np.zeros((6, 5), np.float32)
    with pytest.raises(ConfigError, match=r"foreign\.h5.*not an hpcpipe weights file \(no root attribute format = "
                                          r"'hpcpipe'\)$"):
        resolve_weights(foreign)
    data_file = tmp_path / "data.h5"            # a data file given as weights: said so ('format = None' was all)
    with h5py.File(data_file, "w") as f:
        f["x"], f["y"] = np.zeros((4, 5), np.float32), np.zeros(4, np.int64)
    with pytest.raises(ConfigError) as info:
        resolve_weights(data_file)
    assert str(info.value) == (f"weights file {str(data_file)!r} is not an hpcpipe weights file (no root attribute "
                               f"format = 'hpcpipe'; it holds x, y: a data file?)")
    good = tmp_path / "w.h5"
    write_weights(good, _arrays(), n_layers=3)
    data = good.read_bytes()
    truncated = tmp_path / "t.h5"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match=r"t\.h5"):
        resolve_weights(truncated).read([0, 1, 2])
    text = tmp_path / "text.h5"
    text.write_text("hello")
    with pytest.raises(ConfigError, match=r"text\.h5.*not an HDF5 weights file"):
        resolve_weights(text)
    with pytest.raises(ConfigError, match=r"does not exist"):
        resolve_weights(tmp_path / "nope")


def _fake_checkpoint(root: Path, step: int) -> Path:
    d = root / cf.step_name(step)
    d.mkdir(parents=True)
    (d / cf.MANIFEST).write_text("{}")
    return d


def test_latest_pointer_is_replaced_atomically_and_validated(tmp_path):
    assert cf.read_latest(tmp_path) is None
    cf.set_latest(tmp_path, "step-00000002")
    cf.set_latest(tmp_path, "step-00000004")
    assert cf.read_latest(tmp_path) == "step-00000004"
    assert not cf.leftovers(tmp_path)   # the temporary pointer was renamed over `latest`
    cf.set_latest(tmp_path, "run-0003/step-00000004")   # a root of runs names the run too
    assert cf.read_latest(tmp_path) == "run-0003/step-00000004"
    for bad in ("../../etc", "/etc/step-00000001", "run-0001/../step-00000001", "step-00000001/../../x"):
        (tmp_path / cf.LATEST).write_text(bad)
        with pytest.raises(ConfigError, match="not a step-NNNNNNNN or run-NNNN/step-NNNNNNNN name"):
            cf.read_latest(tmp_path)


def test_latest_through_a_symlink_out_of_the_root_is_refused(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "elsewhere"
    _fake_checkpoint(outside, 4)
    root.mkdir()
    (root / "run-0001").symlink_to(outside)
    cf.set_latest(root, "run-0001/step-00000004")
    with pytest.raises(ConfigError, match="leads out of"):
        cf.read_latest(root)
    with pytest.raises(ConfigError, match="leads out of"):
        resolve_weights(root)


@pytest.mark.parametrize("target", ["latest", "nowhere"])
def test_a_latest_symlink_that_loops_or_dangles_is_named_as_the_pointer(tmp_path, target):
    """It used to read "neither a checkpoint directory nor a checkpoint root (no 'latest' pointer)"."""
    root = tmp_path / "ck"
    root.mkdir()
    (root / cf.LATEST).symlink_to(target)
    for given in (root, root / cf.LATEST):
        with pytest.raises(ConfigError, match=r"checkpoint pointer '.*latest' is unreadable: \[Errno"):
            resolve_weights(given)


def test_prune_keeps_newest_and_never_the_latest_target(tmp_path):
    for s in (2, 4, 6, 8):
        _fake_checkpoint(tmp_path, s)
    (tmp_path / "step-00000010").mkdir()          # no manifest: not a committed checkpoint, left alone
    cf.set_latest(tmp_path, "step-00000004")      # e.g. after resuming from an older checkpoint
    assert cf.prune(tmp_path, keep=2) == [2]
    assert cf.committed_steps(tmp_path) == [4, 6, 8]
    cf.set_latest(tmp_path, "step-00000008")
    assert cf.prune(tmp_path, keep=1) == [4, 6]
    assert cf.committed_steps(tmp_path) == [8]
    assert (tmp_path / "step-00000010").is_dir()
    assert cf.prune(tmp_path, keep=1) == []       # never fewer than one


def test_leftovers_are_found_and_cleaned(tmp_path):
    _fake_checkpoint(tmp_path, 2)
    (tmp_path / cf.tmp_name(4)).mkdir()
    (tmp_path / cf.tmp_name(4) / "stage-000.h5").write_bytes(b"half")
    (tmp_path / ".del-step-00000000").mkdir()
    (tmp_path / ".latest.tmp").write_text("x")
    assert [p.name for p in cf.leftovers(tmp_path)] == [".del-step-00000000", ".latest.tmp", ".tmp-step-00000004"]
    assert cf.committed_steps(tmp_path) == [2]    # a temporary directory is never taken for a checkpoint
    cf.clean_leftovers(tmp_path)
    assert cf.leftovers(tmp_path) == [] and cf.committed_steps(tmp_path) == [2]


def test_commit_renames_and_replaces_an_unreferenced_copy(tmp_path):
    _fake_checkpoint(tmp_path, 4)
    tmp = tmp_path / cf.tmp_name(4)
    tmp.mkdir()
    (tmp / cf.MANIFEST).write_text('{"new": 1}')
    final = cf.commit(tmp_path, tmp, 4)
    assert final == tmp_path / "step-00000004" and json.loads((final / cf.MANIFEST).read_text()) == {"new": 1}
    assert not tmp.exists() and not cf.leftovers(tmp_path)


SMALL = {"model": {"dims": [2, 2, 2]}, "parallel": {"pp": 1}}
GOOD_ENTRY = {"name": "stage-000.h5", "pp_rank": 0, "layers": [0, 1], "bytes": 1, "sha256": "0" * 64}


def _manifest(files, n_layers=2):
    return cf.build_manifest(3, n_layers, {"dp": 1, "pp": 1}, copy.deepcopy(SMALL),
                             {"name": "sgd", "steps": 3, "state": []}, {"samples_seen": 0}, files, run="run-0001")


def _write_manifest(step_dir: Path, m) -> Path:
    step_dir.mkdir(parents=True, exist_ok=True)
    (step_dir / "stage-000.h5").write_bytes(b"x")
    (step_dir / cf.MANIFEST).write_text(json.dumps(m))
    return step_dir


def _bogus_entries(m):
    m["files"] = [dict(GOOD_ENTRY, name=f"stage-{i:03d}.h5", pp_rank=i) for i in range(200_000)]


@pytest.mark.parametrize("mutate, message", [
    (lambda m: m.update(format="other"), "not an hpcpipe checkpoint manifest"),
    (lambda m: m.update(format_version=99), "format_version 99"),
    (lambda m: m["files"][0].update(layers=[0]), r"maps layers \[0\] to files"),
    (lambda m: m["files"][0].update(name="../x.h5"), "malformed.*bad file name"),
    (lambda m: m.pop("n_layers"), "malformed: n_layers is None"),
    # issue #11: these resumed before; now verify and resume refuse them alike (one validator)
    (lambda m: m.update(step=-5), r"malformed: step is -5, expected an integer >= 0"),
    (lambda m: m.update(step=True), r"malformed: step is True"),
    (_bogus_entries, r"malformed: 'files' has 200000 entries, expected 1\.\.2"),
    (lambda m: m["files"].append(dict(GOOD_ENTRY, name="stage-001.h5", pp_rank=1, layers=[1])),
     r"layer.*exactly once"),
    (lambda m: m["files"][0].update(sha256="0"), "malformed.*64 hex digits"),
    (lambda m: m["files"][0].update(pp_rank=3), "malformed.*pp_rank 3"),
    (lambda m: m["optimizer"].update(steps=4), r"optimizer steps \(update count\) is 4, expected an integer in 0\.\.3"),
    (lambda m: m["optimizer"].update(name="lbfgs"), "optimizer name is 'lbfgs'"),
    (lambda m: m.update(n_layers=3), "maps layers"),
    (lambda m: m["config"]["model"].update(dims=[2, 2]), "n_layers 2 disagrees with its model.dims"),
    (lambda m: m["config"]["model"].update(dims="x"), "holds an invalid config"),
    (lambda m: m.update(data=[]), "malformed: 'data' is list"),
])
def test_manifest_validation_names_the_file(tmp_path, mutate, message):
    m = _manifest([dict(GOOD_ENTRY)])
    ckpt_check.read_manifest(_write_manifest(tmp_path / "step-00000003", m))   # the good one passes
    mutate(m)
    step_dir = _write_manifest(tmp_path / "step-00000003", m)
    with pytest.raises(ConfigError, match=message) as info:
        ckpt_check.read_manifest(step_dir)
    assert "manifest.json" in str(info.value)
    with pytest.raises(ConfigError, match=message):    # every reader (resume, init, infer) runs the same check
        resolve_weights(step_dir)


def test_manifest_must_agree_with_its_directory(tmp_path):
    m = _manifest([dict(GOOD_ENTRY)])
    with pytest.raises(ConfigError, match=r"named for step 7 but its manifest says step 3"):
        resolve_weights(_write_manifest(tmp_path / "step-00000007", m))
    with pytest.raises(ConfigError, match=r"interrupted save, not a committed checkpoint"):
        resolve_weights(_write_manifest(tmp_path / ".tmp-step-00000003", m))
    d = _write_manifest(tmp_path / "step-00000003", m)
    (d / "stage-000.h5").unlink()
    with pytest.raises(ConfigError, match=r"stage-000\.h5' is missing"):
        resolve_weights(d)
    _write_manifest(d, m)
    (d / "stage-004.h5").write_bytes(b"x")
    with pytest.raises(ConfigError, match=r"holds \['stage-004\.h5'\], which its manifest does not list"):
        resolve_weights(d)


def test_manifest_that_is_not_json_is_refused(tmp_path):
    (tmp_path / cf.MANIFEST).write_bytes(b"\x00\xff garbage")
    with pytest.raises(ConfigError, match=r"manifest\.json.*not valid JSON"):
        ckpt_check.read_manifest(tmp_path)


def test_check_file_catches_size_and_hash(tmp_path):
    f = tmp_path / "stage-000.h5"
    f.write_bytes(b"abcdef")
    entry = {"name": f.name, "bytes": 6, "sha256": cf.sha256_file(f)}
    cf.check_file(tmp_path, entry)
    f.write_bytes(b"abcdeg")
    with pytest.raises(ConfigError, match=r"stage-000\.h5.*SHA-256"):
        cf.check_file(tmp_path, entry)
    f.write_bytes(b"abc")
    with pytest.raises(ConfigError, match=r"stage-000\.h5.*3 bytes.*truncated"):
        cf.check_file(tmp_path, entry)
    os.remove(f)
    with pytest.raises(ConfigError, match=r"stage-000\.h5.*missing"):
        cf.check_file(tmp_path, entry)


def test_step_samples_offset_continues_the_stream():
    straight = np.concatenate([step_samples(s, 6, 20, True, 1) for s in range(8)])
    # resuming at step 3 with a global batch of 4 after 3 steps of 6 samples: offset = 18 - 3*4
    resumed = np.concatenate([step_samples(s, 4, 20, True, 1, offset=18 - 12) for s in range(3, 10)])
    assert np.array_equal(straight[18:46], resumed[:28])


@pytest.mark.parametrize("x, y, loss, message", [
    (np.zeros((10, 5), np.float32), np.zeros(10, np.int64), "cross_entropy", r"shape \(10, 5\); model.dims\[0\] = 6"),
    (np.zeros((10, 6), np.int32), np.zeros(10, np.int64), "cross_entropy", "dtype int32; a float dtype"),
    (np.zeros((10, 6), np.float32), np.zeros(10, np.float32), "cross_entropy", "integer labels"),
    (np.zeros((10, 6), np.float32), np.zeros((10, 2), np.float32), "mse", r"needs float \(10, 3\)"),
])
def test_data_file_mismatches_are_clear_errors(tmp_path, x, y, loss, message):
    path = tmp_path / "d.h5"
    with h5py.File(path, "w") as f:
        f["x"], f["y"] = x, y
    cfg = from_dict({"model": {"dims": [6, 5, 4, 3]}, "parallel": {"pp": 1}, "data": {"path": str(path)},
                     "train": {"loss": loss}})
    with pytest.raises(ConfigError, match=message):
        check_data_file(cfg)


def test_writing_weights_to_a_full_disk_is_a_plain_oserror(tmp_path):
    """HDF5 2.0 segfaulted closing a file whose writes hit ENOSPC (issue #11's exit 11); now nothing crashes."""
    import subprocess
    import sys
    mnt = tmp_path / "full"
    script = (f"import errno, numpy as np\n"
              f"from hpcpipe.state.weights import write_weights\n"
              f"arrays = {{i: {{'weight': np.ones((100, 100), np.float32)}} for i in range(8)}}\n"
              f"try:\n    write_weights({str(mnt / 'w.h5')!r}, arrays, n_layers=8)\n"
              f"except OSError as exc:\n    print(errno.errorcode[exc.errno])\n")
    with small_tmpfs(mnt, "64k"):
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                                check=False)
        left = sorted(p.name for p in mnt.iterdir())
    assert result.returncode == 0 and result.stdout.strip() == "ENOSPC", (result.returncode, result.stderr)
    assert result.stderr == ""                     # no HDF5 error stacks, no "Exception ignored" tracebacks
    assert left == []                              # the partial file is removed


def test_a_run_directory_is_locked_by_one_live_run_at_a_time(tmp_path):
    from hpcpipe.state.run_lock import RunLock

    held = RunLock.acquire(tmp_path)
    with pytest.raises(ConfigError, match=r"is in use by another run \(pid \d+ on .* since "):
        RunLock.acquire(tmp_path)
    held.release()
    again = RunLock.acquire(tmp_path)            # released (or its process gone): free again
    again.release()
    with pytest.raises(ConfigError, match="cannot lock the run directory"):
        RunLock.acquire(tmp_path / "missing")


def test_a_run_directory_in_use_is_named_before_its_newer_steps(tmp_path):
    """Resuming step 5 while a live run has written step 6: the refusal names the live run, not "continue it"."""
    from hpcpipe.state.run_lock import RunLock, live_holder
    from hpcpipe.train.preflight import check_nothing_newer

    run_dir = tmp_path / "run-0001"
    for step in (5, 6):
        (run_dir / cf.step_name(step)).mkdir(parents=True)
        (run_dir / cf.step_name(step) / cf.MANIFEST).write_text("{}")
    source = types.SimpleNamespace(path=run_dir / cf.step_name(5), step=5, describe=lambda: "checkpoint step 5")
    assert live_holder(run_dir) is None and not (run_dir / ".lock").exists()   # a probe creates nothing
    with pytest.raises(ConfigError, match="already holds step-00000006"):
        check_nothing_newer(source)
    live = RunLock.acquire(run_dir)
    with pytest.raises(ConfigError, match="is in use by another run"):      # even with nothing newer
        check_nothing_newer(types.SimpleNamespace(path=run_dir / cf.step_name(6), step=6, describe=str))
    live.release()
    held = RunLock.acquire(run_dir)
    try:
        assert live_holder(run_dir).startswith(f"pid {os.getpid()} on ")
        assert live_holder(run_dir) is not None       # probes are shared: a second (another rank's) also sees it
        with pytest.raises(ConfigError, match=r"is in use by another run \(pid \d+ "):
            check_nothing_newer(source)
    finally:
        held.release()
    assert live_holder(run_dir) is None
    with pytest.raises(ConfigError, match="already holds step-00000006"):
        check_nothing_newer(source)
