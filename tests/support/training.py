"""Training on real ranks in the tests: sub-communicators, seed-example data, a Trainer, the MLP's JAX reference."""

from __future__ import annotations

import os

import h5py
import numpy as np


def sub_world(world, n: int):
    """Return a communicator of world ranks 0..n-1 on those ranks and None elsewhere (collective)."""
    if world.Get_size() < n:
        import pytest
        pytest.skip(f"needs {n} MPI ranks, have {world.Get_size()}")
    color = 0 if world.Get_rank() < n else 1
    comm = world.Split(color, world.Get_rank())
    if color:
        comm.Free()
        return None
    return comm


def write_data(path: str, x: np.ndarray, y: np.ndarray) -> str:
    """Write an HDF5 data file with datasets x and y."""
    with h5py.File(path, "w") as f:
        f["x"] = x
        f["y"] = y
    return path


def seed_draws(micro_batches: int, stages: int = 4, dim: int = 16, batch: int = 4, bias: bool = True):
    """Return the seeds' np.random.seed(42) draws: w, b (or None), x, y, in the seeds' order."""
    np.random.seed(42)
    w = np.random.randn(stages, dim, dim).astype(np.float32)
    b = np.random.randn(stages, dim).astype(np.float32) if bias else None
    x = np.random.randn(micro_batches, batch, dim).astype(np.float32)
    y = np.random.randn(micro_batches, batch, dim).astype(np.float32)
    return w, b, x, y


def jax_reference(ws, bs, x, y, activation="relu", final_activation=True, loss="mse"):
    """Sequential JAX (float32) loss and gradients w.r.t. inputs, weights and biases."""
    import jax
    import jax.numpy as jnp
    jax.config.update("jax_enable_x64", False)
    acts = {"relu": jax.nn.relu, "tanh": jnp.tanh, "identity": lambda v: v,
            "gelu": lambda v: jax.nn.gelu(v, approximate=True)}

    def forward(x, ws, bs):
        a = x
        for i, w in enumerate(ws):
            a = a @ w + (bs[i] if bs is not None else 0.0)
            if i < len(ws) - 1 or final_activation:
                a = acts[activation](a)
        return a

    def objective(x, ws, bs):
        out = forward(x, ws, bs)
        if loss == "mse":
            return jnp.mean((out - y) ** 2)
        logp = jax.nn.log_softmax(out, axis=1)
        return -jnp.mean(logp[jnp.arange(len(y)), y])

    value, (gx, gw, gb) = jax.value_and_grad(objective, argnums=(0, 1, 2))(
        jnp.asarray(x), [jnp.asarray(w) for w in ws], None if bs is None else [jnp.asarray(b) for b in bs])
    return (float(value), np.asarray(gx), [np.asarray(g) for g in gw],
            None if gb is None else [np.asarray(g) for g in gb])


def make_trainer(comm, sections: dict, **options):
    """A Trainer of the config sections on comm (options: keep_input_grads, record_events, ...)."""
    from hpcpipe.config import from_dict
    from hpcpipe.train.setup import prepare
    from hpcpipe.train.trainer import Trainer
    return Trainer(prepare(from_dict(sections), comm.Get_size()), comm, **options)


def run_gradients(comm, directory: str, name: str, sections: dict, weights: dict | None, x, y,
                  keep_input_grads: bool = False):
    """Write weights/data files, build a Trainer on comm, compute one step's gradients.

    Returns (loss, grads by layer on comm rank 0 else None, input grads by dp rank on rank 0).
    """
    from hpcpipe.state.weights import write_weights

    data_path = os.path.join(directory, f"{name}-data.h5")
    sections = {k: dict(v) for k, v in sections.items()}
    sections.setdefault("data", {})["path"] = data_path
    sections.setdefault("log", {})["progress"] = False
    if weights is not None:
        weights_path = os.path.join(directory, f"{name}-weights.h5")
        sections.setdefault("model", {})["init"] = weights_path
    if comm.Get_rank() == 0:
        write_data(data_path, x, y)
        if weights is not None:
            write_weights(weights_path, weights, n_layers=len(weights))
    comm.Barrier()
    engine = make_trainer(comm, sections, keep_input_grads=keep_input_grads)
    try:
        loss = engine.compute_gradients(0)
        grads = engine.gather("grads")
        mine = (engine.topo.dp_rank, engine.input_gradients()) if (keep_input_grads and engine.first) else None
        parts = comm.gather(mine, root=0)
        input_grads = None if parts is None else dict(p for p in parts if p is not None)
    finally:
        engine.close()
    return loss, grads, input_grads


def replica_input_grads(input_grads: dict, dp: int, n_micro: int, batch: int, dim: int) -> np.ndarray:
    """Reassemble per-replica, per-micro-batch input gradients into global sample order."""
    out = np.empty((n_micro, dp, batch, dim), dtype=np.float32)
    for d, per_mb in input_grads.items():
        for m, g in enumerate(per_mb):
            out[m, d] = g
    return out.reshape(-1, dim)
