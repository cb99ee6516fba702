"""Search the plans for a global batch on N ranks: layouts, schedules, micro-batching and stage cuts.

Every (dp, pp, tp) with dp x pp x tp = N, pp no more than the layer groups and a tp the model splits
over (parallel.tp's checks: heads, key/value heads, MLP widths); for a mixture of experts every ep dividing
dp and the experts (parallel.ep's checks); every
schedule with the virtual stages it can take (interleaved 1F1B: 2 to 4 layer
groups' worth, ZB-V: 2); every micro-batch count that divides the replica's
batch (up to ``max_micro``); and two stage cuts: balanced on the measured F + B
of each layer group ("profile") and balanced on counted FLOPs ("flops"), when
they differ. Each is predicted with :class:`hpcpipe.plan.predict.Predictor`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hpcpipe.config import Config
from hpcpipe.config_checks import ep_splits, tp_splits
from hpcpipe.errors import ConfigError, ScheduleError
from hpcpipe.nn.partition import partition
from hpcpipe.nn.registry import model_specs
from hpcpipe.plan.predict import Candidate, Prediction, Predictor
from hpcpipe.profiles.comm_model import Placement
from hpcpipe.profiles.profile import Profile
from hpcpipe.profiles.stage_cut import measured_cut

MAX_VIRTUAL = 4


def divisors(n: int) -> list[int]:
    """Positive divisors of n, ascending."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]    # O(sqrt n): --global-batch may be huge
    return sorted(set(small + [n // d for d in small]))


def schedule_variants(pp: int, n_layers: int) -> list[tuple[str, int]]:
    """(schedule, virtual stages) pairs worth trying on pp ranks for a model of n_layers groups."""
    if pp == 1:
        return [("gpipe", 1)]
    variants = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1)]
    variants += [("interleaved-1f1b", v) for v in range(2, MAX_VIRTUAL + 1) if pp * v <= n_layers]
    if 2 * pp <= n_layers:
        variants.append(("zb-v", 2))
    return variants


def layouts(config: Config, ranks: int, global_batch: int) -> list[tuple[int, int, int]]:
    """Every (dp, pp, tp) on ``ranks`` ranks: dp divides the batch, pp <= the layer groups, the model splits over tp."""
    out = []
    for tp in divisors(ranks):
        if not tp_splits(config.model, tp):
            continue
        for dp in divisors(ranks // tp):
            pp = ranks // (tp * dp)
            if pp <= config.n_layers and global_batch % dp == 0:
                out.append((dp, pp, tp))
    return out


def expert_layouts(config: Config, grid: list[tuple[int, int, int]]) -> list[tuple[int, int, int, int]]:
    """Every (dp, pp, tp, ep) of the layouts: ep over divisors of dp that split the experts (1 for a model without)."""
    return [(dp, pp, tp, ep) for dp, pp, tp in grid for ep in divisors(dp) if ep == 1 or ep_splits(config.model, ep)]


def micro_batch_rows(config: Config, global_batch: int, ranks: int, max_micro: int) -> list[int]:
    """Every micro-batch size some candidate uses (what the profile must measure)."""
    rows = set()
    for dp, _, _ in layouts(config, ranks, global_batch):
        replica = global_batch // dp
        rows.update(replica // m for m in divisors(replica) if m <= max_micro)
    return sorted(rows)


@dataclass
class SearchResult:
    """Every prediction made, the ones within the budget (fastest first), and how many were tried."""

    predictions: list[Prediction]
    feasible: list[Prediction]
    tried: int
    skipped: int            # (schedule, micro-batches) pairs a schedule does not support


def search(config: Config, profile: Profile, ranks: int, global_batch: int, budget: int | None,
           cores: int | None = None, max_micro: int = 64, placement: Placement | None = None) -> SearchResult:
    """Predict every candidate plan; return them with those that fit the budget, fastest first.

    ``placement``: nodes and the link between them (default: every rank on one node).
    """
    n_layers = config.n_layers
    predictor = Predictor(config, profile, cores, placement)
    flops_cache: dict[int, tuple[int, ...]] = {}
    specs = model_specs(config)
    predictions: list[Prediction] = []
    skipped = 0
    for dp, pp, tp, ep in expert_layouts(config, layouts(config, ranks, global_batch)):
        replica = global_batch // dp
        for schedule, virtual in schedule_variants(pp, n_layers):
            n_stages = pp * virtual
            if n_stages not in flops_cache:
                flops_cache[n_stages] = tuple(len(r) for r in partition(specs, n_stages))
            for m in divisors(replica):
                if m > max_micro:
                    break
                rows = replica // m
                cuts = {measured_cut(profile, n_stages, rows): "profile"}
                cuts.setdefault(flops_cache[n_stages], "flops")
                for counts, how in cuts.items():
                    candidate = Candidate(dp, pp, schedule, virtual, m, rows, counts, how, tp, ep)
                    try:
                        predictions.append(predictor.predict(candidate))
                    except ScheduleError:
                        skipped += 1
                        break
    if not predictions:
        raise ConfigError(f"no plan exists for {ranks} ranks and a global batch of {global_batch} with "
                          f"{config.layers_text()}: no dp divides the batch with pp <= {n_layers} layer groups")
    predictions.sort(key=lambda p: (p.step_time_s, p.peak_bytes))
    feasible = [p for p in predictions if budget is None or p.peak_bytes <= budget]
    return SearchResult(predictions, feasible, len(predictions), skipped)
