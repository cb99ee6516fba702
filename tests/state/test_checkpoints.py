"""Checkpoints on real MPI ranks: round trip, reshard to other layouts, agreement on a corrupt file."""

from __future__ import annotations

import os

import numpy as np
import pytest
from support.state import assert_nested_equal, flip_byte_in_dataset
from support.training import make_trainer, sub_world

# 8 layers so that every layout up to pp = 8 fits; global batch = dp x 2 x micro_batch_size = 8
MODEL = {"dims": [6, 7, 5, 8, 6, 5, 7, 6, 4], "activation": "tanh", "final_activation": False}
GLOBAL_ROWS = 4   # dp x micro_batch_size, kept equal across layouts so every step sees the same samples


def _sections(ck_dir: str, dp: int, pp: int, resume: bool = False, schedule: str = "gpipe", virtual: int = 1) -> dict:
    return {"parallel": {"dp": dp, "pp": pp, "schedule": schedule, "virtual_stages": virtual}, "model": MODEL,
            "data": {"synthetic_samples": 40, "shuffle": True, "seed": 5},
            "train": {"micro_batches": 2, "micro_batch_size": GLOBAL_ROWS // dp, "optimizer": "adam", "lr": 0.01,
                      "loss": "cross_entropy"},
            "checkpoint": {"dir": ck_dir, "resume": resume, "keep": 3}, "log": {"progress": False}}


def _save_reference(world, ck_dir, schedule="gpipe", virtual=1):
    """At (dp=2, pp=4): 3 steps, save, then one more step. Returns (params, optimizer, next loss) on all ranks."""
    comm = sub_world(world, 8)
    result = None
    if comm is not None:
        trainer = make_trainer(comm, _sections(ck_dir, 2, 4, schedule=schedule, virtual=virtual))
        for step in range(3):
            trainer.train_step(step)
        trainer.save_checkpoint(3)
        params, opt = trainer.gather("params"), trainer.gather("optimizer")
        next_loss = trainer.train_step(3)
        result = (params, opt, next_loss)
        trainer.close()
        comm.Free()
    return world.bcast(result, root=0)


def _resume_everywhere(world, ck_dir: str, reference: tuple, saved_as: tuple, targets: list[tuple]) -> None:
    """Resume ck_dir at each (dp, pp, schedule, virtual): parameters and optimizer state bit-equal, next loss close.

    The next step's loss is bitwise equal only where layout and schedule are the saved ones (saved_as);
    elsewhere float32 sums run in another order, so it must agree within 1e-5 relative.
    """
    params, opt, next_loss = reference
    for dp, pp, schedule, virtual in targets:
        comm = sub_world(world, dp * pp)
        if comm is None:
            continue
        trainer = make_trainer(comm, _sections(ck_dir, dp, pp, resume=True, schedule=schedule, virtual=virtual))
        assert trainer.start_step == 3 and trainer.optimizer.steps == 3
        got_params, got_opt = trainer.gather("params"), trainer.gather("optimizer")
        loss = trainer.train_step(3)
        if comm.Get_rank() == 0:
            assert_nested_equal(got_params, params)
            assert_nested_equal(got_opt, opt)
            assert sorted(got_opt[0]) == ["exp_avg", "exp_avg_sq"]
        tolerance = 0.0 if (dp, pp, schedule) == saved_as else 1e-5
        assert abs(loss - next_loss) <= tolerance * abs(next_loss), (dp, pp, schedule, loss, next_loss)
        trainer.close()
        comm.Free()


@pytest.mark.mpi(min_size=8)
def test_reshard_to_other_layouts_is_bit_exact(world, shared_tmp):
    ck_dir = os.path.join(shared_tmp, "ck")
    reference = _save_reference(world, ck_dir)
    # saved with GPipe at (2, 4); loaded at other layouts and under other schedules
    _resume_everywhere(world, ck_dir, reference, (2, 4, "gpipe"),
                       [(2, 4, "gpipe", 1), (1, 2, "gpipe", 1), (4, 1, "gpipe", 1), (1, 8, "gpipe", 1),
                        (2, 2, "gpipe", 1), (2, 2, "1f1b", 1), (1, 4, "zb-h1", 1),
                        (1, 2, "interleaved-1f1b", 2), (1, 4, "zb-v", 2), (2, 2, "zb-v", 2)])


@pytest.mark.mpi(min_size=8)
def test_zbv_checkpoint_reshards_to_other_layouts_and_schedules(world, shared_tmp):
    """Saved with ZB-V at (2, 4) (rank r's file holds stages r and 7 - r), resumed under GPipe and others."""
    ck_dir = os.path.join(shared_tmp, "ck-zbv")
    reference = _save_reference(world, ck_dir, schedule="zb-v", virtual=2)
    _resume_everywhere(world, ck_dir, reference, (2, 4, "zb-v"),
                       [(2, 4, "zb-v", 2), (2, 4, "gpipe", 1), (1, 2, "gpipe", 1), (4, 1, "gpipe", 1),
                        (1, 8, "1f1b", 1), (1, 2, "interleaved-1f1b", 2), (1, 4, "zb-v", 2)])


@pytest.mark.mpi(min_size=8)
def test_corrupt_file_is_refused_on_every_rank_at_once(world, shared_tmp):
    from hpcpipe.errors import AgreedError
    from hpcpipe.state.directory_protocol import read_latest

    ck_dir = os.path.join(shared_tmp, "ck")
    _save_reference(world, ck_dir)
    bad = os.path.join(ck_dir, read_latest(ck_dir), "stage-002.h5")
    if world.Get_rank() == 0:
        flip_byte_in_dataset(bad, "layers/0004/weight")   # only pipeline rank 2 (world ranks 2, 6) reads it
    world.Barrier()
    comm = sub_world(world, 8)
    if comm is None:
        return
    with pytest.raises(AgreedError) as info:
        make_trainer(comm, _sections(ck_dir, 2, 4, resume=True))
    assert "stage-002.h5" in str(info.value) and "SHA-256" in str(info.value)
    messages = comm.allgather(str(info.value))
    assert len(set(messages)) == 1   # every rank refused with the same message
    comm.Free()


@pytest.mark.mpi(min_size=8)
def test_init_from_checkpoint_loads_parameters_only(world, shared_tmp):
    ck_dir = os.path.join(shared_tmp, "ck")
    params, _, _ = _save_reference(world, ck_dir)
    comm = sub_world(world, 4)
    if comm is None:
        return
    sections = _sections(os.path.join(shared_tmp, "other"), 2, 2)
    sections["model"] = dict(MODEL, init=ck_dir)
    trainer = make_trainer(comm, sections)
    assert trainer.start_step == 0 and trainer.optimizer.steps == 0
    got = trainer.gather("params")
    opt = trainer.gather("optimizer")
    if comm.Get_rank() == 0:
        assert_nested_equal(got, params)
        assert all(not np.any(v) for layer in opt.values() for state in layer.values() for v in state.values())
    trainer.close()
    comm.Free()


@pytest.mark.mpi(min_size=2)
def test_disk_full_while_writing_is_agreed_cleaned_and_keeps_latest(world, shared_tmp, monkeypatch):
    """ENOSPC on one writer after the free-space check passed: one agreed message, exit code 1, nothing left."""
    import errno

    from hpcpipe.errors import AgreedError
    from hpcpipe.state import collective as checkpoint_mpi
    from hpcpipe.state import directory_protocol as cf

    comm = sub_world(world, 2)
    if comm is None:
        return
    real = checkpoint_mpi.write_file_durably

    def full(path, data):
        if comm.Get_rank() == 1:     # pipeline rank 1's writer hits a full disk
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, data)

    ck_dir = os.path.join(shared_tmp, "ck-full")
    trainer = make_trainer(comm, _sections(ck_dir, 1, 2))
    trainer.train_step(0)
    first = trainer.save_checkpoint(1)
    monkeypatch.setattr(checkpoint_mpi, "write_file_durably", full)
    trainer.train_step(1)
    with pytest.raises(AgreedError) as info:
        trainer.save_checkpoint(2)
    message = str(info.value)
    assert info.value.code == 1 and len(set(comm.allgather(message))) == 1
    assert f"checkpoint.dir {ck_dir!r} has " in message and "the checkpoint of step 2 needs about" in message
    assert "step-00000001 is kept" in message
    comm.Barrier()
    run_dir = first.parent
    assert trainer.run_dir == run_dir
    assert cf.leftovers(run_dir) == [] and cf.committed_steps(run_dir) == [1]       # the partial save is gone
    assert cf.read_latest(ck_dir) == f"{run_dir.name}/{cf.step_name(1)}"            # latest kept
    trainer.close()

    # a fresh run whose first save fails leaves no run directory behind
    other = os.path.join(shared_tmp, "ck-full-fresh")
    trainer = make_trainer(comm, _sections(other, 1, 2))
    with pytest.raises(AgreedError):
        trainer.save_checkpoint(0)
    comm.Barrier()
    assert cf.run_dirs(other) == [] and trainer.run_dir is None
    trainer.close()
    comm.Free()


@pytest.mark.mpi(min_size=2)
def test_save_info_attrs_are_root_attributes_of_every_stage_file(world, shared_tmp, monkeypatch):
    """SaveInfo.attrs (a GPT's tokenizer) lands in every stage file; verify passes, export and the source see it."""
    import dataclasses

    import h5py

    from hpcpipe.checkpoint import export, verify
    from hpcpipe.state.sources import resolve_weights
    from hpcpipe.state.tokenizer import StoredTokenizer

    tokenizer = '{"kind": "bytes"}'
    comm = sub_world(world, 2)
    if comm is None:
        return
    ck_dir = os.path.join(shared_tmp, "ck-attrs")
    trainer = make_trainer(comm, _sections(ck_dir, 1, 2))
    # what a GPT run carries (the data file's tokenizer), here on the small MLP of this file
    trainer.setup = dataclasses.replace(trainer.setup, tokenizer=StoredTokenizer(tokenizer))
    trainer.train_step(0)
    final = trainer.save_checkpoint(1)
    trainer.close()
    if comm.Get_rank() == 0:
        for pp_rank in range(2):
            with h5py.File(final / f"stage-00{pp_rank}.h5") as f:
                assert f.attrs["tokenizer"] == tokenizer and f.attrs["pp_rank"] == pp_rank
        assert verify(ck_dir).step == 1
        assert resolve_weights(ck_dir).tokenizer().attr == tokenizer
        out = os.path.join(shared_tmp, "attrs-export.h5")
        export(ck_dir, out)
        with h5py.File(out) as f:
            assert f.attrs["tokenizer"] == tokenizer and "pp_rank" not in f.attrs
    comm.Barrier()
    comm.Free()


@pytest.mark.mpi(min_size=2)
def test_close_returns_on_every_rank_after_the_run_lock_is_gone(world, shared_tmp):
    """A run started next in the same process must not find the closed run's lock (its probe runs on every rank)."""
    import time

    from hpcpipe.state.run_lock import live_holder
    comm = sub_world(world, 2)
    if comm is None:
        return
    trainer = make_trainer(comm, _sections(os.path.join(shared_tmp, "close-lock"), 1, 2))
    trainer.train_step(0)
    run_dir = trainer.save_checkpoint(1).parent   # rank 0 now holds the run's lock
    if comm.Get_rank() == 0:
        time.sleep(0.5)   # rank 0 closes last: the other rank must still not return while the lock is held
    trainer.close()
    assert live_holder(run_dir) is None
    comm.Free()
