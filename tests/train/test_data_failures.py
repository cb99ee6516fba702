"""Training data that goes bad: a file truncated mid-run, NaN rows. The real command in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import time

import h5py
import numpy as np
import pytest
from support.launch import command, run_command

from hpcpipe.config import from_dict
from hpcpipe.errors import DataError
from hpcpipe.h5files import WatchedFile, file_identity
from hpcpipe.train.data import HDF5Data


def _data(path, n=40000, width=16, nan_row=None):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, width)).astype(np.float32)
    if nan_row is not None:
        x[nan_row, 3] = np.nan
    with h5py.File(path, "w") as f:
        f["x"] = x
        f["y"] = rng.standard_normal((n, width)).astype(np.float32)
    return path


def _train_args(data, metrics, steps):
    return ["--set", "parallel.pp=2", "--set", f"data.path={json.dumps(str(data))}", "--set", f"train.steps={steps}",
            "--set", "log.progress=false", "--set", "checkpoint.dir=\"\"",
            "--set", f"log.metrics={json.dumps(str(metrics))}"]


def test_data_file_truncated_mid_run_stops_the_job_naming_the_file(tmp_path):
    data = _data(tmp_path / "data.h5")   # 5 MB, contiguous: HDF5 would read zeros past the new end
    size = data.stat().st_size
    metrics = tmp_path / "m.jsonl"
    env = dict(os.environ, HPCPIPE_STEP_SLEEP="0.3", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(command(2, "hpcpipe.train", _train_args(data, metrics, 200)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 90
        while not (metrics.exists() and metrics.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert metrics.read_text().strip(), "training never logged a step"
        os.truncate(data, 20000)
        _, stderr = proc.communicate(timeout=90)
    finally:
        proc.kill()
    assert proc.returncode == 1, stderr
    assert (f"error: DataError: data file '{data}' changed size during the run (20000 bytes, was {size}): "
            f"truncated or replaced") in stderr
    assert "Traceback" not in stderr
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert len(losses) < 200 and min(losses) > 0.1    # never trained on the zeros


def test_watched_file_refuses_a_truncated_or_replaced_file(tmp_path):
    path = _data(tmp_path / "d.h5", n=1000)
    cfg = from_dict({"model": {"dims": [16, 16]}, "parallel": {"pp": 1}, "data": {"path": str(path)}})
    source = HDF5Data(cfg)
    assert source.read_x(np.arange(4)).shape == (4, 16)
    os.truncate(path, 3000)
    with pytest.raises(DataError, match=f"data file '{path}' changed size during the run \\(3000 bytes, was"):
        source.read_x(np.array([900, 901]))
    source.close()
    # truncated before the first read: the lazy open compares with what was checked
    path2 = _data(tmp_path / "e.h5", n=1000)
    cfg2 = from_dict({"model": {"dims": [16, 16]}, "parallel": {"pp": 1}, "data": {"path": str(path2)}})
    source = HDF5Data(cfg2)
    os.truncate(path2, 3000)
    with pytest.raises(DataError, match=f"data file '{path2}' cannot be opened any more"):
        source.read_y(np.array([1]))
    # replaced by another file of the same size (rename over it)
    path3 = _data(tmp_path / "f.h5", n=1000)
    identity = file_identity(path3)
    other = _data(tmp_path / "g.h5", n=1000)
    os.replace(other, path3)
    with pytest.raises(DataError, match="was replaced by another file during the run"):
        WatchedFile(path3, f"data file {str(path3)!r}", identity)


def test_nan_in_the_data_stops_the_run_naming_file_dataset_and_row(tmp_path):
    data = _data(tmp_path / "nan.h5", n=64, nan_row=37)
    proc = run_command(2, "hpcpipe.train", _train_args(data, tmp_path / "m.jsonl", 20), cwd=tmp_path, timeout=90)
    assert proc.returncode == 2, proc.stderr
    assert f"dataset 'x' in '{data}' holds a non-finite value (nan) in row 37" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_data_that_overflows_stops_with_77_naming_the_data_file(tmp_path):
    # finite but huge inputs pass the NaN check and overflow float32 in the forward pass
    data = tmp_path / "huge.h5"
    with h5py.File(data, "w") as f:
        f["x"] = np.full((64, 16), 3e38, np.float32)
        f["y"] = np.zeros((64, 16), np.float32)
    proc = run_command(2, "hpcpipe.train", _train_args(data, tmp_path / "m.jsonl", 20)
                       + ["--set", "train.max_bad_steps=2"], cwd=tmp_path, timeout=90)
    assert proc.returncode == 77, proc.stderr
    assert f"or look for extreme values in data.path '{data}'" in proc.stderr
