"""Expert parallelism in training on real MPI ranks: on 8 ranks at pp=2, dp=4 with ep=2 (two ep groups of two
replicas: the experts' all-to-all inside each, their gradients averaged across the two), each rank holds half of
every block's experts and trades token rows with its ep peer; the loss and every gradient equal PyTorch autograd
through transformers' own Qwen3MoeForCausalLM and MixtralForCausalLM (float64, 1e-7 of the largest), under every
schedule.

Run: ``mpiexec -n 8 python -m pytest --with-mpi tests/train/test_expert_parallel.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

import h5py
import numpy as np
import pytest
from support.training import make_trainer

TOLERANCE = 1e-7     # of the largest reference gradient
WINDOWS, T = 24, 8   # 24 windows of 8 tokens: dp 4 x 3 micro-batches x 2 (interleaved: x 2 x 3)


def _setup(world, tmp: str, arch: str, aux: float = 0.0) -> tuple[str, str, tuple | None]:
    """Rank 0 writes the transformers model's directory and the tokens, and computes the reference (loss, grads);
    ``aux``: the model's router_aux_loss_coef (its load-balancing loss over hpcpipe's (replica, micro-batch) chunks
    of 1f1b and zb-h1: dp 4 x 3 micro-batches)."""
    hf, data = os.path.join(tmp, f"hf-{arch}-{aux}"), os.path.join(tmp, f"tokens-{arch}.h5")
    reference = None
    if world.Get_rank() == 0:
        from support.moe_reference import moe_directory, torch_moe
        extra = {"output_router_logits": True, "router_aux_loss_coef": aux} if aux else {}
        model, _ = moe_directory(arch, Path(hf), **extra)
        rng = np.random.default_rng(3)
        vocab = model.config.vocab_size
        x = rng.integers(0, vocab, (WINDOWS, T))
        y = np.where(rng.random(x.shape) < 0.5, (x * 3 + 1) % vocab, rng.integers(0, vocab, x.shape))
        with h5py.File(data, "w") as f:
            f["x"], f["y"] = x.astype(np.int32), y.astype(np.int32)
        reference = torch_moe(model, x, y, chunks=4 * 3)
    world.Barrier()
    return hf, data, reference


def _sections(hf: str, data: str, schedule: str, ep: int = 2, recompute: str = "none") -> dict:
    from hpcpipe.state.sources import resolve_weights
    virtual = 2 if schedule in ("zb-v", "interleaved-1f1b") else 1
    micro = 2 if schedule == "interleaved-1f1b" else 3        # a multiple of pp there
    model = {**resolve_weights(hf).model, "init": hf, "seq_len": T, "dtype": "float64"}   # config.json's keys
    return {"parallel": {"dp": 4, "pp": 2, "ep": ep, "schedule": schedule, "virtual_stages": virtual},
            "model": model, "data": {"path": data},
            "train": {"micro_batches": micro, "micro_batch_size": WINDOWS // (4 * micro), "recompute": recompute},
            "checkpoint": {"dir": ""}, "log": {"progress": False}}


def _compare(world, sections: dict, reference: tuple | None, label: str) -> None:
    trainer = make_trainer(world, sections)
    try:
        if trainer.params.ep is not None:
            held = [v.shape[0] for i in trainer.params.layer_indices()
                    for n, v in trainer.params.export()[i].items() if n.startswith("mlp/experts/")]
            assert all(n == 2 for n in held), held            # 2 of the 4 experts on each rank
        loss = trainer.compute_gradients(0)
        grads = trainer.gather("grads")
        comm_s = trainer.ep.take_seconds() if trainer.ep is not None else None
    finally:
        trainer.close()
    if world.Get_rank() == 0:
        ref_loss, ref_grads = reference
        largest = max(float(np.abs(v).max()) for g in ref_grads for v in g.values())
        assert any("mlp/experts/gate" in g for g in grads.values())
        for i, group in enumerate(ref_grads):
            assert sorted(grads[i]) == sorted(group), (label, i)
            for name, ref in group.items():
                assert float(np.abs(grads[i][name] - ref).max()) / largest <= TOLERANCE, (label, i, name)
        assert abs(loss - ref_loss) <= TOLERANCE * abs(ref_loss), (label, loss, ref_loss)
        assert comm_s is None or comm_s > 0


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_expert_parallel_gradients_equal_transformers(world, shared_tmp, arch):
    """dp=4 (ep=2) x pp=2 under 1f1b and zb-h1, with the load-balancing loss: loss and every gradient (experts,
    routers, dense blocks) equal transformers' autograd."""
    if world.Get_size() != 8:
        pytest.skip("runs on exactly 8 ranks (dp 4 with ep 2, pp 2)")
    hf, data, reference = _setup(world, shared_tmp, arch, aux=0.3)
    for schedule in ("1f1b", "zb-h1"):
        _compare(world, _sections(hf, data, schedule), reference, f"{arch} {schedule}")
        world.Barrier()


@pytest.mark.mpi(min_size=8)
def test_expert_parallel_under_every_schedule_and_recompute(world, shared_tmp):
    """The ep ranks' all-to-alls pair up under gpipe, interleaved-1f1b and zb-v too, and with recomputation."""
    if world.Get_size() != 8:
        pytest.skip("runs on exactly 8 ranks (dp 4 with ep 2, pp 2)")
    hf, data, reference = _setup(world, shared_tmp, "qwen3_moe")
    for schedule, recompute in (("gpipe", "none"), ("interleaved-1f1b", "none"), ("zb-v", "none"),
                                ("1f1b", "stage"), ("zb-h1", "stage")):
        _compare(world, _sections(hf, data, schedule, recompute=recompute), reference, f"{schedule} {recompute}")
        world.Barrier()
