"""The planner and the memory checks know expert parallelism: a rank holds 1/ep of every block's experts, the
all-to-alls cost their bytes, and the search tries every ep that divides dp and the experts."""

import tomllib

import pytest
from support.plan import synthetic_profile

from hpcpipe.config import from_dict
from hpcpipe.nn.memory import decode_rank_bytes, estimate_rank_bytes, expert_elements
from hpcpipe.nn.registry import model_def
from hpcpipe.plan import report
from hpcpipe.plan.predict import Candidate, Predictor
from hpcpipe.plan.search import search

MODEL = {"kind": "moe", "vocab_size": 64, "seq_len": 8, "d_model": 16, "n_heads": 2, "n_blocks": 2, "d_ff": 32,
         "n_experts": 8, "experts_per_token": 2}


def _config(ep: int = 1, **parallel):
    return from_dict({"model": MODEL, "parallel": {"pp": 1, "ep": ep, **parallel},
                      "train": {"optimizer": "sgd", "micro_batches": 2, "micro_batch_size": 2},
                      "checkpoint": {"dir": ""}})


def test_a_rank_holds_its_share_of_the_experts():
    model = model_def(_config())
    experts = sum(expert_elements(model, i) for i in range(model.n_layers))
    assert experts == 2 * 3 * 8 * 16 * 32          # 2 blocks x (gate, up, down) x 8 experts x d x ff
    ranges = [range(model.n_layers)]
    whole, half = decode_rank_bytes(_config(1), ranges)[0], decode_rank_bytes(_config(2, dp=2), ranges)[0]
    assert whole - half == experts // 2 * 4
    train_whole = estimate_rank_bytes(_config(1), ranges, 1, "interleaved").parameters
    train_half = estimate_rank_bytes(_config(4, dp=4), ranges, 1, "interleaved").parameters
    assert train_whole - train_half == 2 * experts * 3 // 4 * 4    # parameters and gradients, 3/4 of the experts


def test_the_search_tries_ep_and_prices_its_all_to_alls():
    config = _config()
    profile = synthetic_profile(config, {i: 0.001 for i in range(4)}, per_byte=1e-6)
    result = search(config, profile, ranks=4, global_batch=8, budget=None, max_micro=2)
    eps = {(p.candidate.dp, p.candidate.ep) for p in result.predictions}
    assert {(4, 1), (4, 2), (4, 4), (2, 2), (1, 1)} <= eps and all(dp % ep == 0 for dp, ep in eps)
    predictor = Predictor(config, profile)
    one = predictor.predict(Candidate(2, 2, "1f1b", 1, 2, 2, (2, 2)))
    two = predictor.predict(Candidate(2, 2, "1f1b", 1, 2, 2, (2, 2), ep=2))
    assert two.memory["parameters"] < one.memory["parameters"]
    assert two.busy_max_s > one.busy_max_s        # the same compute plus the exchanges' bytes
    assert two.step_end_s < one.step_end_s        # the experts' gradients no longer cross the replicas
    text = report.to_toml(report.planned_config(config, two), "header")
    assert from_dict(tomllib.loads(text)).parallel.ep == 2
    assert "(ep=2)" in report.layout(two.candidate)


@pytest.mark.parametrize("ep", [3, 16])
def test_the_search_skips_an_ep_that_does_not_split_the_experts(ep):
    config = _config()
    profile = synthetic_profile(config, {i: 0.001 for i in range(4)})
    result = search(config, profile, ranks=ep, global_batch=ep * 2, budget=None, max_micro=2)
    assert all(p.candidate.ep in (1, 2, 4, 8) for p in result.predictions)
