"""Seed examples 6, 7 and 8 on the device backend (CuPy) against the NumPy path, same weights and data.

Examples 6 (GPipe, pp = 4) and 7 (dp = 2 x pp = 4) train: one step's loss and every weight, bias (and for 6
input) gradient on CuPy equal NumPy's to 1e-4 of the largest value (float32, cuBLAS vs OpenBLAS summation
order), and the seed's printed numbers hold on the GPU too. Example 8 is pipeline inference, which runs on
NumPy only (docs/infer.md): the seed's model through hpcpipe's layers on CuPy equals the real ``infer``
command's output at pp = 4. Without a GPU these skip (HPCPIPE_GPU_REHEARSE=1: rehearsed on NumPy).
"""

import os

import h5py
import numpy as np
import pytest
from support.gpu import device_backend, load_arrays, relative_errors, run_worker
from support.launch import run_command
from support.training import seed_draws, write_data

from hpcpipe.state.weights import write_weights

pytestmark = pytest.mark.gpu

SEED_MODEL = {"dims": [16] * 5, "bias": True, "activation": "relu", "final_activation": True}
SEED8_MODEL = {"dims": [16] * 5, "bias": False, "activation": "relu", "final_activation": True}
FLOAT32 = 1e-4


def _files(tmp_path, micro_batches: int):
    w, b, x, y = seed_draws(micro_batches=micro_batches)
    weights, data = tmp_path / "seed-w.h5", tmp_path / "seed-data.h5"
    write_weights(weights, {i: {"weight": w[i], "bias": b[i]} for i in range(4)}, n_layers=4)
    write_data(str(data), x.reshape(-1, 16), y.reshape(-1, 16))
    return str(weights), str(data)


def _both(tmp_path, n: int, sections: dict, keep_input_grads: bool = False):
    device = device_backend()
    runs = [{"name": backend, "backend": backend, "sections": sections, "keep_input_grads": keep_input_grads}
            for backend in ("numpy", device)]
    if device == "numpy":     # a rehearsal: the second run is NumPy again, under another name
        runs[1] = {**runs[1], "name": "device"}
    result = run_worker(n, "gradients", tmp_path, {"runs": runs}, timeout=600)
    name = runs[1]["name"]
    return result["numpy"], result[name], load_arrays(tmp_path / "numpy.npz"), load_arrays(tmp_path / f"{name}.npz")


def test_example6_gpipe_pp4_on_the_device_equals_numpy(tmp_path):
    weights, data = _files(tmp_path, micro_batches=8)
    sections = {"parallel": {"pp": 4, "dp": 1, "schedule": "gpipe"}, "model": {**SEED_MODEL, "init": weights},
                "data": {"path": data}, "train": {"micro_batches": 8, "micro_batch_size": 4},
                "checkpoint": {"dir": ""}}
    ref, dev, want, got = _both(tmp_path, 4, sections, keep_input_grads=True)
    errors = relative_errors(got, want)
    assert max(errors.values()) < FLOAT32, errors
    assert abs(dev["loss"] - ref["loss"]) < FLOAT32 * abs(ref["loss"])
    weights_grad = np.stack([got[f"{i}/weight"] for i in range(4)])
    # the seed prints the range of the weight gradients to 4 decimals: [-294.8232, 1527.5933]
    assert abs(weights_grad.min() - (-294.8232)) < 1e-3 and abs(weights_grad.max() - 1527.5933) < 1e-3
    assert any(key.startswith("input/") for key in got)


def test_example7_dp2_pp4_on_the_device_equals_numpy(tmp_path):
    weights, data = _files(tmp_path, micro_batches=4)
    sections = {"parallel": {"pp": 4, "dp": 2, "schedule": "gpipe"}, "model": {**SEED_MODEL, "init": weights},
                "data": {"path": data}, "train": {"micro_batches": 4, "micro_batch_size": 2},
                "checkpoint": {"dir": ""}}
    ref, dev, want, got = _both(tmp_path, 8, sections)
    errors = relative_errors(got, want)
    assert max(errors.values()) < FLOAT32, errors
    assert abs(dev["loss"] - 3828.785) < 1e-2 and abs(ref["loss"] - 3828.785) < 1e-2


def test_example8_seed_model_on_the_device_equals_the_infer_command(tmp_path):
    device = device_backend()
    w, _, x, _ = seed_draws(micro_batches=8, bias=False)
    weights, data, out = tmp_path / "seed8-w.h5", tmp_path / "seed8-x.h5", tmp_path / "seed8-y.h5"
    write_weights(weights, {i: {"weight": w[i]} for i in range(4)}, n_layers=4, model_config=SEED8_MODEL)
    with h5py.File(data, "w") as f:
        f["x"] = x.reshape(-1, 16)
    proc = run_command(4, "hpcpipe.infer", ["--weights", str(weights), "--input", str(data), "--output", str(out),
                                            "--set", "parallel.pp=4", "--set", "infer.micro_batch_size=4"],
                       timeout=300)
    assert proc.returncode == 0, proc.stderr
    with h5py.File(out, "r") as f:
        want = f["y"][...]
    assert (f"{want.min():.4f}", f"{want.max():.4f}") == ("0.0000", "417.7554")   # the seed's printed range
    got = _device_forward(device, {i: {"weight": w[i]} for i in range(4)}, x)
    assert got.shape == want.shape == (32, 16)
    assert np.max(np.abs(got - want)) < FLOAT32 * np.max(np.abs(want))
    assert (f"{got.min():.4f}", f"{got.max():.4f}") == ("0.0000", "417.7554")


def _device_forward(backend: str, arrays: dict, x: np.ndarray) -> np.ndarray:
    """The seed-8 model through hpcpipe's own stage modules (pp = 4, one process) on the backend, micro-batch by
    micro-batch; host copy of the output rows."""
    from hpcpipe.config import from_dict
    from hpcpipe.nn.rank_parameters import RankParameters
    from hpcpipe.nn.registry import model_def
    from hpcpipe.runtime.backend import select_backend
    be = select_backend(backend, node_rank=0)
    model = model_def(from_dict({"model": SEED8_MODEL, "parallel": {"pp": 4}}))
    params = RankParameters(model, {s: range(s, s + 1) for s in range(4)}, be.xp, "float32")
    params.load(arrays)
    rows = []
    for mb in x:
        act = be.xp.asarray(mb)
        for s in range(4):
            act, _ = params.stages[s].forward(act)
        rows.append(be.to_host(act))
    assert os.environ.get("HPCPIPE_GPU_REHEARSE") == "1" or be.name == "cupy"
    return np.concatenate(rows)
