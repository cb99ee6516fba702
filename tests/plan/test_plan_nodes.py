"""The planner on several nodes: which axes leave a node (Placement), and plans costed with the link between nodes."""

from __future__ import annotations

import pytest
from support.plan import mlp_config, synthetic_profile

from hpcpipe.plan.predict import Candidate, Predictor
from hpcpipe.plan.search import search
from hpcpipe.profiles.comm_model import CommModel, Placement

FAST = CommModel(1e-6, 1e-10, 1e-6, 1e-10, 50 << 20, "within")
SLOW = CommModel(50e-6, 8e-9, 100e-6, 8e-9, 50 << 20, "between")     # 1 Gbit/s


@pytest.mark.parametrize("per_node,dp,pp,tp,crossing", [
    (None, 2, 2, 2, set()),                                  # one node
    (8, 2, 2, 2, set()),                                     # the job fits one node
    (1, 2, 1, 1, {"dp", "world"}),                           # 2 nodes x 1 rank: the one axis crosses
    (1, 1, 2, 1, {"pp", "world"}),
    (1, 1, 1, 2, {"tp", "world"}),
    (4, 2, 2, 2, {"dp", "world"}),                           # a pipeline a node: only the replicas talk across
    (4, 1, 4, 2, {"pp", "world"}),                           # tp pairs stay, the pipeline leaves the node
    (3, 1, 3, 2, {"tp", "pp", "world"}),                     # 3 ranks a node: some tp pair straddles two
    (2, 2, 2, 1, {"dp", "world"}),                           # a 2-stage pipeline a node
    (2, 1, 4, 1, {"pp", "world"}),
])
def test_which_axes_leave_a_node(per_node, dp, pp, tp, crossing):
    placement = Placement(FAST, SLOW, per_node)
    assert {axis for axis in ("dp", "pp", "tp", "world") if placement.crosses(axis, dp, pp, tp)} == crossing
    for axis in ("dp", "pp", "tp", "world"):
        assert placement.link(axis, dp, pp, tp) is (SLOW if axis in crossing else FAST)
    with pytest.raises(ValueError, match="axis 'ep'"):
        placement.crosses("ep", dp, pp, tp)


def test_a_plan_across_nodes_pays_the_slower_link_on_the_axis_that_crosses():
    config = mlp_config([256] * 5, micro_batches=4, micro_batch_size=64)
    profile = synthetic_profile(config, {i: 1e-5 for i in range(4)}, latency=1e-6, per_byte=1e-10)
    one_node = Predictor(config, profile)
    two_nodes = Predictor(config, profile, placement=Placement(profile.comm, SLOW, 1))
    for dp, pp, tp in ((2, 1, 1), (1, 2, 1), (1, 1, 2)):
        c = Candidate(dp, pp, "1f1b", 1, 4, 64, (4,) if pp == 1 else (2, 2), tp=tp)
        here, apart = one_node.predict(c), two_nodes.predict(c)
        assert apart.step_time_s > here.step_time_s, (dp, pp, tp)
    # on 2 nodes x 1 rank at 1 Gbit/s: the replicas' allreduce (1 MiB of gradients) and tp's sums (one per layer
    # and micro-batch) cost more than the pipeline's 2 activations a micro-batch: the pipeline wins there
    def best_by_layout(placement):
        best = {}
        for p in search(config, profile, 2, 4 * 64, None, placement=placement).predictions:
            key = (p.candidate.dp, p.candidate.pp, p.candidate.tp)
            best[key] = min(best.get(key, float("inf")), p.step_time_s)
        return best
    here, apart = best_by_layout(None), best_by_layout(Placement(profile.comm, SLOW, 1))
    assert set(here) == set(apart) == {(2, 1, 1), (1, 2, 1), (1, 1, 2)}
    assert all(apart[k] > here[k] for k in here), (here, apart)
    assert min(apart, key=apart.get) == (1, 2, 1), apart
