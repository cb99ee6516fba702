"""`python -m hpcpipe.evaluate`: what it prints, and one clear error (exit 2) for every bad input."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
from support.launch import run_module

from hpcpipe.evaluate import forward
from hpcpipe.state.weights import write_weights

MODEL = {"dims": [4, 5, 3], "bias": True, "activation": "tanh", "final_activation": False}


def _weights(path, scale=1.0):
    rng = np.random.default_rng(1)
    arrays = {i: {"weight": (scale * rng.standard_normal((a, b))).astype(np.float32),
                  "bias": rng.standard_normal(b).astype(np.float32)}
              for i, (a, b) in enumerate(zip(MODEL["dims"][:-1], MODEL["dims"][1:], strict=True))}
    write_weights(path, arrays, n_layers=2, model_config=MODEL)
    return arrays


def _data(path, x=None, y=None, **more):
    rng = np.random.default_rng(2)
    with h5py.File(path, "w") as f:
        f["x"] = rng.standard_normal((10, 4)).astype(np.float32) if x is None else x
        f["y"] = rng.integers(0, 3, 10) if y is None else y
        for name, value in more.items():
            f[name] = value
    return path


def test_labels_print_accuracy_and_cross_entropy(tmp_path):
    arrays = _weights(tmp_path / "w.h5")
    data = _data(tmp_path / "d.h5")
    proc = run_module("hpcpipe.evaluate", "--weights", tmp_path / "w.h5", "--data", data)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert sorted(report) == ["accuracy", "cross_entropy", "n", "step", "weights"]
    with h5py.File(data) as f:
        x, y = f["x"][...], f["y"][...]
    out = forward(arrays, MODEL, x).astype(np.float64)
    logp = out - out.max(axis=1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(axis=1, keepdims=True))
    assert report["n"] == 10
    assert report["accuracy"] == pytest.approx(np.mean(out.argmax(axis=1) == y))
    assert report["cross_entropy"] == pytest.approx(-np.mean(logp[np.arange(10), y]), rel=1e-6)


def test_float_targets_print_mse_only(tmp_path):
    arrays = _weights(tmp_path / "w.h5")
    y = np.random.default_rng(3).standard_normal((10, 3)).astype(np.float32)
    data = _data(tmp_path / "d.h5", y=y)
    proc = run_module("hpcpipe.evaluate", "--weights", tmp_path / "w.h5", "--data", data)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert sorted(report) == ["mse", "n", "step", "weights"]
    with h5py.File(data) as f:
        out = forward(arrays, MODEL, f["x"][...]).astype(np.float64)
    assert report["mse"] == pytest.approx(np.mean((out - y) ** 2), rel=1e-6)


def _nan_x():
    x = np.random.default_rng(2).standard_normal((10, 4)).astype(np.float32)
    x[6, 2] = np.nan
    return x


CASES = {
    "not hdf5": (lambda t: _text(t / "d.h5"),
                 "data file '{data}' is not a readable HDF5 file"),
    "directory": (lambda t: t, "data file '{data}' is a directory, not an HDF5 file"),
    "missing file": (lambda t: t / "nope.h5", "data file '{data}' does not exist"),
    "missing dataset": (lambda t: _data(t / "d.h5", targets=np.zeros(10)) and _drop(t / "d.h5", "y"),
                        "data file '{data}' has no dataset 'y' (it has: ['targets', 'x'])"),
    "x width": (lambda t: _data(t / "d.h5", x=np.zeros((10, 5), np.float32)),
                "dataset 'x' in data file '{data}' has shape (10, 5); the weights take 4 features"),
    "x dtype": (lambda t: _data(t / "d.h5", x=np.zeros((10, 4), np.int32)),
                "dataset 'x' in data file '{data}' has dtype int32; a float dtype is needed"),
    "y shape": (lambda t: _data(t / "d.h5", y=np.zeros((10, 2), np.float32)),
                ("dataset 'y' in data file '{data}' has shape (10, 2) dtype float32; the weights give 3 outputs: "
                 "integer labels of shape (10,) or float targets of shape (10, 3) are needed")),
    "row counts differ": (lambda t: _data(t / "d.h5", y=np.zeros(9, np.int64)),
                          "dataset 'y' in data file '{data}' has 9 rows but 'x' has 10"),
    "label out of range": (lambda t: _data(t / "d.h5", y=np.array([0, 1, 2, 0, 1, 7, 2, 0, 1, 2])),
                           "dataset 'y' in data file '{data}' holds label 7 in row 5; the weights give 3 classes"),
    "nan in x": (lambda t: _data(t / "d.h5", x=_nan_x()),
                 "dataset 'x' in data file '{data}' holds a non-finite value in row 6 (nan)"),
    "inf in targets": (lambda t: _data(t / "d.h5", y=np.where(np.arange(30).reshape(10, 3) == 25, np.inf, 0.0)),
                       "dataset 'y' in data file '{data}' holds a non-finite value in row 8 (inf)"),
    "no rows": (lambda t: _data(t / "d.h5", x=np.zeros((0, 4), np.float32), y=np.zeros(0, np.int64)),
                "data file '{data}' holds no samples"),
}


def _text(path):
    path.write_bytes(b"plain text, not HDF5")
    return path


def _drop(path, name):
    with h5py.File(path, "a") as f:
        del f[name]
    return path


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_data_is_one_line_exit_2(tmp_path, case):
    make, template = CASES[case]
    weights = tmp_path / "w.h5"
    _weights(weights)
    data = make(tmp_path)
    proc = run_module("hpcpipe.evaluate", "--weights", weights, "--data", data)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("hpcpipe: error:") == 1 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert template.format(data=data) in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


@pytest.mark.parametrize("case, message", [
    ("missing", "--weights '{w}' does not exist (give a weights file, a checkpoint directory or a Hugging Face "
                "model directory)"),
    ("not hdf5", "--weights '{w}' is not an HDF5 weights file"),
    ("non-finite", "weights file '{w}': layers/0000/weight holds 20 non-finite value(s)"),
    ("overflowing", "the output of weights file '{w}' for row 0 of data file '{data}' is not finite"),
])
def test_bad_weights_are_one_line_exit_2(tmp_path, case, message):
    data = _data(tmp_path / "d.h5")
    w = tmp_path / "w.h5"
    if case == "not hdf5":
        w.write_text("not weights")
    elif case == "non-finite":
        _weights(w, scale=np.inf)       # refused when read
    elif case == "overflowing":           # finite weights whose sum overflows float32: 5 x tanh(1) x 3e38
        write_weights(w, {0: {"weight": np.zeros((4, 5), np.float32), "bias": np.ones(5, np.float32)},
                          1: {"weight": np.full((5, 3), 3e38, np.float32), "bias": np.zeros(3, np.float32)}},
                      n_layers=2, model_config=MODEL)
    proc = run_module("hpcpipe.evaluate", "--weights", w, "--data", data)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("hpcpipe: error:") == 1 and "Traceback" not in proc.stderr
    assert message.format(w=w, data=data) in proc.stderr
