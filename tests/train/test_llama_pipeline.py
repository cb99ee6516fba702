"""The llama kind through the pipeline engine on real MPI ranks: loss and every gradient against PyTorch autograd
(float64, 1e-7 of the largest gradient) at every layout and schedule, tied and untied, grouped-query attention;
recomputation equal; an interrupted run resumes bit-identically and its checkpoint reshards exactly."""

import os

import h5py
import numpy as np
import pytest
from support.state import assert_nested_equal
from support.training import make_trainer, sub_world

# 6 layer groups (4 blocks): every layout up to pp = 4, zb-v at pp = 2; GQA 4 query / 2 key-value heads, q/k/v
# biases and llama3 RoPE scaling, so that every term of the contract shows in the gradients
MODEL = {"kind": "llama", "vocab_size": 13, "seq_len": 6, "d_model": 8, "n_heads": 4, "n_kv_heads": 2, "n_blocks": 4,
         "d_ff": 12, "qkv_bias": True, "rope_theta": 500000.0, "norm_eps": 1e-6, "seed": 7,
         "rope_scaling": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 4}}
WINDOWS = 24      # divisible by dp x micro-batches for dp in (1, 2) and micro-batches in (1, 3, 4)
TOLERANCE = 1e-7  # of the largest reference gradient


def _tokens(seed: int = 5):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, MODEL["vocab_size"], (WINDOWS, MODEL["seq_len"]))
    y = np.where(rng.random(x.shape) < 0.5, (x * 3 + 1) % MODEL["vocab_size"], rng.integers(0, 13, x.shape))
    return x.astype(np.int32), y.astype(np.int32)


def _data_file(world, tmp: str) -> str:
    path = os.path.join(tmp, "llama-tokens.h5")
    if world.Get_rank() == 0 and not os.path.exists(path):
        x, y = _tokens()
        with h5py.File(path + ".tmp", "w") as f:
            f["x"], f["y"] = x, y
        os.replace(path + ".tmp", path)
    world.Barrier()
    return path


_REFERENCES: dict = {}


def _shape(tied: bool):
    from hpcpipe.config import from_dict
    from hpcpipe.nn.llama.model import llama_shape
    return llama_shape(from_dict({"model": {**MODEL, "tie_embeddings": tied}, "parallel": {"pp": 1}}).model)


def _reference(tied: bool):
    """(loss, grads by group) of PyTorch on the model's initial weights and all windows (computed once)."""
    if tied not in _REFERENCES:
        from support.llama_reference import torch_llama

        from hpcpipe.nn.llama.model import LlamaModel

        shape = _shape(tied)
        groups = [LlamaModel(shape).init_group(i, MODEL["seed"], "float64") for i in range(shape.n_groups)]
        x, y = _tokens()
        loss, grads, _ = torch_llama(shape, groups, x.astype(np.int64), y.astype(np.int64))
        _REFERENCES[tied] = (loss, grads)
    return _REFERENCES[tied]


def _sections(data: str, dp: int, pp: int, schedule: str, micro: int, tied: bool, recompute: str = "none") -> dict:
    virtual = 2 if schedule in ("zb-v", "interleaved-1f1b") else 1
    return {"parallel": {"dp": dp, "pp": pp, "schedule": schedule, "virtual_stages": virtual},
            "model": {**MODEL, "tie_embeddings": tied, "dtype": "float64"}, "data": {"path": data},
            "train": {"micro_batches": micro, "micro_batch_size": WINDOWS // (dp * micro), "recompute": recompute},
            "checkpoint": {"dir": ""}, "log": {"progress": False}}


def _check(comm, data, dp, pp, schedule, micro, tied, recompute="none"):
    """Run one layout; on its rank 0 compare loss and gradients with PyTorch."""
    trainer = make_trainer(comm, _sections(data, dp, pp, schedule, micro, tied, recompute))
    try:
        loss = trainer.compute_gradients(0)
        grads = trainer.gather("grads")
    finally:
        trainer.close()
    if comm.Get_rank() != 0:
        return
    ref_loss, ref_grads = _reference(tied)
    largest = max(float(np.abs(v).max()) for g in ref_grads for v in g.values())
    assert sorted(grads) == list(range(len(ref_grads)))
    for i, group in enumerate(ref_grads):
        assert sorted(grads[i]) == sorted(group), i
        for name, ref in group.items():
            err = float(np.abs(grads[i][name] - ref).max()) / largest
            assert err <= TOLERANCE, (dp, pp, schedule, micro, tied, i, name, err)
    assert abs(loss - ref_loss) <= TOLERANCE * abs(ref_loss), (dp, pp, schedule, micro, tied, loss, ref_loss)


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("dp,pp", [(1, 1), (2, 1), (1, 2), (2, 2), (1, 4), (2, 4)])
def test_llama_gpipe_at_every_layout_matches_torch(world, shared_tmp, dp, pp, tied):
    data = _data_file(world, shared_tmp)
    comm = sub_world(world, dp * pp)
    if comm is None:
        return
    for micro in (1, 3):
        _check(comm, data, dp, pp, "gpipe", micro, tied)
    comm.Free()


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b", "zb-h1", "zb-v"])
def test_llama_every_schedule_matches_torch(world, shared_tmp, schedule, tied):
    data = _data_file(world, shared_tmp)
    for dp, pp in ((1, 2), (2, 2)):
        comm = sub_world(world, dp * pp)
        if comm is not None:
            _check(comm, data, dp, pp, schedule, 4 if schedule == "interleaved-1f1b" else 3, tied)
            comm.Free()
        world.Barrier()


@pytest.mark.mpi(min_size=8)
def test_llama_recompute_gives_the_same_gradients(world, shared_tmp):
    data = _data_file(world, shared_tmp)
    comm = sub_world(world, 4)
    if comm is None:
        return
    for schedule in ("1f1b", "zb-h1"):
        _check(comm, data, 2, 2, schedule, 3, True, recompute="stage")
    comm.Free()


def _train_sections(ck_dir: str, dp: int, pp: int, schedule: str = "gpipe", resume: bool = False,
                    tied: bool = False) -> dict:
    virtual = 2 if schedule in ("zb-v", "interleaved-1f1b") else 1
    return {"parallel": {"dp": dp, "pp": pp, "schedule": schedule, "virtual_stages": virtual},
            "model": {**MODEL, "tie_embeddings": tied},
            "data": {"synthetic_samples": 64, "shuffle": True, "seed": 1},
            "train": {"steps": 6, "micro_batches": 2, "micro_batch_size": 4 // dp, "optimizer": "adamw", "lr": 0.01,
                      "weight_decay": 0.1},
            "checkpoint": {"dir": ck_dir, "resume": resume, "keep": 3}, "log": {"progress": False}}


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("dp,pp,schedule,tied", [(2, 2, "1f1b", False), (1, 4, "zb-h1", True), (1, 2, "zb-v", False)])
def test_interrupted_llama_run_resumes_bit_identically(world, shared_tmp, dp, pp, schedule, tied):
    """3 steps, save, close; resume for 3 more: parameters and optimizer state bit-equal to 6 uninterrupted steps."""
    comm = sub_world(world, dp * pp)
    if comm is None:
        return
    tag = f"{dp}x{pp}-{schedule}-{tied}"
    whole = make_trainer(comm, _train_sections(os.path.join(shared_tmp, f"llama-whole-{tag}"), dp, pp, schedule,
                                               tied=tied))
    losses = [whole.train_step(s) for s in range(6)]
    want_params, want_opt = whole.gather("params"), whole.gather("optimizer")
    whole.close()
    ck_dir = os.path.join(shared_tmp, f"llama-ck-{tag}")
    first = make_trainer(comm, _train_sections(ck_dir, dp, pp, schedule, tied=tied))
    for s in range(3):
        first.train_step(s)
    first.save_checkpoint(3)
    first.close()
    second = make_trainer(comm, _train_sections(ck_dir, dp, pp, schedule, resume=True, tied=tied))
    resumed = [second.train_step(s) for s in range(3, 6)]
    got_params, got_opt = second.gather("params"), second.gather("optimizer")
    second.close()
    if comm.Get_rank() == 0:
        assert resumed == losses[3:]
        assert_nested_equal(got_params, want_params)
        assert_nested_equal(got_opt, want_opt)
        assert "attn/q/bias" in got_params[1] and ("head/weight" in got_params[5]) == (not tied)
    comm.Free()


@pytest.mark.mpi(min_size=8)
def test_llama_checkpoint_reshards_to_other_layouts(world, shared_tmp):
    """Saved at (dp=2, pp=4) under 1F1B; loaded at other layouts and schedules: state bit-equal."""
    ck_dir = os.path.join(shared_tmp, "llama-reshard")
    comm = sub_world(world, 8)
    reference = None
    if comm is not None:
        trainer = make_trainer(comm, _train_sections(ck_dir, 2, 4, "1f1b"))
        for s in range(2):
            trainer.train_step(s)
        trainer.save_checkpoint(2)
        reference = (trainer.gather("params"), trainer.gather("optimizer"))
        trainer.close()
        comm.Free()
    params, opt = world.bcast(reference, root=0)
    for dp, pp, schedule in [(1, 1, "gpipe"), (4, 2, "gpipe"), (2, 2, "zb-v"), (1, 4, "zb-h1")]:
        comm = sub_world(world, dp * pp)
        if comm is not None:
            trainer = make_trainer(comm, _train_sections(ck_dir, dp, pp, schedule, resume=True))
            got = (trainer.gather("params"), trainer.gather("optimizer"))
            trainer.close()
            if comm.Get_rank() == 0:
                assert_nested_equal(got[0], params)
                assert_nested_equal(got[1], opt)
            comm.Free()
        world.Barrier()


QWEN3 = {**MODEL, "qkv_bias": False, "qk_norm": True, "head_dim": 4}


@pytest.mark.mpi(min_size=8)
def test_qwen3_q_and_k_norms_match_torch(world, shared_tmp):
    """Qwen3's per-head RMSNorm of q and k before RoPE: loss and every gradient equal PyTorch at dp=2 x pp=2."""
    from support.llama_reference import torch_llama

    from hpcpipe.config import from_dict
    from hpcpipe.nn.llama.model import LlamaModel, llama_shape
    data = _data_file(world, shared_tmp)
    shape = llama_shape(from_dict({"model": {**QWEN3, "tie_embeddings": False}, "parallel": {"pp": 1}}).model)
    model = LlamaModel(shape)
    with h5py.File(data) as f:
        x, y = f["x"][...], f["y"][...]
    groups = [model.init_group(i, QWEN3["seed"], "float64") for i in range(shape.n_groups)]
    ref_loss, ref_grads, _ = torch_llama(shape, groups, x.astype(np.int64), y.astype(np.int64))
    largest = max(float(np.abs(v).max()) for g in ref_grads for v in g.values())
    for schedule in ("1f1b", "zb-h1"):
        comm = sub_world(world, 4)
        if comm is not None:
            sections = _sections(data, 2, 2, schedule, 3, False)
            sections["model"] = {**QWEN3, "tie_embeddings": False, "dtype": "float64"}
            trainer = make_trainer(comm, sections)
            try:
                loss = trainer.compute_gradients(0)
                grads = trainer.gather("grads")
            finally:
                trainer.close()
            if comm.Get_rank() == 0:
                assert "attn/q_norm/weight" in grads[1]
                for i, group in enumerate(ref_grads):
                    for name, ref in group.items():
                        assert float(np.abs(grads[i][name] - ref).max()) / largest <= TOLERANCE, (schedule, i, name)
                assert abs(loss - ref_loss) <= TOLERANCE * abs(ref_loss)
            comm.Free()
        world.Barrier()


WINDOWED = {**MODEL, "sliding_window": 3, "sliding_layers": [1, 3]}      # every query past position 2 loses keys


@pytest.mark.mpi(min_size=8)
def test_sliding_window_blocks_match_torch(world, shared_tmp):
    """Blocks 1 and 3 see only their last 3 positions: loss and every gradient equal PyTorch at dp=2 x pp=2."""
    from support.llama_reference import torch_llama

    from hpcpipe.config import from_dict
    from hpcpipe.nn.llama.model import LlamaModel, llama_shape
    data = _data_file(world, shared_tmp)
    shape = llama_shape(from_dict({"model": {**WINDOWED, "tie_embeddings": True}, "parallel": {"pp": 1}}).model)
    assert [shape.window(i) for i in range(1, 5)] == [0, 3, 0, 3]
    model = LlamaModel(shape)
    with h5py.File(data) as f:
        x, y = f["x"][...], f["y"][...]
    groups = [model.init_group(i, WINDOWED["seed"], "float64") for i in range(shape.n_groups)]
    ref_loss, ref_grads, _ = torch_llama(shape, groups, x.astype(np.int64), y.astype(np.int64))
    largest = max(float(np.abs(v).max()) for g in ref_grads for v in g.values())
    comm = sub_world(world, 4)
    if comm is not None:
        sections = _sections(data, 2, 2, "zb-h1", 3, True)
        sections["model"] = {**WINDOWED, "tie_embeddings": True, "dtype": "float64"}
        trainer = make_trainer(comm, sections)
        try:
            loss = trainer.compute_gradients(0)
            grads = trainer.gather("grads")
        finally:
            trainer.close()
        if comm.Get_rank() == 0:
            for i, group in enumerate(ref_grads):
                for name, ref in group.items():
                    assert float(np.abs(grads[i][name] - ref).max()) / largest <= TOLERANCE, (i, name)
            assert abs(loss - ref_loss) <= TOLERANCE * abs(ref_loss)
        comm.Free()
    world.Barrier()


EXPERTS = {**MODEL, "kind": "moe", "n_experts": 4, "experts_per_token": 2, "moe_d_ff": 10, "moe_layers": [0, 1, 3],
           "norm_topk_prob": False}    # block 2 dense, as Qwen3-MoE's mlp_only_layers


@pytest.mark.mpi(min_size=8)
def test_mixture_of_experts_matches_torch(world, shared_tmp):
    """Routers and experts: loss and every gradient equal PyTorch at dp=2 x pp=2 under 1f1b and zb-h1."""
    from support.llama_reference import torch_llama

    from hpcpipe.config import from_dict
    from hpcpipe.nn.registry import model_def
    data = _data_file(world, shared_tmp)
    model = model_def(from_dict({"model": {**EXPERTS, "tie_embeddings": False}, "parallel": {"pp": 1}}))
    with h5py.File(data) as f:
        x, y = f["x"][...], f["y"][...]
    groups = [model.init_group(i, EXPERTS["seed"], "float64") for i in range(model.n_layers)]
    ref_loss, ref_grads, _ = torch_llama(model.shape, groups, x.astype(np.int64), y.astype(np.int64))
    largest = max(float(np.abs(v).max()) for g in ref_grads for v in g.values())
    for schedule in ("1f1b", "zb-h1"):
        comm = sub_world(world, 4)
        if comm is not None:
            sections = _sections(data, 2, 2, schedule, 3, False)
            sections["model"] = {**EXPERTS, "tie_embeddings": False, "dtype": "float64"}
            trainer = make_trainer(comm, sections)
            try:
                loss = trainer.compute_gradients(0)
                grads = trainer.gather("grads")
            finally:
                trainer.close()
            if comm.Get_rank() == 0:
                assert "mlp/experts/gate" in grads[1] and "mlp/gate/weight" in grads[3]
                for i, group in enumerate(ref_grads):
                    for name, ref in group.items():
                        assert float(np.abs(grads[i][name] - ref).max()) / largest <= TOLERANCE, (schedule, i, name)
                assert abs(loss - ref_loss) <= TOLERANCE * abs(ref_loss)
            comm.Free()
        world.Barrier()
