"""Expert-parallel state: a run at ep=2 resumes bit-identically; its checkpoint holds whole stacked experts and
reshards to ep=1 (and back) bit-equal; each rank reads only its own experts' tensors from a Hugging Face
directory.

Run: ``mpiexec -n 8 python -m pytest --with-mpi tests/train/test_expert_parallel_state.py``.
"""

from __future__ import annotations

import glob
import os

import h5py
import numpy as np
import pytest
from support.state import assert_nested_equal
from support.training import make_trainer, sub_world

MODEL = {"kind": "moe", "vocab_size": 13, "seq_len": 6, "d_model": 8, "n_heads": 4, "n_kv_heads": 2, "n_blocks": 3,
         "d_ff": 12, "n_experts": 4, "experts_per_token": 2, "moe_d_ff": 10, "moe_layers": [0, 2], "seed": 7,
         "norm_topk_prob": False, "tie_embeddings": False}
WINDOWS = 16


def _data(world, tmp: str) -> str:
    path = os.path.join(tmp, "moe-tokens.h5")
    if world.Get_rank() == 0 and not os.path.exists(path):
        rng = np.random.default_rng(5)
        with h5py.File(path, "w") as f:
            f["x"] = rng.integers(0, 13, (WINDOWS, 6)).astype(np.int32)
            f["y"] = rng.integers(0, 13, (WINDOWS, 6)).astype(np.int32)
    world.Barrier()
    return path


def _sections(data: str, ck: str, dp: int, pp: int, ep: int, resume: bool = False) -> dict:
    return {"parallel": {"dp": dp, "pp": pp, "ep": ep, "schedule": "1f1b"},
            "model": {**MODEL, "dtype": "float64"}, "data": {"path": data},
            "train": {"micro_batches": 2, "micro_batch_size": WINDOWS // (2 * dp) // 2, "optimizer": "adam",
                      "lr": 0.01, "grad_clip": 1.0},
            "checkpoint": {"dir": ck, "resume": resume, "keep": 3}, "log": {"progress": False}}


@pytest.mark.mpi(min_size=4)
def test_interrupted_expert_parallel_run_resumes_bit_identically(world, shared_tmp):
    """dp=2 (ep=2) x pp=2: 2 steps, save, close; resume for 2 more: parameters and optimizer state bit-equal to 4
    uninterrupted steps."""
    data = _data(world, shared_tmp)
    comm = sub_world(world, 4)
    if comm is not None:
        whole = make_trainer(comm, _sections(data, os.path.join(shared_tmp, "ep-whole"), 2, 2, 2))
        losses = [whole.train_step(s) for s in range(4)]
        want = (whole.gather("params"), whole.gather("optimizer"))
        whole.close()
        ck = os.path.join(shared_tmp, "ep-ck")
        first = make_trainer(comm, _sections(data, ck, 2, 2, 2))
        for s in range(2):
            first.train_step(s)
        first.save_checkpoint(2)
        first.close()
        second = make_trainer(comm, _sections(data, ck, 2, 2, 2, resume=True))
        resumed = [second.train_step(s) for s in range(2, 4)]
        got = (second.gather("params"), second.gather("optimizer"))
        second.close()
        if comm.Get_rank() == 0:
            assert resumed == losses[2:]
            assert_nested_equal(got[0], want[0])
            assert_nested_equal(got[1], want[1])
            assert got[0][1]["mlp/experts/gate"].shape == (4, 8, 10)       # whole: both ranks' experts
        comm.Free()
    world.Barrier()


@pytest.mark.mpi(min_size=8)
def test_expert_parallel_checkpoint_reshards_between_ep_1_and_2(world, shared_tmp):
    """Saved at dp=4 (ep=2) x pp=2; the files hold whole (E, ...) experts; loaded at ep=1 and at dp=2 (ep=2): state
    bit-equal. Saved at ep=1, loaded at ep=2: bit-equal too."""
    data = _data(world, shared_tmp)
    for source, targets in (((4, 2, 2), [(4, 2, 1), (2, 2, 2), (2, 1, 2)]), ((2, 2, 1), [(4, 2, 2)])):
        ck = os.path.join(shared_tmp, f"ep-reshard-{source[2]}")
        reference = None
        comm = sub_world(world, source[0] * source[1])
        if comm is not None:
            trainer = make_trainer(comm, _sections(data, ck, *source))
            for s in range(2):
                trainer.train_step(s)
            trainer.save_checkpoint(2)
            reference = (trainer.gather("params"), trainer.gather("optimizer"))
            trainer.close()
            comm.Free()
        params, opt = world.bcast(reference, root=0)
        if world.Get_rank() == 0:
            first = sorted(glob.glob(os.path.join(ck, "**", "step-00000002", "*.h5"), recursive=True))[0]
            with h5py.File(first) as f:
                assert f["layers/0001/mlp/experts/gate"].shape == (4, 8, 10)
        norms = []
        for dp, pp, ep in targets:
            comm = sub_world(world, dp * pp)
            if comm is not None:
                trainer = make_trainer(comm, _sections(data, ck, dp, pp, ep, resume=True))
                got = (trainer.gather("params"), trainer.gather("optimizer"))
                norm = trainer.run_step(2).decision.grad_norm     # the next step's global norm (clipping's)
                trainer.close()
                if comm.Get_rank() == 0:
                    assert_nested_equal(got[0], params)
                    assert_nested_equal(got[1], opt)
                comm.Free()
            norms.append(world.bcast(norm if world.Get_rank() == 0 else None, root=0))
            world.Barrier()
        # the same global batch at every layout: every expert counted once in the norm, whatever ep
        assert all(abs(n - norms[0]) <= 1e-12 * norms[0] for n in norms), norms
