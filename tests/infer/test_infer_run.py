"""Inference on real MPI ranks through the library call ``hpcpipe.infer.run``.

Seed example 8 at pp=4 and dp=2 x pp=4, identical outputs across layouts for
a deep model with a partial last micro-batch, and a checkpoint saved by
training at dp=2 x pp=4 served at other layouts.
"""

import json
import os

import h5py
import numpy as np
import pytest
from support.training import seed_draws, sub_world

from hpcpipe import infer
from hpcpipe.evaluate import forward as sequential_forward
from hpcpipe.state.weights import write_weights

SEED8_MODEL = {"dims": [16] * 5, "bias": False, "activation": "relu", "final_activation": True}
DEEP_MODEL = {"dims": [24, 40, 32, 48, 16, 40, 24, 32, 12], "bias": True, "activation": "gelu",
              "final_activation": False, "dtype": "float32"}
LAYOUTS = [(1, 1), (1, 2), (1, 4), (2, 2), (2, 4)]


def _write_input(path, x):
    with h5py.File(path, "w") as f:
        f["x"] = x


def _read_output(path):
    with h5py.File(path, "r") as f:
        return f["y"][...]


def _seed8_files(world, directory):
    w, _, x, _ = seed_draws(micro_batches=8, bias=False)   # the seed's draws: w (4,16,16), then x (8,4,16)
    weights, data = os.path.join(directory, "seed8-w.h5"), os.path.join(directory, "seed8-x.h5")
    if world.Get_rank() == 0:
        write_weights(weights, {i: {"weight": w[i]} for i in range(4)}, n_layers=4, model_config=SEED8_MODEL)
        _write_input(data, x.reshape(-1, 16))
    world.Barrier()
    return w, x, weights, data


def _seed8_reference(w, x):
    """The seed's sequential NumPy reference, micro-batch by micro-batch."""
    outs = []
    for i in range(len(x)):
        act = x[i]
        for s in range(len(w)):
            act = np.maximum(act @ w[s], 0)
        outs.append(act)
    return np.stack(outs).reshape(-1, 16)


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("dp", [1, 2])
def test_seed_example8_pipeline_inference(world, shared_tmp, dp):
    w, x, weights, data = _seed8_files(world, shared_tmp)
    comm = sub_world(world, 4 * dp)
    if comm is None:
        return
    out = os.path.join(shared_tmp, f"seed8-dp{dp}.h5")
    # the seed's micro-batches of 4 rows; with dp = 2 each replica streams 4 of the 8
    report = infer.run(weights, data, out, comm=comm, config={"parallel": {"pp": 4, "dp": dp},
                                                               "infer": {"micro_batch_size": 4}})
    assert (report["rows"], report["micro_batches"], report["dp"], report["pp"]) == (32, 8, dp, 4)
    if comm.Get_rank() == 0:
        y = _read_output(out)
        assert y.shape == (32, 16)
        assert (f"{y.min():.4f}", f"{y.max():.4f}") == ("0.0000", "417.7554")
        assert np.max(np.abs(y - _seed8_reference(w, x))) < 1e-4
    comm.Free()


def _deep_files(world, directory, n_rows=53):
    rng = np.random.default_rng(7)
    dims = DEEP_MODEL["dims"]
    arrays = {i: {"weight": (rng.standard_normal((dims[i], dims[i + 1])) / np.sqrt(dims[i])).astype(np.float32),
                  "bias": rng.standard_normal(dims[i + 1]).astype(np.float32)} for i in range(len(dims) - 1)}
    x = rng.standard_normal((n_rows, dims[0])).astype(np.float32)
    weights, data = os.path.join(directory, "deep-w.h5"), os.path.join(directory, "deep-x.h5")
    if world.Get_rank() == 0:
        write_weights(weights, arrays, n_layers=len(arrays), model_config=DEEP_MODEL)
        _write_input(data, x)
    world.Barrier()
    return arrays, x, weights, data


@pytest.mark.mpi(min_size=8)
def test_outputs_identical_across_layouts_with_a_partial_micro_batch(world, shared_tmp):
    arrays, x, weights, data = _deep_files(world, shared_tmp)
    outputs = {}
    for dp, pp in LAYOUTS:
        comm = sub_world(world, dp * pp)
        if comm is not None:
            out = os.path.join(shared_tmp, f"deep-{dp}x{pp}.h5")
            trace = os.path.join(shared_tmp, f"deep-{dp}x{pp}-trace.json")
            # 53 rows in micro-batches of 6: 8 full and one of 5
            report = infer.run(weights, data, out, comm=comm, trace=trace,
                               overrides=[f"parallel.pp={pp}", f"parallel.dp={dp}", "infer.micro_batch_size=6"])
            assert report["rows"] == 53 and report["micro_batches"] == 9
            assert report["micro_batches_per_replica"] == -(-9 // dp)
            assert report["rows_per_s"] > 0 and report["latency_ms"]["p99"] >= report["latency_ms"]["p50"] > 0
            if comm.Get_rank() == 0:
                outputs[(dp, pp)] = _read_output(out)
                events = json.load(open(trace))["traceEvents"]
                tracks = {e["tid"] for e in events if e["ph"] == "M"}
                computes = [(e["args"]["stage"], e["args"]["mb"]) for e in events if e.get("cat") == "compute"]
                assert tracks == set(range(dp * pp))
                assert sorted(computes) == [(s, m) for s in range(pp) for m in range(9)]
                assert not [n for n in os.listdir(shared_tmp) if ".tmp-" in n]
            comm.Free()
        world.Barrier()
    if world.Get_rank() == 0:
        ref = sequential_forward(arrays, DEEP_MODEL, x)
        base = outputs[(1, 1)]
        assert base.shape == (53, 12)
        assert np.max(np.abs(base - ref)) < 1e-4 * max(1.0, np.max(np.abs(ref)))
        for layout, y in outputs.items():
            assert np.max(np.abs(y - base)) <= 1e-6, layout


@pytest.mark.mpi(min_size=8)
def test_checkpoint_saved_by_training_at_dp2_pp4_serves_at_other_layouts(world, shared_tmp):
    from hpcpipe.config import from_dict
    from hpcpipe.state.sources import resolve_weights
    from hpcpipe.train.loop import train
    from hpcpipe.train.setup import prepare
    from hpcpipe.train.trainer import Trainer

    ck = os.path.join(shared_tmp, "ck")
    _, x, _, data = _deep_files(world, shared_tmp, n_rows=20)
    comm = sub_world(world, 8)
    model = {k: v for k, v in DEEP_MODEL.items()}
    sections = {"parallel": {"pp": 4, "dp": 2}, "model": model, "data": {"synthetic_samples": 32},
                "train": {"steps": 3, "micro_batches": 2, "micro_batch_size": 2, "optimizer": "adam", "lr": 0.01},
                "checkpoint": {"dir": ck}, "log": {"progress": False}}
    trainer = Trainer(prepare(from_dict(sections), 8), comm)
    train(trainer, comm)
    trainer.close()
    comm.Free()
    world.Barrier()
    source = resolve_weights(ck)
    assert source.kind == "checkpoint" and source.step == 3 and source.manifest["layout"]["pp"] == 4
    ref = sequential_forward(source.read(list(range(8))), source.model, x)
    outputs = {}
    for dp, pp, buffers in [(1, 1, 2), (1, 2, 2), (2, 2, 1), (1, 8, 3)]:
        sub = sub_world(world, dp * pp)
        if sub is not None:
            out = os.path.join(shared_tmp, f"ck-{dp}x{pp}.h5")
            # no model keys given: dims, bias and activations come from the checkpoint's manifest
            infer.run(ck, data, out, comm=sub, config={"parallel": {"pp": pp, "dp": dp},
                                                       "infer": {"micro_batch_size": 3, "buffers": buffers}})
            if sub.Get_rank() == 0:
                outputs[(dp, pp)] = _read_output(out)
            sub.Free()
        world.Barrier()
    if world.Get_rank() == 0:
        for layout, y in outputs.items():
            assert np.max(np.abs(y - outputs[(1, 1)])) <= 1e-6, layout
            assert np.max(np.abs(y - ref)) < 1e-4 * max(1.0, np.max(np.abs(ref))), layout
