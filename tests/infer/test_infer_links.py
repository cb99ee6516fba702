"""`python -m hpcpipe.infer` with inputs that lead nowhere through links: one line naming the file and the link.

Issue #32: a soft-link loop or a dangling external link as the input dataset or inside the weights ended
the job with an h5py traceback (exit 1); a symbolic link loop given as --input "did not exist".
"""

from __future__ import annotations

import os

import h5py
import numpy as np
import pytest
from support.launch import one_error, run_command

from hpcpipe.errors import ConfigError
from hpcpipe.infer.rows import check_input
from hpcpipe.state.weights import write_weights

pytestmark = pytest.mark.slow

LOOP = "is a soft link to '/cycle' that loops back on itself (a cycle of soft links)"
EXTERNAL = "is an external link to '/x' in 'missing.h5', which cannot be resolved (can't open file)"


@pytest.fixture
def weights(tmp_path):
    path = tmp_path / "w.h5"
    write_weights(path, {i: {"weight": np.eye(8, dtype="f4")} for i in range(2)}, n_layers=2,
                  model_config={"dims": [8, 8, 8], "bias": False})
    return path


def _input(path, link):
    with h5py.File(path, "w") as f:
        f["x"] = link
        f["cycle"] = h5py.SoftLink("/x")
    return path


def _infer(tmp_path, weights, data):
    return run_command(2, "hpcpipe.infer", ["--weights", str(weights), "--input", str(data), "--output",
                                            str(tmp_path / "out.h5"), "--set", "parallel.pp=2"], cwd=tmp_path,
                       timeout=60)


@pytest.mark.parametrize("link, words", [(h5py.SoftLink("/cycle"), LOOP),
                                         (h5py.ExternalLink("missing.h5", "/x"), EXTERNAL)])
def test_an_input_dataset_that_is_a_broken_link_is_one_line_exit_2(tmp_path, weights, link, words):
    data = _input(tmp_path / "in.h5", link)
    before = sorted(os.listdir(tmp_path))
    assert one_error(_infer(tmp_path, weights, data)) == f"hpcpipe: error: input file {str(data)!r}: x {words}"
    assert sorted(os.listdir(tmp_path)) == before
    with pytest.raises(ConfigError, match="x is a"):
        check_input(data, "x", 8)


def test_an_input_path_that_loops_then_weights_with_a_looping_layer(tmp_path, weights):
    (tmp_path / "loop.h5").symlink_to("loop.h5")
    line = one_error(_infer(tmp_path, weights, tmp_path / "loop.h5"))
    assert line == (f"hpcpipe: error: input file {str(tmp_path / 'loop.h5')!r} is a symbolic link loop (ELOOP: too "
                    f"many levels of symbolic links)")                       # was: "... does not exist"
    data = tmp_path / "in.h5"
    with h5py.File(data, "w") as f:
        f["x"] = np.ones((4, 8), "f4")
    with h5py.File(weights, "r+") as f:
        del f["layers/0001"]
        f["layers/0001"] = h5py.SoftLink("/cycle")
        f["cycle"] = h5py.SoftLink("/layers/0001")
    line = one_error(_infer(tmp_path, weights, data))
    assert line == f"hpcpipe: error: weights file {str(weights)!r}: layers/0001 {LOOP}"
