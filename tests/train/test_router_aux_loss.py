"""A mixture's load-balancing loss in training: per (replica, micro-batch) chunk, averaged with the chunks' losses.

Against an independent PyTorch float64 model (every gradient to 1e-7 of the largest) at dp=2 x pp=2 under all five
schedules and recomputation, where the router statistics of a chunk travel across stages with its activations;
and against transformers' own Mixtral (its loss with output_router_logits, the router and embedding gradients)
for one chunk, where the convention is transformers' loss exactly.
"""

import os

import h5py
import numpy as np
import pytest
from support.training import make_trainer, sub_world

torch = pytest.importorskip("torch")

MODEL = {"kind": "moe", "vocab_size": 13, "seq_len": 6, "d_model": 8, "n_heads": 4, "n_kv_heads": 2, "n_blocks": 4,
         "d_ff": 12, "rope_theta": 10000.0, "norm_eps": 1e-6, "seed": 3, "n_experts": 4, "experts_per_token": 2,
         "moe_d_ff": 10, "moe_layers": [0, 1, 3], "norm_topk_prob": True, "router_aux_loss_coef": 0.5,
         "tie_embeddings": False}
WINDOWS = 24
TOLERANCE = 1e-7


def _tokens():
    rng = np.random.default_rng(11)
    x = rng.integers(0, MODEL["vocab_size"], (WINDOWS, MODEL["seq_len"])).astype(np.int32)
    return x, ((x * 5 + 2) % MODEL["vocab_size"]).astype(np.int32)


def _sections(data, dp, pp, schedule, micro, recompute="none"):
    virtual = 2 if schedule in ("zb-v", "interleaved-1f1b") else 1
    return {"parallel": {"dp": dp, "pp": pp, "schedule": schedule, "virtual_stages": virtual},
            "model": {**MODEL, "dtype": "float64"}, "data": {"path": data, "shuffle": False},
            "train": {"micro_batches": micro, "micro_batch_size": WINDOWS // (dp * micro), "recompute": recompute},
            "checkpoint": {"dir": ""}, "log": {"progress": False}}


def _reference(chunks):
    from support.llama_reference import torch_llama

    from hpcpipe.config import from_dict
    from hpcpipe.nn.registry import model_def
    model = model_def(from_dict({"model": MODEL, "parallel": {"pp": 1}}))
    groups = [model.init_group(i, MODEL["seed"], "float64") for i in range(model.n_layers)]
    x, y = _tokens()
    loss, grads, _ = torch_llama(model.shape, groups, x.astype(np.int64), y.astype(np.int64), chunks=chunks)
    return loss, grads


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("schedule,micro,recompute", [("gpipe", 3, "none"), ("1f1b", 3, "stage"),
                                                      ("interleaved-1f1b", 2, "none"), ("zb-h1", 3, "stage"),
                                                      ("zb-v", 3, "none")])
def test_load_balancing_loss_per_chunk_matches_torch(world, shared_tmp, schedule, micro, recompute):
    """dp=2 x pp=2, 2 or 3 micro-batches: 4 or 6 chunks; loss and every gradient (routers too) equal PyTorch."""
    path = os.path.join(shared_tmp, "aux-tokens.h5")
    if world.Get_rank() == 0 and not os.path.exists(path):
        x, y = _tokens()
        with h5py.File(path + ".tmp", "w") as f:
            f["x"], f["y"] = x, y
        os.replace(path + ".tmp", path)
    world.Barrier()
    ref_loss, ref_grads = _reference(chunks=2 * micro)
    _, plain = _reference(chunks=1)
    largest = max(float(np.abs(v).max()) for g in ref_grads for v in g.values())
    # the chunk convention matters: averaging one aux over all 24 windows gives other router gradients
    assert max(float(np.abs(plain[i]["mlp/router/weight"] - ref_grads[i]["mlp/router/weight"]).max())
               for i in (1, 2, 4)) > 100 * TOLERANCE * largest
    comm = sub_world(world, 4)
    if comm is not None:
        trainer = make_trainer(comm, _sections(path, 2, 2, schedule, micro, recompute))
        try:
            loss = trainer.compute_gradients(0)
            grads = trainer.gather("grads")
        finally:
            trainer.close()
        if comm.Get_rank() == 0:
            for i, group in enumerate(ref_grads):
                for name, ref in group.items():
                    assert float(np.abs(grads[i][name] - ref).max()) / largest <= TOLERANCE, (schedule, i, name)
            assert abs(loss - ref_loss) <= TOLERANCE * abs(ref_loss)
        comm.Free()
    world.Barrier()


def test_one_chunk_is_transformers_mixtral_loss(tmp_path):
    """dp = pp = 1, one micro-batch: the loss is transformers' Mixtral loss with its router_aux_loss_coef term, and
    the router and embedding gradients equal autograd through transformers' model (float64; its load-balancing
    function sums in float32)."""
    from mpi4py import MPI
    from support.hf import bytelevel_tokenizer, save_model, save_tokenizer, tiny_model
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    model = tiny_model("mixtral", output_router_logits=True, router_aux_loss_coef=0.3)
    directory = save_model(model, tmp_path / "mixtral")
    save_tokenizer(bytelevel_tokenizer(["<|endoftext|>"], vocab_size=100), directory, eos_token="<|endoftext|>")
    rng = np.random.default_rng(4)
    x = rng.integers(0, 100, (4, 12)).astype(np.int32)
    y = rng.integers(0, 100, (4, 12)).astype(np.int32)
    with h5py.File(tmp_path / "tokens.h5", "w") as f:
        f["x"], f["y"] = x, y
    sections = {"model": {"init": str(directory), "seq_len": 12, "dtype": "float64"},
                "data": {"path": str(tmp_path / "tokens.h5"), "shuffle": False},
                "train": {"micro_batches": 1, "micro_batch_size": 4}, "parallel": {"pp": 1},
                "checkpoint": {"dir": ""}, "log": {"progress": False}}
    from hpcpipe.config import from_dict
    from hpcpipe.state.sources import resolve_weights
    from hpcpipe.train.setup import prepare, restate_stored_shape
    from hpcpipe.train.trainer import Trainer
    raw = restate_stored_shape(sections, resolve_weights(str(directory), "model.init"))
    trainer = Trainer(prepare(from_dict(raw), 1), MPI.COMM_SELF)
    try:
        assert trainer.model.shape.router_aux_loss_coef == pytest.approx(0.3)
        loss = trainer.compute_gradients(0)
        grads = trainer.gather("grads")
    finally:
        trainer.close()
    model = model.double()
    model.set_experts_implementation("eager")         # the grouped-product kernels take no float64
    out = model(torch.tensor(x, dtype=torch.long), output_router_logits=True)
    ce = torch.nn.functional.cross_entropy(out.logits.reshape(-1, 100), torch.tensor(y, dtype=torch.long).reshape(-1))
    aux = load_balancing_loss_func(out.router_logits, 4, 2)
    total = ce + 0.3 * aux
    total.backward()
    assert abs(loss - total.item()) <= 1e-6 * total.item()
    assert abs(0.3 * aux.item()) > 1e-3                       # the term is there and not negligible
    for layer in range(2):
        theirs = model.model.layers[layer].mlp.gate.weight.grad.numpy().T
        mine = grads[layer + 1]["mlp/router/weight"]
        assert np.abs(mine - theirs).max() <= 1e-6 * np.abs(theirs).max(), layer
    theirs = model.model.embed_tokens.weight.grad.numpy()
    assert np.abs(grads[0]["tok_emb"] - theirs).max() <= 1e-6 * np.abs(theirs).max()
