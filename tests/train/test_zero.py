"""ZeRO-1 (train.zero = 1, issue #38): a GPT (tied embedding across pipeline ranks) and a llama trained 5 steps at
dp=2 x pp=2 and dp=4 x pp=2 equal zero = 0 (bit for bit at dp = 2, where the reduce-scatter adds in the
allreduce's order; within 1e-6 of the largest weight at dp = 4), with tensor parallelism too; each rank holds 1/dp
of the optimizer state; a zero = 1 checkpoint resumes at other dp and at zero = 0, and continues the run."""

import os

import numpy as np
import pytest
from support.state import assert_nested_equal
from support.training import make_trainer, sub_world

GPT = {"kind": "gpt", "vocab_size": 11, "seq_len": 6, "d_model": 8, "n_heads": 2, "n_blocks": 2, "d_ff": 12,
       "seed": 3}
LLAMA = {"kind": "llama", "vocab_size": 13, "seq_len": 6, "d_model": 8, "n_heads": 4, "n_kv_heads": 2, "n_blocks": 2,
         "d_ff": 12, "qkv_bias": True, "seed": 7, "tie_embeddings": False}
STEPS = 5


def _sections(model: dict, dp: int, pp: int, zero: int, ck: str = "", resume: bool = False, tp: int = 1,
              steps: int = STEPS) -> dict:
    return {"parallel": {"dp": dp, "pp": pp, "tp": tp}, "model": model,
            "data": {"synthetic_samples": 64, "shuffle": True, "seed": 1},
            "train": {"steps": steps, "micro_batches": 2, "micro_batch_size": 8 // dp, "optimizer": "adamw",
                      "lr": 0.01, "weight_decay": 0.1, "zero": zero, "lr_schedule": "cosine", "warmup_steps": 2},
            "checkpoint": {"dir": ck, "resume": resume, "keep": 3}, "log": {"progress": False}}


def _run(comm, sections: dict, steps: range) -> tuple[list[float], dict, dict, int]:
    """Train the given steps; return (losses, params, optimizer state, this rank's optimizer bytes)."""
    trainer = make_trainer(comm, sections)
    try:
        losses = [trainer.train_step(s) for s in steps]
        params, opt = trainer.gather("params"), trainer.gather("optimizer")
        state_bytes = trainer.memory_bytes()[1]
    finally:
        trainer.close()
    return losses, params, opt, state_bytes


def _leaves(tree: dict, path: tuple = ()) -> dict[tuple, np.ndarray]:
    out = {}
    for key, value in tree.items():
        out.update(_leaves(value, (*path, key)) if isinstance(value, dict) else {(*path, key): value})
    return out


def _close(got: dict, want: dict, tolerance: float, group=lambda path: ()) -> None:
    """Every array of got within tolerance x the largest magnitude of its group's arrays in want (default: all of
    them, the model's largest weight). Adam turns the rounding noise of a gradient that is 0 in exact arithmetic
    (a GPT's key biases) into steps of 1e-7 of the largest weight, so a per-tensor relative bound would not hold
    for any change of summation order."""
    a, b = _leaves(got), _leaves(want)
    assert a.keys() == b.keys()
    scale: dict = {}
    for path, value in b.items():
        scale[group(path)] = max(scale.get(group(path), 0.0), float(np.abs(value).max()))
    for path in b:
        assert float(np.abs(a[path] - b[path]).max()) <= tolerance * scale[group(path)], path


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("model", [GPT, LLAMA], ids=["gpt", "llama"])
@pytest.mark.parametrize("dp", [2, 4])
def test_zero_one_trains_as_zero_zero(world, model, dp):
    comm = sub_world(world, dp * 2)
    if comm is None:
        return
    base = _run(comm, _sections(model, dp, 2, 0), range(STEPS))
    sharded = _run(comm, _sections(model, dp, 2, 1), range(STEPS))
    bytes_by_rank = comm.gather((base[3], sharded[3]), root=0)
    if comm.Get_rank() == 0:
        if dp == 2:                      # the same additions in the same order: bit for bit
            assert sharded[0] == base[0]
            assert_nested_equal(sharded[1], base[1])
            assert_nested_equal(sharded[2], base[2])
        else:
            assert np.allclose(sharded[0], base[0], rtol=1e-6, atol=0)
            _close(sharded[1], base[1], 1e-6)
            _close(sharded[2], base[2], 1e-5, group=lambda path: path[1])    # per state: exp_avg, exp_avg_sq
        for whole, share in bytes_by_rank:   # each replica holds its 1/dp block (one element more at most)
            assert whole > 0 and share <= whole // dp + 2 * 4 * 2, (whole, share)
    comm.Free()


@pytest.mark.mpi(min_size=8)
def test_zero_one_with_tensor_parallelism_is_bit_identical(world):
    """dp=2 x pp=2 x tp=2: a llama's key/value heads shared by two tp ranks, a tied GPT's vocabulary rows."""
    for model in (GPT, {**LLAMA, "n_kv_heads": 1, "tie_embeddings": True}):
        base = _run(world, _sections(model, 2, 2, 0, tp=2), range(3))
        sharded = _run(world, _sections(model, 2, 2, 1, tp=2), range(3))
        if world.Get_rank() == 0:
            assert sharded[0] == base[0]
            assert_nested_equal(sharded[1], base[1])
            assert_nested_equal(sharded[2], base[2])


@pytest.mark.mpi(min_size=8)
def test_a_zero_checkpoint_resumes_at_other_dp_and_without_zero(world, shared_tmp):
    """Saved by zero = 1 at dp=2 x pp=2 after 3 steps; loaded at dp=4 (zero 1), dp=1 (zero 1) and dp=2 (zero 0):
    parameters and whole optimizer state bit-equal to what was saved; 2 more steps at dp=4 continue the run."""
    ck = os.path.join(shared_tmp, "zero-ck")
    comm = sub_world(world, 4)
    saved = None
    if comm is not None:
        trainer = make_trainer(comm, _sections(LLAMA, 2, 2, 1, ck, steps=5))
        for s in range(3):
            trainer.train_step(s)
        trainer.save_checkpoint(3)
        saved = (trainer.gather("params"), trainer.gather("optimizer"))
        trainer.close()
        comm.Free()
    params, opt = world.bcast(saved, root=0)
    for dp, zero in ((4, 1), (1, 1), (2, 0)):
        comm = sub_world(world, dp * 2)
        if comm is not None:
            trainer = make_trainer(comm, _sections(LLAMA, dp, 2, zero, ck, resume=True, steps=5))
            got = (trainer.gather("params"), trainer.gather("optimizer"))
            trainer.close()
            if comm.Get_rank() == 0:
                assert_nested_equal(got[0], params)
                assert_nested_equal(got[1], opt)
            comm.Free()
        world.Barrier()
    comm = sub_world(world, 8)
    whole = _run(comm, _sections(LLAMA, 4, 2, 0), range(5))
    resumed = _run(comm, _sections(LLAMA, 4, 2, 1, ck, resume=True), range(3, 5))
    if comm.Get_rank() == 0:
        assert np.allclose(resumed[0], whole[0][3:], rtol=1e-6, atol=0)
        _close(resumed[1], whole[1], 1e-6)
    comm.Free()
