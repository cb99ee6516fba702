"""Training inputs that lead nowhere through links: one line naming the file and the link, exit 2, nothing written.

Issue #32: a soft link that loops or names nothing, or an external link to a missing file, inside the
data file, a token file or the model.init weights ended ``python -m hpcpipe.train`` with an h5py
traceback (exit 1); a symbolic link loop given as data.path, model.init or checkpoint.dir was called a
path that "does not exist".
"""

from __future__ import annotations

import json
import os

import h5py
import numpy as np
import pytest
from support.launch import one_error, run_command

from hpcpipe.config import from_dict
from hpcpipe.errors import ConfigError
from hpcpipe.state.weights import write_weights
from hpcpipe.train.data import check_data_file
from hpcpipe.train.tokens import check_token_file

LOOP = "is a soft link to '/cycle' that loops back on itself (a cycle of soft links)"
EXTERNAL = "is an external link to '/x' in 'missing.h5', which cannot be resolved (can't open file)"
ELOOP = "is a symbolic link loop (ELOOP: too many levels of symbolic links)"


def _mlp_data(path, x_link=None, y_link=None):
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        f["x"] = x_link if x_link is not None else rng.standard_normal((64, 8)).astype("f4")
        f["y"] = y_link if y_link is not None else rng.standard_normal((64, 8)).astype("f4")
        if x_link is not None or y_link is not None:
            f["cycle"] = h5py.SoftLink("/x" if x_link is not None else "/y")
    return path


def _train(tmp_path, *sets):
    args = ["--set", "parallel.pp=2", "--set", "model.dims=[8, 8, 8]", "--set", "train.loss=\"mse\"",
            "--set", "train.steps=2", "--set", "log.progress=false", "--set", "checkpoint.dir=\"\""]
    for item in sets:
        args += ["--set", item]
    return run_command(2, "hpcpipe.train", args, cwd=tmp_path, timeout=120)


def _path(key, path):
    return f"{key}={json.dumps(str(path))}"


def test_a_data_file_whose_dataset_is_a_soft_link_loop_is_one_line_exit_2(tmp_path):
    data = _mlp_data(tmp_path / "d.h5", x_link=h5py.SoftLink("/cycle"))
    before = sorted(os.listdir(tmp_path))
    line = one_error(_train(tmp_path, _path("data.path", data)))
    assert line == f"hpcpipe: error: data.path {str(data)!r}: x {LOOP}"
    assert sorted(os.listdir(tmp_path)) == before


def test_model_init_weights_with_an_external_link_to_a_missing_file_is_one_line_exit_2(tmp_path):
    weights = tmp_path / "w.h5"
    write_weights(weights, {i: {"weight": np.ones((8, 8), "f4"), "bias": np.zeros(8, "f4")} for i in range(2)},
                  n_layers=2, model_config={"dims": [8, 8, 8]})
    with h5py.File(weights, "r+") as f:
        del f["layers/0001/weight"]
        f["layers/0001/weight"] = h5py.ExternalLink("missing.h5", "/x")
    line = one_error(_train(tmp_path, _path("model.init", weights)))
    assert line == f"hpcpipe: error: weights file {str(weights)!r}: layers/0001/weight {EXTERNAL}"


@pytest.mark.parametrize("key", ["data.path", "model.init", "checkpoint.dir"])
def test_a_symbolic_link_loop_as_an_input_path_is_named_as_one(tmp_path, key):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    line = one_error(_train(tmp_path, _path(key, tmp_path / "a")))
    assert line == f"hpcpipe: error: {key} {str(tmp_path / 'a')!r} {ELOOP}"       # was: "... does not exist"


def test_the_data_checks_name_every_broken_link(tmp_path):
    config = from_dict({"model": {"dims": [8, 8, 8]}, "train": {"loss": "mse"}, "parallel": {"pp": 1},
                        "data": {"path": str(_mlp_data(tmp_path / "d.h5", y_link=h5py.SoftLink("/cycle")))}})
    with pytest.raises(ConfigError, match=f"data.path '.*d.h5': y {LOOP[:30]}"):
        check_data_file(config)
    tokens = tmp_path / "t.h5"
    with h5py.File(tokens, "w") as f:
        f["x"] = np.zeros((4, 8), np.int64)
        f["y"] = h5py.ExternalLink("missing.h5", "/x")
    with pytest.raises(ConfigError) as caught:
        check_token_file(tokens, "x", "y", 8, 16)
    assert str(caught.value) == f"token file {str(tokens)!r}: y {EXTERNAL}"
    (tmp_path / "loop.h5").symlink_to("loop.h5")
    config = from_dict({"model": {"dims": [8, 8, 8]}, "parallel": {"pp": 1},
                        "data": {"path": str(tmp_path / "loop.h5")}})
    with pytest.raises(ConfigError, match="is a symbolic link loop"):
        check_data_file(config)
