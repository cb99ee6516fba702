"""Tensor parallelism on real MPI ranks: loss and every gradient at tp = 2 and 4 equal tp = 1 (float64, 1e-10
relative) for the GPT, the llama kind (key/value heads split, and held by several ranks when tp > n_kv_heads) and
the MLP, at (dp, pp, tp) = (1, 1, 2), (1, 2, 2), (2, 2, 2) under gpipe, 1f1b and zb-h1; recomputation equal; a
checkpoint saved at tp = 2 loads at tp = 1 and tp = 4 (and back) with bit-identical parameters and optimizer state."""

import os

import numpy as np
import pytest
from support.state import assert_nested_equal
from support.training import make_trainer, sub_world

GPT = {"kind": "gpt", "vocab_size": 13, "seq_len": 6, "d_model": 8, "n_heads": 4, "n_blocks": 4, "d_ff": 12,
       "seed": 7}
LLAMA = {"kind": "llama", "vocab_size": 13, "seq_len": 6, "d_model": 16, "n_heads": 4, "n_kv_heads": 2,
         "n_blocks": 4, "d_ff": 12, "qkv_bias": True, "rope_theta": 500000.0, "seed": 7}
QWEN3 = {**LLAMA, "qkv_bias": False, "qk_norm": True, "head_dim": 6}    # q/k norms: replicated, summed over tp
MLP = {"dims": [8, 12, 8, 12, 4], "activation": "tanh"}
TOLERANCE = 1e-10


def _sections(model: dict, dp: int, pp: int, tp: int, schedule: str = "gpipe", tied: bool = True,
              recompute: str = "none", loss: str | None = None) -> dict:
    model = {**model, "dtype": "float64"} | ({"tie_embeddings": tied} if "kind" in model else {})
    train = {"micro_batches": 2, "micro_batch_size": 4 // dp, "recompute": recompute} | ({"loss": loss} if loss else {})
    return {"parallel": {"dp": dp, "pp": pp, "tp": tp, "schedule": schedule}, "model": model,
            "data": {"synthetic_samples": 64}, "train": train, "checkpoint": {"dir": ""}, "log": {"progress": False}}


def _gradients(world, sections: dict):
    n = sections["parallel"]["dp"] * sections["parallel"]["pp"] * sections["parallel"]["tp"]
    comm = sub_world(world, n)
    result = None
    if comm is not None:
        trainer = make_trainer(comm, sections)
        try:
            loss = trainer.compute_gradients(0)
            result = (loss, trainer.gather("grads"))
        finally:
            trainer.close()
            comm.Free()
    world.Barrier()
    return result


def _compare(got, want, label) -> None:
    loss, grads = got
    ref_loss, ref_grads = want
    largest = max(float(np.abs(v).max()) for g in ref_grads.values() for v in g.values())
    assert sorted(grads) == sorted(ref_grads), label
    for i, group in ref_grads.items():
        assert sorted(grads[i]) == sorted(group), (label, i)
        for name, ref in group.items():
            err = float(np.abs(grads[i][name] - ref).max()) / largest
            assert err <= TOLERANCE, (label, i, name, err)
    assert abs(loss - ref_loss) <= TOLERANCE * abs(ref_loss), (label, loss, ref_loss)


LAYOUTS = [(1, 1, 2, "gpipe"), (1, 2, 2, "1f1b"), (2, 2, 2, "zb-h1"), (1, 2, 2, "zb-h1"), (2, 2, 2, "gpipe"),
           (1, 1, 4, "gpipe"), (1, 2, 4, "1f1b")]


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("name,model", [("gpt", GPT), ("llama", LLAMA), ("qwen3", QWEN3)])
@pytest.mark.parametrize("tied", [True, False])
def test_decoder_gradients_at_tp_2_and_4_equal_tp_1(world, name, model, tied):
    want = _gradients(world, _sections(model, 1, 1, 1, tied=tied))
    for dp, pp, tp, schedule in LAYOUTS:
        got = _gradients(world, _sections(model, dp, pp, tp, schedule, tied))
        if world.Get_rank() == 0:
            _compare(got, want, (name, tied, dp, pp, tp, schedule))


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("dims,loss", [([8, 12, 8, 12, 4], "mse"), ([8, 12, 8, 4], "mse"),
                                       ([8, 12, 8, 4], "cross_entropy"), ([8, 12, 8, 12, 4], "cross_entropy")])
def test_mlp_alternating_column_and_row_parallel_equals_tp_1(world, dims, loss):
    model = {**MLP, "dims": dims}
    want = _gradients(world, _sections(model, 1, 1, 1, loss=loss))
    for dp, pp, tp, schedule in LAYOUTS[:3] + [(1, 1, 4, "gpipe")]:
        got = _gradients(world, _sections(model, dp, pp, tp, schedule, loss=loss))
        if world.Get_rank() == 0:
            _compare(got, want, (dims, loss, dp, pp, tp, schedule))


@pytest.mark.mpi(min_size=8)
def test_recompute_and_interleaved_schedules_at_tp_2(world):
    want = _gradients(world, _sections(LLAMA, 1, 1, 1))
    for schedule, recompute in (("1f1b", "stage"), ("zb-h1", "stage")):
        got = _gradients(world, _sections(LLAMA, 2, 2, 2, schedule, recompute=recompute))
        if world.Get_rank() == 0:
            _compare(got, want, (schedule, recompute))
    sections = _sections(GPT, 1, 2, 2, "interleaved-1f1b")
    sections["parallel"]["virtual_stages"] = 2
    got = _gradients(world, sections)
    want = _gradients(world, _sections(GPT, 1, 1, 1))
    if world.Get_rank() == 0:
        _compare(got, want, "interleaved")


def _train_sections(ck: str, dp: int, pp: int, tp: int, resume: bool = False) -> dict:
    return {"parallel": {"dp": dp, "pp": pp, "tp": tp}, "model": {**LLAMA, "tie_embeddings": True},
            "data": {"synthetic_samples": 64, "shuffle": True, "seed": 1},
            "train": {"steps": 4, "micro_batches": 2, "micro_batch_size": 4 // dp, "optimizer": "adam", "lr": 0.01},
            "checkpoint": {"dir": ck, "resume": resume, "keep": 5}, "log": {"progress": False}}


def _state(world, sections: dict, steps: int = 0, save: int | None = None):
    comm = sub_world(world, sections["parallel"]["dp"] * sections["parallel"]["pp"] * sections["parallel"]["tp"])
    out = None
    if comm is not None:
        trainer = make_trainer(comm, sections)
        for s in range(trainer.start_step, trainer.start_step + steps):
            trainer.train_step(s)
        if save is not None:
            trainer.save_checkpoint(save)
        out = (trainer.gather("params"), trainer.gather("optimizer"))
        trainer.close()
        comm.Free()
    world.Barrier()
    return out


@pytest.mark.mpi(min_size=8)
def test_checkpoints_reshard_across_tp_both_ways(world, shared_tmp):
    """Saved at (dp=2, pp=2, tp=2): loaded at tp = 1 and tp = 4 bit-identical; saved at tp = 4, loaded at tp = 2."""
    ck = os.path.join(shared_tmp, "tp-reshard")
    saved = _state(world, _train_sections(ck, 2, 2, 2), steps=2, save=2)
    saved = world.bcast(saved, root=0)
    for dp, pp, tp in ((1, 1, 1), (1, 2, 4), (2, 1, 4), (1, 4, 2)):
        got = _state(world, _train_sections(ck, dp, pp, tp, resume=True))
        if world.Get_rank() == 0:
            assert_nested_equal(got[0], saved[0])
            assert_nested_equal(got[1], saved[1])
    again = os.path.join(shared_tmp, "tp4-then-tp2")
    saved = world.bcast(_state(world, _train_sections(again, 1, 2, 4), steps=1, save=1), root=0)
    got = _state(world, _train_sections(again, 2, 2, 2, resume=True))
    if world.Get_rank() == 0:
        assert_nested_equal(got[0], saved[0])
        assert_nested_equal(got[1], saved[1])
