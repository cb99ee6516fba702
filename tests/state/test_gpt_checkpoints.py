"""GPT checkpoints on real MPI ranks (Adam): interrupted runs resume bit-identically; checkpoints reshard exactly."""

from __future__ import annotations

import os

import numpy as np
import pytest
from support.state import assert_nested_equal
from support.training import make_trainer, sub_world

# 8 layer groups (6 blocks): every layout up to pp = 8, and zb-v at pp = 4
MODEL = {"kind": "gpt", "vocab_size": 13, "seq_len": 8, "d_model": 8, "n_heads": 2, "n_blocks": 6, "seed": 2}
GLOBAL_ROWS = 4   # dp x micro_batch_size, equal across layouts so that every step sees the same windows


def _sections(ck_dir: str, dp: int, pp: int, schedule: str = "gpipe", resume: bool = False, tied: bool = True,
              steps: int = 6) -> dict:
    virtual = 2 if schedule in ("zb-v", "interleaved-1f1b") else 1
    return {"parallel": {"dp": dp, "pp": pp, "schedule": schedule, "virtual_stages": virtual},
            "model": {**MODEL, "tie_embeddings": tied},
            "data": {"synthetic_samples": 64, "shuffle": True, "seed": 1},
            "train": {"steps": steps, "micro_batches": 2, "micro_batch_size": GLOBAL_ROWS // dp, "optimizer": "adam",
                      "lr": 0.01},
            "checkpoint": {"dir": ck_dir, "resume": resume, "keep": 3}, "log": {"progress": False}}


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("dp,pp,schedule,tied", [(2, 4, "1f1b", True), (1, 2, "gpipe", False), (2, 2, "zb-h1", True),
                                                 (1, 4, "zb-v", True), (4, 1, "gpipe", True)])
def test_interrupted_gpt_run_resumes_bit_identically(world, shared_tmp, dp, pp, schedule, tied):
    """3 steps, save, close; resume for 3 more: parameters and optimizer state bit-equal to 6 uninterrupted steps."""
    comm = sub_world(world, dp * pp)
    if comm is None:
        return
    tag = f"{dp}x{pp}-{schedule}-{tied}"
    whole = make_trainer(comm, _sections(os.path.join(shared_tmp, f"gpt-whole-{tag}"), dp, pp, schedule, tied=tied))
    losses = [whole.train_step(s) for s in range(6)]
    want_params, want_opt = whole.gather("params"), whole.gather("optimizer")
    whole.close()

    ck_dir = os.path.join(shared_tmp, f"gpt-ck-{tag}")
    first = make_trainer(comm, _sections(ck_dir, dp, pp, schedule, tied=tied))
    for s in range(3):
        first.train_step(s)
    first.save_checkpoint(3)
    first.close()
    second = make_trainer(comm, _sections(ck_dir, dp, pp, schedule, resume=True, tied=tied))
    assert second.start_step == 3
    resumed = [second.train_step(s) for s in range(3, 6)]
    got_params, got_opt = second.gather("params"), second.gather("optimizer")
    second.close()
    if comm.Get_rank() == 0:
        assert resumed == losses[3:]
        assert_nested_equal(got_params, want_params)
        assert_nested_equal(got_opt, want_opt)
        assert sorted(got_params) == list(range(8)) and "attn/qkv/weight" in got_params[3]
        assert ("head/weight" in got_params[7]) == (not tied)
    comm.Free()


@pytest.mark.mpi(min_size=8)
def test_gpt_checkpoint_reshards_to_other_layouts_and_schedules(world, shared_tmp):
    """Saved at (dp=2, pp=4) under 1F1B; loaded at 5 other layouts: state bit-equal, next loss within float32."""
    ck_dir = os.path.join(shared_tmp, "gpt-reshard")
    comm = sub_world(world, 8)
    reference = None
    if comm is not None:
        trainer = make_trainer(comm, _sections(ck_dir, 2, 4, "1f1b"))
        for s in range(3):
            trainer.train_step(s)
        trainer.save_checkpoint(3)
        params, opt = trainer.gather("params"), trainer.gather("optimizer")
        reference = (params, opt, trainer.train_step(3))
        trainer.close()
        comm.Free()
    params, opt, next_loss = world.bcast(reference, root=0)
    for dp, pp, schedule in [(1, 1, "gpipe"), (4, 2, "gpipe"), (1, 8, "zb-h1"), (2, 2, "interleaved-1f1b"),
                             (1, 4, "zb-v"), (2, 4, "1f1b")]:
        comm = sub_world(world, dp * pp)
        if comm is None:
            continue
        trainer = make_trainer(comm, _sections(ck_dir, dp, pp, schedule, resume=True))
        got_params, got_opt = trainer.gather("params"), trainer.gather("optimizer")
        loss = trainer.train_step(3)
        if comm.Get_rank() == 0:
            assert_nested_equal(got_params, params)
            assert_nested_equal(got_opt, opt)
            tolerance = 0.0 if (dp, pp, schedule) == (2, 4, "1f1b") else 1e-5
            assert abs(loss - next_loss) <= tolerance * abs(next_loss), (dp, pp, schedule, loss, next_loss)
        trainer.close()
        comm.Free()


@pytest.mark.mpi(min_size=2)
def test_tied_copies_stay_identical_through_training(world, shared_tmp):
    """At pp = 2 the last stage holds its own tok_emb for the head: after Adam steps it equals the embedding's."""
    comm = sub_world(world, 2)
    if comm is None:
        return
    from hpcpipe.nn.rank_parameters import TIED
    trainer = make_trainer(comm, _sections("", 1, 2, "1f1b", steps=4) | {"checkpoint": {"dir": ""}})
    for s in range(4):
        trainer.train_step(s)
    mine = trainer.params.host(trainer.params.param(TIED if trainer.params.tied_copy else 0, "tok_emb"))
    tables = comm.allgather(mine)
    if comm.Get_rank() == 0:
        assert trainer.params.tied_copy is False
        np.testing.assert_array_equal(tables[0], tables[1])
        initial = trainer.model.init_arrays([0], MODEL["seed"], "float32")[0]["tok_emb"]
        assert not np.array_equal(tables[0], initial)        # it did train
    trainer.close()
    comm.Free()


@pytest.mark.mpi(min_size=4)
def test_model_init_takes_a_gpt_checkpoint_or_its_exported_file(world, shared_tmp):
    """model.init from a GPT checkpoint saved at pp = 4, and from its export, at pp = 2: the saved parameters."""
    from hpcpipe.checkpoint import export
    from hpcpipe.state.directory_protocol import read_latest

    ck_dir = os.path.join(shared_tmp, "gpt-init")
    exported = os.path.join(shared_tmp, "gpt-init.h5")
    comm = sub_world(world, 4)
    if comm is None:
        return
    trainer = make_trainer(comm, _sections(ck_dir, 1, 4, "1f1b", tied=False))
    for s in range(2):
        trainer.train_step(s)
    trainer.save_checkpoint(2)
    saved = trainer.gather("params")
    trainer.close()
    if comm.Get_rank() == 0:
        export(os.path.join(ck_dir, read_latest(ck_dir)), exported)
    comm.Barrier()
    for source in (ck_dir, exported):
        sections = _sections("", 2, 2, "gpipe", tied=False)
        sections["model"]["init"] = source
        sections["checkpoint"] = {"dir": ""}
        trainer = make_trainer(comm, sections)
        got = trainer.gather("params")
        assert trainer.start_step == 0 and trainer.optimizer.steps == 0
        trainer.close()
        if comm.Get_rank() == 0:
            assert_nested_equal(got, saved)
    comm.Free()
