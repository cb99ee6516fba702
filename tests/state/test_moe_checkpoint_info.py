"""An expert-parallel run's checkpoint says it was saved at ep=2 (``checkpoint info``), and LoRA on the moe kind is
refused for its true reason (not supported yet), not as a kind without attention projections."""

from __future__ import annotations

from support.launch import one_error, run_module, train

MOE = {"kind": "moe", "vocab_size": 13, "seq_len": 6, "d_model": 8, "n_heads": 4, "n_kv_heads": 2, "n_blocks": 2,
       "d_ff": 12, "n_experts": 4, "experts_per_token": 2, "moe_d_ff": 10}


def _sections(ep: int = 2, **train_more) -> dict:
    return {"model": MOE, "parallel": {"dp": 2, "pp": 1, "ep": ep},
            "train": {"steps": 1, "micro_batches": 2, "micro_batch_size": 2, "optimizer": "adam",
                      "loss": "cross_entropy", **train_more},
            "checkpoint": {"dir": "ck"}, "data": {"synthetic_samples": 16}, "log": {"progress": False}}


def test_info_of_an_expert_parallel_checkpoint_names_ep(tmp_path):
    proc = train(2, _sections(), cwd=tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stderr
    info = run_module("hpcpipe.checkpoint", "info", "ck", cwd=tmp_path)
    assert info.returncode == 0, info.stderr
    assert "saved at dp=2 pp=1 ep=2 " in info.stdout, info.stdout
    assert "LoRA" not in info.stdout


def test_lora_on_the_moe_kind_says_it_is_not_supported_yet(tmp_path):
    proc = train(2, _sections(ep=1, lora_rank=4), cwd=tmp_path, timeout=120)
    line = one_error(proc, "LoRA is not supported for model.kind = \"moe\" yet")
    assert "no modules" not in line
