"""Checkpoints across backends: saved by a run on the device (CuPy), resumed on NumPy, and the other way, at
pp = 2; every parameter and every optimizer state (AdamW) comes back bit for bit, as the files are the same
float32 HDF5 whatever computed them. Without a GPU these skip (HPCPIPE_GPU_REHEARSE=1: rehearsed on NumPy)."""

import pytest
from support.gpu import device_backend, run_worker, token_windows

pytestmark = pytest.mark.gpu

MODEL = {"kind": "gpt", "vocab_size": 11, "seq_len": 6, "d_model": 8, "n_heads": 2, "n_blocks": 4, "d_ff": 12,
         "seed": 7, "tie_embeddings": True}


@pytest.mark.parametrize("kind", ["gpt", "mlp"])
def test_checkpoint_saved_on_one_backend_resumes_bit_identical_on_the_other(tmp_path, kind):
    device = device_backend()
    if kind == "gpt":
        data = token_windows(tmp_path / "tokens.h5", MODEL["vocab_size"], MODEL["seq_len"], 16)
        model, data_section = MODEL, {"path": str(data)}
    else:
        model, data_section = {"dims": [12, 16, 16, 8], "activation": "gelu"}, {"synthetic_samples": 64}
    sections = {"parallel": {"pp": 2, "dp": 1, "schedule": "1f1b"}, "model": model, "data": data_section,
                "train": {"micro_batches": 2, "micro_batch_size": 4, "optimizer": "adamw", "lr": 0.01,
                          "weight_decay": 0.1}}
    result = run_worker(2, "checkpoint", tmp_path, {"sections": sections,
                                                    "pairs": [[device, "numpy"], ["numpy", device]]})
    assert len(result) == 2, result
    for pair, r in result.items():
        assert r["resumed_at"] == 2, (pair, r)
        assert r["params"] > 0
        assert r["params_differ"] == [] and r["optimizer_differ"] == [], (pair, r)
