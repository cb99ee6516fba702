"""``parallel.stage_layers = "profile"``: cut stages by this host's measured layer costs instead of counted FLOPs."""

from __future__ import annotations

import os
from types import SimpleNamespace

from hpcpipe.config import Config
from hpcpipe.errors import ConfigError
from hpcpipe.nn.partition import partition
from hpcpipe.profiles import cache as profile_cache
from hpcpipe.profiles.comm_model import CommModel
from hpcpipe.profiles.profile import Profile, default_cache_dir


def measured_cut(profile: Profile, n_stages: int, rows: int, ops: tuple[str, ...] = ("F", "B"),
                 raw: bool = False) -> tuple[int, ...]:
    """Layer groups per stage minimising the largest stage's measured seconds of ``ops`` at ``rows`` per micro-batch.

    The seconds are a pipeline's (the engine calibration's), or the layer bench's alone with ``raw``.
    """
    def seconds(op: str, i: int) -> float:
        return profile.raw_seconds(op, i, rows) if raw else profile.seconds(op, i, rows, pipelined=n_stages > 1)

    costs = [SimpleNamespace(cost=sum(seconds(op, i) for op in ops)) for i in range(profile.n_layers)]
    return tuple(len(r) for r in partition(costs, n_stages))


def rank_threads() -> int:
    """BLAS threads this rank computes with (hpcpipe sets OMP_NUM_THREADS on import unless the user did)."""
    value = os.environ.get("OMP_NUM_THREADS", "1")
    return int(value) if value.isdigit() and int(value) > 0 else 1


def stage_counts(config: Config, n_stages: int, rows: int, ops: tuple[str, ...] = ("F", "B")) -> list[int]:
    """Layer groups per stage that parallel.stage_layers asks for ([] = FLOP-balanced, as partition does).

    For "profile" the cached profile of this model on this host (the one
    ``python -m hpcpipe.plan`` measured) gives each group's seconds; every rank
    reads the same file, so every rank cuts the same way. Without one the run
    is refused before any collective, with the command that makes it.
    """
    chosen = config.parallel.stage_layers
    if chosen != "profile":
        return list(chosen)
    threads = rank_threads()
    directory = default_cache_dir()
    cached, problem = profile_cache.inspect(directory, profile_cache.layer_key(config, threads))
    for other in range(1, (os.cpu_count() or 1) + 1):
        # a profile taken with another BLAS thread count cuts (nearly) alike; the lowest count first, so
        # that every rank of the job picks the same file
        if cached is None and other != threads:
            cached, other_problem = profile_cache.inspect(directory, profile_cache.layer_key(config, other))
            problem = problem or other_problem
    if cached is None and problem:
        raise ConfigError(f"parallel.stage_layers = \"profile\": the profile {problem}; measure it again with "
                          f"`python -m hpcpipe.plan --config <this config> --ranks <ranks> --refresh-profile`, or "
                          f"give parallel.stage_layers as layer counts")
    if cached is None:
        raise ConfigError(f"parallel.stage_layers = \"profile\" needs a profile of this model measured on this host "
                          f"with {threads} BLAS thread(s) per rank, and {directory!r} has none: make one with "
                          f"`python -m hpcpipe.plan --config <this config> --ranks <ranks>` on this host (or set "
                          f"HPCPIPE_PROFILE_DIR), or give parallel.stage_layers as layer counts")
    profile = Profile(cached, CommModel.from_dict(cached["comm"]), from_cache=True)
    return list(measured_cut(profile, n_stages, rows, ops))
