"""bench_cluster's rows (bench/cluster_rows.py): the same plan in each round's plans, a row's errors over its rounds."""

import sys

import pytest
from support import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import cluster_rows  # noqa: E402  (bench/ is not a package)


def plan(dp=1, pp=2, tp=1, schedule="1f1b", mb=8, size=4, cut=(5, 1), step=0.25):
    return {"dp": dp, "pp": pp, "tp": tp, "schedule": schedule, "virtual_stages": 1, "micro_batches": mb,
            "micro_batch_size": size, "stage_layers": list(cut), "step_time_s": step}


def test_a_round_runs_the_same_configuration_as_its_own_plan_predicts_it():
    first = plan(cut=(5, 1), step=0.25)
    # a later round's profile: another cut for the same configuration, and another plan of the layout faster
    later = [plan(mb=4, size=8, step=0.20), plan(cut=(4, 2), step=0.31), plan(dp=2, pp=1, cut=(), step=0.19)]
    found = cluster_rows.same_plan(later, first)
    assert (found["micro_batches"], found["stage_layers"], found["step_time_s"]) == (8, [4, 2], 0.31)


def test_a_configuration_the_round_lacks_falls_back_to_the_layouts_fastest_plan():
    later = [plan(dp=2, pp=1, cut=(), step=0.19), plan(mb=4, size=8, step=0.2), plan(mb=2, size=16, step=0.3)]
    assert cluster_rows.same_plan(later, plan(mb=16, size=2))["micro_batches"] == 4


def runs(pairs):
    return [{"predicted_s": p, "step_s": m, "step_min_s": m * 0.9} for p, m in pairs]


def test_each_round_is_compared_with_its_own_prediction():
    # the machine drifts: each round's profile saw the speed its runs then had
    row = cluster_rows.summarise(runs([(0.20, 0.20), (0.26, 0.26), (0.24, 0.24)]), "rounds")
    assert row["errors"] == pytest.approx([0, 0, 0]) and row["error"] == pytest.approx(0)
    assert row["predicted_s"] == pytest.approx(0.24) and row["measured_s"] == pytest.approx(0.24)
    # the profile measured once at the start compares the later rounds with a faster spell
    assert row["error_first_median"] == pytest.approx(0.20 / 0.24 - 1)
    assert row["error_first_min"] == pytest.approx(0)
    assert row["error_fastest"] == pytest.approx(1 / 0.9 - 1)


def test_the_error_is_the_median_of_the_rounds_errors():
    row = cluster_rows.summarise(runs([(0.2, 0.25), (0.2, 0.2), (0.3, 0.2)]), "rounds")
    assert row["errors"] == pytest.approx([-0.2, 0, 0.5])
    assert row["error"] == pytest.approx(0)


@pytest.mark.parametrize("statistic,measured", [("min", 0.2), ("median", 0.25)])
def test_the_earlier_statistics_take_the_first_rounds_prediction(statistic, measured):
    row = cluster_rows.summarise(runs([(0.2, 0.25), (0.3, 0.2), (0.4, 0.3)]), statistic)
    assert row["predicted_s"] == 0.2 and row["measured_s"] == measured
    assert row["error"] == pytest.approx(0.2 / measured - 1)


def test_an_unknown_statistic_is_refused():
    with pytest.raises(ValueError, match="unknown statistic 'mean'"):
        cluster_rows.summarise(runs([(0.2, 0.2)]), "mean")
