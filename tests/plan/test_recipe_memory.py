"""Memory of the training recipes (issue #38) as the planner, the start-up check and the trainer count it: ZeRO-1
holds 1/dp of the optimizer state, LoRA only the adapters' gradients and state; the estimate is what a Trainer's
buffers hold; a model that fits only with train.zero = 1 is told so."""

from __future__ import annotations

import pytest
from support.plan import synthetic_profile

from hpcpipe.config import from_dict
from hpcpipe.errors import ConfigError
from hpcpipe.nn.memory import estimate_rank_bytes, trained_params
from hpcpipe.nn.registry import model_specs
from hpcpipe.plan.memory_floor import plan_floor
from hpcpipe.plan.predict import Candidate, Predictor
from hpcpipe.train.preflight import check_memory

LLAMA = {"kind": "llama", "vocab_size": 64, "seq_len": 8, "d_model": 32, "n_heads": 4, "n_kv_heads": 2,
         "n_blocks": 2, "d_ff": 48}


def _config(**train):
    return from_dict({"model": LLAMA, "parallel": {"pp": 1}, "checkpoint": {"dir": ""},
                      "train": {"optimizer": "adamw", "micro_batches": 2, "micro_batch_size": 2, **train}})


def _params(config) -> tuple[int, int]:
    specs = model_specs(config)
    return sum(s.n_params for s in specs), sum(trained_params(s) for s in specs)


def test_zero_divides_the_optimizer_state_by_dp_and_lora_keeps_only_the_adapters():
    whole = estimate_rank_bytes(_config(), [range(4)], 1, "interleaved", dp=4)
    zero = estimate_rank_bytes(_config(zero=1), [range(4)], 1, "interleaved", dp=4)
    n, _ = _params(_config())
    assert whole.optimizer == 2 * n * 4 and whole.parameters == 2 * n * 4
    assert zero.optimizer == 2 * -(-n // 4) * 4                     # Adam's two moments of 1/4 of the parameters
    assert zero.parameters == (2 * n + -(-n // 4)) * 4              # and that block of the averaged gradient
    lora = _config(lora_rank=4, lora_targets=["q_proj", "v_proj"])
    n_all, n_adapters = _params(lora)
    assert n_adapters == 2 * 2 * (32 * 4 + 4 * 32) - 2 * (4 * 32 - 4 * 16)       # q: 32 -> 32, v: 32 -> 16, 2 blocks
    est = estimate_rank_bytes(lora, [range(4)], 1, "interleaved")
    assert est.parameters == (n_all + n_adapters) * 4 and est.optimizer == 2 * n_adapters * 4


def test_the_planner_counts_zero_and_lora_per_candidate():
    for train, dp in (({}, 2), ({"zero": 1}, 2), ({"zero": 1}, 4), ({"lora_rank": 4}, 2)):
        config = _config(**train)
        profile = synthetic_profile(config, dict.fromkeys(range(4), 1e-4))
        profile.layers["optimizer"]["adamw"] = {"seconds_per_param": 0.0, "work_bytes_per_param": 0.0,
                                                "state_buffers": 2}
        memory = Predictor(config, profile).predict(Candidate(dp, 1, "gpipe", 1, 2, 2, (4,))).memory
        n, trained = _params(config)
        share = -(-trained // dp) if train.get("zero") else trained
        assert memory["optimizer"] == 2 * share * 4, train
        assert memory["parameters"] == (n + trained + (share if train.get("zero") else 0)) * 4, train
    floor = plan_floor(_config(zero=1), 4, 16).param_bytes
    assert floor < plan_floor(_config(), 4, 16).param_bytes


def test_a_model_that_fits_only_with_zero_is_told_so():
    config = _config()
    need = estimate_rank_bytes(config, [range(4)], 1, "interleaved", dp=4).total
    sharded = estimate_rank_bytes(_config(zero=1), [range(4)], 1, "interleaved", dp=4).total
    budget = (need + sharded) // 2
    with pytest.raises(ConfigError) as info:
        check_memory(config, [range(4)], 1, "interleaved", 4, available=budget * 4, ranks_here=4, headroom=1 << 60)
    assert "train.zero = 1 (the optimizer state / 4)" in str(info.value)
    check_memory(_config(zero=1), [range(4)], 1, "interleaved", 4, available=budget * 4, ranks_here=4,
                 headroom=1 << 60)


@pytest.mark.parametrize("train", [{}, {"zero": 1}, {"lora_rank": 4}, {"lora_rank": 4, "zero": 1}])
def test_the_estimate_is_what_a_trainers_buffers_hold(train):
    from mpi4py import MPI

    from hpcpipe.train.setup import prepare
    from hpcpipe.train.trainer import Trainer
    config = from_dict({"model": LLAMA, "parallel": {"pp": 1, "dp": 1}, "checkpoint": {"dir": ""},
                        "data": {"synthetic_samples": 8}, "log": {"progress": False},
                        "train": {"optimizer": "adamw", "micro_batches": 1, "micro_batch_size": 2, **train}})
    trainer = Trainer(prepare(config, 1), MPI.COMM_SELF)
    try:
        held = trainer.memory_bytes()
    finally:
        trainer.close()
    est = estimate_rank_bytes(config, [range(4)], 1, "interleaved", dp=1)
    assert held == (est.parameters, est.optimizer)


def test_a_lora_rank_that_does_not_fit_is_named():
    """lora_rank = 1e8 on a d_model = 32 llama: the refusal advised a smaller model, not the rank that filled it."""
    config = _config(lora_rank=100_000_000, lora_targets=["q_proj"])
    with pytest.raises(ConfigError) as info:
        check_memory(config, [range(4)], 1, "interleaved", 1, available=1 << 30, ranks_here=1, headroom=0)
    assert "or a smaller train.lora_rank (now 100000000), model or micro-batch" in str(info.value)
