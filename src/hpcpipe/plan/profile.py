"""The measured profile the planner predicts from: per layer group and micro-batch size, plus comm and memory.

:class:`Profile` answers "how long does op F/I/W/B of layer group i take on
``rows`` samples, and how many bytes does it keep or need", interpolating
linearly between the measured sizes (and scaling in proportion to the rows
beyond them). :func:`load_profile` returns the cached profile for the
configured model on this host, measuring what is missing first.
"""

from __future__ import annotations

import bisect
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from hpcpipe.config import Config
from hpcpipe.plan import profile_cache
from hpcpipe.plan.comm_model import CommModel, measure_comm, measure_rank_baseline


def _interpolate(points: dict[str, float], rows: int) -> float:
    """Value at ``rows`` from {rows: value} measurements: piecewise linear, proportional outside the range."""
    xs = sorted(int(k) for k in points)
    ys = [points[str(x)] for x in xs]
    if rows <= xs[0]:
        return ys[0] * rows / xs[0]
    if rows >= xs[-1]:
        return ys[-1] * rows / xs[-1]
    i = bisect.bisect_left(xs, rows)
    if xs[i] == rows:
        return ys[i]
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (rows - x0) / (x1 - x0)


@dataclass
class Profile:
    """Measured costs of one model on one host, backend and BLAS thread count."""

    data: dict[str, Any]        # the cached JSON: key, layers (groups, signatures, optimizer), comm
    comm: CommModel
    from_cache: bool = False

    @property
    def layers(self) -> dict[str, Any]:
        """The layer part of the profile (what :func:`hpcpipe.plan.layer_profile.profile_layers` measured)."""
        return self.data["layers"]

    def _group(self, index: int) -> dict[str, Any]:
        return self.layers["groups"][self.layers["signatures"][index]]

    @property
    def n_layers(self) -> int:
        """Number of layer groups of the profiled model."""
        return len(self.layers["signatures"])

    def seconds(self, op: str, index: int, rows: int) -> float:
        """Seconds of action op (F, I, W or B) of layer group ``index`` on a micro-batch of ``rows`` samples."""
        return _interpolate(self._group(index)[op], rows)

    def stash_bytes(self, index: int, rows: int) -> float:
        """Bytes the group's forward keeps for its backward, per micro-batch."""
        return _interpolate(self._group(index)["stash_bytes"], rows)

    def work_bytes(self, index: int, rows: int) -> float:
        """Peak bytes one of the group's actions allocates while it runs."""
        return _interpolate(self._group(index)["work_bytes"], rows)

    def params(self, index: int) -> int:
        """Parameters of the group (a tied head's table is the embedding's: counted there)."""
        return int(self._group(index)["params"])

    def optimizer(self, train: Any) -> dict[str, float]:
        """Seconds and temporary bytes per parameter of one update, and the state buffers, of train's optimizer."""
        from hpcpipe.plan.layer_profile import optimizer_name

        return self.layers["optimizer"][optimizer_name(train)]

    @property
    def baseline_bytes(self) -> int:
        """Resident memory of a rank before any array: interpreter, libraries, MPI, BLAS buffers."""
        return int(self.comm.baseline_rss_bytes) + int(self.layers.get("blas_rss_bytes", 0))

    @property
    def sizes(self) -> list[int]:
        """Micro-batch sizes measured."""
        first = next(iter(self.layers["groups"].values()))
        return sorted(int(k) for k in first["F"])


def profile_sizes(wanted: list[int], limit: int = 10) -> list[int]:
    """The micro-batch sizes to measure: all wanted ones, or ``limit`` of them spread geometrically."""
    sizes = sorted(set(wanted))
    if len(sizes) <= limit:
        return sizes
    picked = {sizes[0], sizes[-1]}
    for k in range(1, limit - 1):
        target = sizes[0] * (sizes[-1] / sizes[0]) ** (k / (limit - 1))
        picked.add(min(sizes, key=lambda s: abs(s - target)))
    return sorted(picked)


def load_profile(config: Config, sizes: list[int], threads: int, cache_dir: str, refresh: bool = False,
                 concurrent: int = 1, log: Any = None) -> Profile:
    """Return the profile of the configured model on this host: from the cache, measuring what it lacks.

    ``concurrent`` ranks of the planned job compute at once on a node: the layers are
    measured with as many copies side by side (a cached profile taken with another
    count is measured again).
    """
    log = log or (lambda text: print(text, file=sys.stderr, flush=True))
    key = profile_cache.layer_key(config, threads)
    cached = None if refresh else profile_cache.read(cache_dir, key)
    if cached and cached["layers"].get("concurrent", 1) != concurrent:
        cached = None
    have = set(Profile(cached, CommModel.from_dict(cached["comm"])).sizes) if cached and "comm" in cached else set()
    missing = [s for s in sizes if s not in have]
    comm_dict = cached.get("comm") if cached else None
    if cached and not missing:
        return Profile(cached, CommModel.from_dict(comm_dict), from_cache=True)
    start = time.perf_counter()
    if comm_dict is None:
        comm_dict = profile_cache.read_comm(cache_dir) if not refresh else None
        if comm_dict is None:
            log("hpcpipe.plan: measuring point-to-point and allreduce costs and a bare rank's memory (2 ranks) ...")
            probe = measure_comm()
            # a training rank holds more than the probe's imports: the engine, its communicators, MPI's buffers
            probe["baseline_rss_bytes"] = max(probe["baseline_rss_bytes"], measure_rank_baseline())
            comm_dict = CommModel.from_probe(probe).to_dict()
            profile_cache.write_comm(cache_dir, comm_dict)
    log(f"hpcpipe.plan: profiling {config.n_layers} layer groups at micro-batch sizes {missing} "
        f"({threads} BLAS thread{'s' if threads > 1 else ''}, {concurrent} process{'es' if concurrent > 1 else ''} "
        f"side by side) ...")
    measured = profile_cache.run_layer_profile(config, missing, threads, concurrent)
    layers = measured if not cached else profile_cache.merge_layers(cached["layers"], measured)
    data = {"key": key, "layers": layers, "comm": comm_dict,
            "seconds": round(time.perf_counter() - start, 2) + (cached or {}).get("seconds", 0.0)}
    path = profile_cache.write(cache_dir, key, data)
    log(f"hpcpipe.plan: profile saved to {path} ({time.perf_counter() - start:.1f} s)")
    return Profile(data, CommModel.from_dict(comm_dict))


def default_cache_dir() -> str:
    """Where profiles are kept: $HPCPIPE_PROFILE_DIR, else $XDG_CACHE_HOME/hpcpipe/profiles (~/.cache/...)."""
    explicit = os.environ.get("HPCPIPE_PROFILE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "hpcpipe", "profiles")
