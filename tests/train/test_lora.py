"""LoRA (issue #38) through the pipeline engine on real MPI ranks: a tiny llama from a Hugging Face directory with a
PEFT adapter on all seven of its maps (random A and B), in float64 at dp=2 x pp=2 and dp=2 x pp=2 x tp=2 (A and B
split with their maps), with ZeRO-1, and under ZB-H1 with recomputation (the backward's two halves): the loss and
every adapter gradient equal PEFT + PyTorch autograd on transformers' model to 1e-7 of the largest; after an update
the base is bit for bit what was loaded and only the adapters moved; adapters start as PEFT starts them (B zero)
without model.adapter; a GPT's c_attn/c_proj/c_fc adapters too."""

import os
from pathlib import Path

import h5py
import numpy as np
import pytest
from support.training import make_trainer, sub_world

TOLERANCE = 1e-7
WINDOWS, SEQ = 8, 8


def _files(world, tmp: str):
    """Rank 0 builds the model, the adapter and the tokens once; every rank gets the paths."""
    paths = None
    if world.Get_rank() == 0:
        from support.lora import make_model_and_adapter
        root = Path(tmp) / "lora"
        if not (root / "tokens.h5").exists():
            root.mkdir(exist_ok=True)
            make_model_and_adapter(root)
            rng = np.random.default_rng(3)
            with h5py.File(root / "tokens.h5", "w") as f:
                f["x"] = rng.integers(0, 250, (WINDOWS, SEQ)).astype(np.int32)
                f["y"] = rng.integers(0, 250, (WINDOWS, SEQ)).astype(np.int32)
        paths = (str(root / "base"), str(root / "adapter"), str(root / "tokens.h5"))
    return world.bcast(paths, root=0)


def _keys(hf_dir: str) -> dict:
    from hpcpipe.state.hf_source import hf_source
    return {**hf_source(hf_dir).model, "seq_len": SEQ}


def _sections(hf_dir, adapter, data, dp, pp, tp=1, zero=0, schedule="gpipe", recompute="none"):
    targets = sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    return {"parallel": {"dp": dp, "pp": pp, "tp": tp, "schedule": schedule},
            "model": {**_keys(hf_dir), "init": hf_dir, "dtype": "float64", **({"adapter": adapter} if adapter else {})},
            "data": {"path": data},
            "train": {"micro_batches": 2, "micro_batch_size": WINDOWS // (2 * dp), "lora_rank": 4, "lora_alpha": 8.0,
                      "lora_targets": targets, "optimizer": "adamw", "lr": 0.01, "weight_decay": 0.1, "zero": zero,
                      "recompute": recompute},
            "checkpoint": {"dir": ""}, "log": {"progress": False}}


_REF: dict = {}


def _reference(hf_dir, adapter, data):
    if not _REF:
        from support.lora import peft_loss_and_grads

        from hpcpipe.config import from_dict
        with h5py.File(data) as f:
            x, y = f["x"][...], f["y"][...]
        keys = from_dict({"model": _keys(hf_dir), "parallel": {"pp": 1}}).to_dict()["model"]
        _REF["value"] = peft_loss_and_grads(Path(hf_dir), Path(adapter), x, y, keys)
    return _REF["value"]


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("dp,pp,tp,zero,schedule,recompute", [
    (2, 2, 1, 0, "gpipe", "none"), (2, 2, 2, 0, "gpipe", "none"), (2, 2, 2, 1, "gpipe", "none"),
    (1, 1, 1, 0, "gpipe", "none"), (2, 2, 1, 0, "zb-h1", "stage")])
def test_adapter_gradients_equal_peft_and_the_base_stays_bit_for_bit(world, shared_tmp, dp, pp, tp, zero, schedule,
                                                                      recompute):
    hf_dir, adapter, data = _files(world, shared_tmp)
    comm = sub_world(world, dp * pp * tp)
    if comm is None:
        return
    trainer = make_trainer(comm, _sections(hf_dir, adapter, data, dp, pp, tp, zero, schedule, recompute))
    try:
        loss = trainer.compute_gradients(0)
        grads = trainer.gather("grads")
        before = trainer.gather("params")
        trainer.train_step(0)
        after = trainer.gather("params")
        optimizer = trainer.gather("optimizer")
    finally:
        trainer.close()
    if comm.Get_rank() == 0:
        ref_loss, ref_grads = _reference(hf_dir, adapter, data)
        assert abs(loss - ref_loss) <= TOLERANCE * abs(ref_loss), (loss, ref_loss)
        largest = max(float(np.abs(g).max()) for group in ref_grads.values() for g in group.values())
        assert sorted(grads) == [0, 1, 2, 3] and grads[0] == {} and grads[3] == {}    # no gradient but adapters'
        for i, group in ref_grads.items():
            assert sorted(grads[i]) == sorted(group)
            for name, ref in group.items():
                err = float(np.abs(grads[i][name] - ref).max()) / largest
                assert err <= TOLERANCE, (i, name, err)
        for i, group in before.items():
            for name, value in group.items():
                moved = not np.array_equal(after[i][name], value)
                assert moved == name.endswith(("lora_a", "lora_b")), (i, name, moved)
        assert all(set(optimizer[i]["exp_avg"]) == set(ref_grads.get(i, {})) for i in optimizer)
    comm.Free()


@pytest.mark.mpi(min_size=8)
def test_without_model_adapter_the_adapters_start_as_peft_starts_them(world, shared_tmp):
    hf_dir, _, data = _files(world, shared_tmp)
    comm = sub_world(world, 4)
    if comm is None:
        return
    trainer = make_trainer(comm, _sections(hf_dir, "", data, 2, 2))
    try:
        trainer.compute_gradients(0)
        params, grads = trainer.gather("params"), trainer.gather("grads")
    finally:
        trainer.close()
    if comm.Get_rank() == 0:
        a, b = params[1]["attn/q/lora_a"], params[1]["attn/q/lora_b"]
        assert not b.any() and 0 < np.abs(a).max() <= 1 / np.sqrt(a.shape[0])       # kaiming_uniform(a=sqrt(5))
        assert not grads[1]["attn/q/lora_a"].any() and grads[1]["attn/q/lora_b"].any()   # B = 0: only B learns
    comm.Free()


@pytest.mark.mpi(min_size=8)
def test_gpt_adapters_on_every_module_at_tp_2_equal_tp_1(world, shared_tmp):
    """A GPT with c_attn (fused q|k|v, split by heads), c_proj (attention and MLP) and c_fc adapters: gradients at
    dp=1 x pp=2 x tp=2 equal dp=1 x pp=1 (float64, 1e-12 of the largest)."""
    model = {"kind": "gpt", "vocab_size": 11, "seq_len": 6, "d_model": 8, "n_heads": 2, "n_blocks": 2, "d_ff": 12,
             "seed": 3, "dtype": "float64"}
    path = os.path.join(shared_tmp, "gpt-lora-tokens.h5")
    if world.Get_rank() == 0:
        rng = np.random.default_rng(4)
        with h5py.File(path, "w") as f:
            f["x"], f["y"] = rng.integers(0, 11, (8, 6)), rng.integers(0, 11, (8, 6))
    world.Barrier()
    results = []
    for pp, tp in ((1, 1), (2, 2)):
        comm = sub_world(world, pp * tp)
        if comm is not None:
            sections = {"parallel": {"dp": 1, "pp": pp, "tp": tp}, "model": model, "data": {"path": path},
                        "train": {"micro_batches": 2, "micro_batch_size": 4, "lora_rank": 3, "lora_alpha": 6.0,
                                  "lora_targets": ["c_attn", "c_proj", "c_fc"], "optimizer": "adam"},
                        "checkpoint": {"dir": ""}, "log": {"progress": False}}
            trainer = make_trainer(comm, sections)
            trainer.train_step(0)                                     # B moves off zero: A's gradient counts
            trainer.compute_gradients(1)
            results.append(trainer.gather("grads"))
            trainer.close()
            comm.Free()
        world.Barrier()
    if world.Get_rank() == 0:
        one, split = results
        largest = max(float(np.abs(g).max()) for group in one.values() for g in group.values())
        assert sorted(one[1]) == sorted(f"{p}/lora_{x}" for p in ("attn/qkv", "attn/proj", "mlp/fc", "mlp/proj")
                                        for x in "ab")
        for i, group in one.items():
            for name, value in group.items():
                assert float(np.abs(split[i][name] - value).max()) <= 1e-12 * largest, (i, name)
