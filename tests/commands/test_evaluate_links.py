"""`python -m hpcpipe.evaluate` with files that lead nowhere through links: one line naming the file and link, exit 2.

Issue #32: a soft-link loop or an external link to a missing file as a data or token dataset, or inside
the weights, ended evaluate with an h5py traceback (exit 1); a symbolic link loop as --data or --weights
"did not exist".
"""

from __future__ import annotations

import h5py
import numpy as np
import pytest
from support.launch import one_error, run_module

from hpcpipe.state.weights import write_weights

MODEL = {"dims": [4, 5, 3], "bias": True, "activation": "tanh", "final_activation": False}
LOOP = "is a soft link to '/cycle' that loops back on itself (a cycle of soft links)"
EXTERNAL = "is an external link to '/x' in 'missing.h5', which cannot be resolved (can't open file)"
ELOOP = "is a symbolic link loop (ELOOP: too many levels of symbolic links)"


def _weights(path):
    rng = np.random.default_rng(1)
    arrays = {i: {"weight": rng.standard_normal((a, b)).astype("f4"), "bias": np.zeros(b, "f4")}
              for i, (a, b) in enumerate(zip(MODEL["dims"][:-1], MODEL["dims"][1:], strict=True))}
    write_weights(path, arrays, n_layers=2, model_config=MODEL)
    return path


def _evaluate(weights, data):
    return run_module("hpcpipe.evaluate", "--weights", weights, "--data", data)


@pytest.mark.parametrize("name, link, words", [("x", h5py.SoftLink("/cycle"), LOOP),
                                               ("y", h5py.ExternalLink("missing.h5", "/x"), EXTERNAL)])
def test_a_data_dataset_that_is_a_broken_link(tmp_path, name, link, words):
    data = tmp_path / "d.h5"
    with h5py.File(data, "w") as f:
        f["x"] = np.zeros((10, 4), "f4")
        f["y"] = np.zeros(10, np.int64)
        del f[name]
        f[name] = link
        f["cycle"] = h5py.SoftLink(f"/{name}")
    line = one_error(_evaluate(_weights(tmp_path / "w.h5"), data))
    assert line == f"hpcpipe: error: data file {str(data)!r}: {name} {words}"


def test_a_token_file_and_weights_with_broken_links(tmp_path):
    from support.serve import make_weights
    weights = tmp_path / "gpt.h5"
    make_weights(weights)
    tokens = tmp_path / "t.h5"
    with h5py.File(tokens, "w") as f:
        f["x"] = h5py.SoftLink("/cycle")
        f["cycle"] = h5py.SoftLink("/x")
        f["y"] = np.zeros((2, 32), np.int64)
    assert one_error(_evaluate(weights, tokens)) == f"hpcpipe: error: token file {str(tokens)!r}: x {LOOP}"
    with h5py.File(tokens, "w") as f:          # a good token file, then a broken parameter
        f["x"] = f["y"] = np.zeros((2, 32), np.int64)
    with h5py.File(weights, "r+") as f:
        del f["layers/0002/attn/qkv/weight"]
        f["layers/0002/attn/qkv/weight"] = h5py.ExternalLink("missing.h5", "/x")
    assert one_error(_evaluate(weights, tokens)) == \
        f"hpcpipe: error: weights file {str(weights)!r}: layers/0002/attn/qkv/weight {EXTERNAL}"


@pytest.mark.parametrize("which", ["--weights", "--data"])
def test_a_symbolic_link_loop_as_a_path(tmp_path, which):
    weights = _weights(tmp_path / "w.h5")
    (tmp_path / "loop").symlink_to("loop")
    loop = tmp_path / "loop"
    proc = _evaluate(loop, weights) if which == "--weights" else _evaluate(weights, loop)
    label = "--weights" if which == "--weights" else "data file"
    assert one_error(proc) == f"hpcpipe: error: {label} {str(loop)!r} {ELOOP}"     # was: "... does not exist"
