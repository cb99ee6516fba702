"""Bad tensor-parallel input to the real training command: one line naming the values, exit 2, before any collective
(so a job never hangs): dp x pp x tp not the world size, tp not dividing the world, the heads, the MLP width, the
key/value heads, or an MLP's column-parallel widths."""

from __future__ import annotations

import pytest
from support.launch import one_error, train

GPT = {"kind": "gpt", "vocab_size": 13, "seq_len": 6, "d_model": 8, "n_heads": 4, "n_blocks": 2, "d_ff": 12}
LLAMA = {"kind": "llama", "vocab_size": 13, "seq_len": 6, "d_model": 12, "n_heads": 6, "n_kv_heads": 3,
         "n_blocks": 2, "d_ff": 12}


def _sections(model: dict, dp, pp, tp) -> dict:
    return {"parallel": {"dp": dp, "pp": pp, "tp": tp}, "model": model, "data": {"synthetic_samples": 16},
            "train": {"micro_batches": 2, "micro_batch_size": 2, "steps": 1}, "checkpoint": {"dir": ""},
            "log": {"progress": False}}


CASES = [
    # (ranks, model, dp, pp, tp, words in the one line)
    (4, GPT, 1, 1, 2, ["world size 4", "parallel.dp (1)", "parallel.pp (1)", "parallel.tp (2)"]),
    (3, GPT, "auto", 1, 2, ["world size 3 is not divisible by parallel.tp (2)"]),
    (3, GPT, 1, 1, 3, ["parallel.tp = 3", "model.n_heads (4)"]),
    (2, {**GPT, "n_heads": 2, "d_ff": 9}, 1, 1, 2, ["parallel.tp = 2", "MLP width (9"]),
    (4, LLAMA, 1, 1, 4, ["parallel.tp = 4", "model.n_heads (6)"]),
    (2, LLAMA, 1, 1, 2, ["parallel.tp = 2", "model.n_kv_heads (3)"]),
    (2, {"dims": [8, 5, 4], "activation": "relu"}, 1, 1, 2, ["parallel.tp = 2", "column-parallel", "5"]),
]


@pytest.mark.parametrize("n,model,dp,pp,tp,words", CASES)
def test_bad_tensor_parallel_layout_is_one_line_and_exit_2(tmp_path, n, model, dp, pp, tp, words):
    proc = train(n, _sections(model, dp, pp, tp), cwd=tmp_path, timeout=60)
    one_error(proc, *words)
    assert not list(tmp_path.iterdir()), "a refused job must not create anything"
