"""Files written by a newer hpcpipe (format_version above the one this hpcpipe writes) are refused, never guessed at.

Issue #32: a weights file or checkpoint stage file with ``format_version = 99`` was read as if it were
version 1. Its layout may differ in ways no check here knows, so every reader refuses it with one line
saying which format this hpcpipe reads.
"""

from __future__ import annotations

import hashlib
import json
import shutil

import h5py
import numpy as np
import pytest
from support import DATA
from support.launch import one_error, run_module
from support.state import checkpoint_cli

from hpcpipe import __version__
from hpcpipe.errors import ConfigError
from hpcpipe.state import directory_protocol as cf
from hpcpipe.state.sources import resolve_weights
from hpcpipe.state.weights import FORMAT_VERSION, write_weights

MODEL = {"dims": [4, 4, 4], "bias": True, "activation": "relu", "final_activation": True}
NEWER = (f"has format_version 99, written by a newer hpcpipe: this hpcpipe ({__version__}) reads format_version "
         f"{FORMAT_VERSION} and older; read it with the hpcpipe version that wrote it (or a later one)")


def _weights(path, version=None):
    rng = np.random.default_rng(0)
    arrays = {i: {"weight": rng.standard_normal((4, 4)).astype("f4"), "bias": np.zeros(4, "f4")} for i in range(2)}
    write_weights(path, arrays, n_layers=2, model_config=MODEL)
    with h5py.File(path, "r+") as f:
        if version is None:
            del f.attrs["format_version"]
        else:
            f.attrs["format_version"] = version
    return path


def test_a_weights_file_of_a_newer_format_is_refused_by_every_reader(tmp_path):
    path = _weights(tmp_path / "w.h5", 99)
    with pytest.raises(ConfigError) as caught:
        resolve_weights(path)
    assert str(caught.value) == f"weights file {str(path)!r} {NEWER}"
    assert NEWER in one_error(run_module("hpcpipe.evaluate", "--weights", path, "--data", path))    # was: read
    assert NEWER in one_error(checkpoint_cli("info", path), code=1)


@pytest.mark.parametrize("version, ok", [(FORMAT_VERSION, True), (None, True), ("1", False), (0, False),
                                         (np.float64(1.5), False)])
def test_the_current_version_and_none_are_read_anything_else_is_refused(tmp_path, version, ok):
    path = _weights(tmp_path / "w.h5", version)
    if ok:
        assert resolve_weights(path).n_layers == 2     # files from before the attribute read as the current format
        return
    with pytest.raises(ConfigError, match=r"not a format version \(1, 2, \.\.\.\): not written by hpcpipe"):
        resolve_weights(path)


def test_a_checkpoint_stage_file_of_a_newer_format_is_refused(tmp_path):
    root = tmp_path / "ck"
    shutil.copytree(DATA / "old-layout-checkpoint", root)
    step = root / "step-00000002"
    stage = step / "stage-000.h5"
    with h5py.File(stage, "r+") as f:
        f.attrs["format_version"] = 99
    manifest = json.loads((step / cf.MANIFEST).read_text())   # forged to match: the version alone is refused
    for entry in manifest["files"]:
        if entry["name"] == stage.name:
            entry.update(bytes=stage.stat().st_size, sha256=hashlib.sha256(stage.read_bytes()).hexdigest())
    (step / cf.MANIFEST).write_text(json.dumps(manifest))
    result = checkpoint_cli("verify", root)
    assert f"weights file {str(stage)!r} {NEWER}" in one_error(result, code=1)
