"""The measured profile the planner predicts from: per layer group and micro-batch size, plus comm and memory.

:class:`Profile` answers "how long does op F/I/W/B of layer group i take on
``rows`` samples" from a line fitted through the measured sizes, and "how many
bytes does it keep or need" by interpolating linearly between them (and scaling
in proportion to the rows beyond them). :func:`load_profile` returns the cached
profile for the configured model on this host, measuring what is missing first.
"""

from __future__ import annotations

import bisect
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from hpcpipe.config import Config
from hpcpipe.errors import ConfigError
from hpcpipe.plan import profile_cache
from hpcpipe.plan.comm_model import CommModel, measure_comm, measure_rank_baseline

# the pipeline schedules that take the ZB-H1 calibration run's factors (the rest take the 1F1B run's)
ZB_CALIBRATED = ("gpipe", "zb-h1")


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


def affine_fit(points: dict[str, float]) -> tuple[float, float]:
    """(a, b) of seconds = a + b x rows fitted to {rows: seconds}, least squares in relative error, a, b >= 0.

    One action costs a fixed part (launching it, streaming the weights once)
    plus a part per row. Fitting that line through every measured size, rather
    than joining the points, keeps one noisy size (another process's burst, a
    cache that held one small case) from making that size look cheap or dear:
    the noise of each point is 5-40 % on a shared machine, the line's is less.
    """
    xs = [float(k) for k in points]
    ys = [max(float(points[k]), 1e-12) for k in points]
    if len(xs) == 1:
        return 0.0, ys[0] / xs[0]
    # weights 1/y^2: minimise sum(((a + b x) / y - 1)^2)
    s00 = sum(1 / y ** 2 for y in ys)
    s01 = sum(x / y ** 2 for x, y in zip(xs, ys, strict=True))
    s11 = sum(x * x / y ** 2 for x, y in zip(xs, ys, strict=True))
    r0 = sum(1 / y for y in ys)
    r1 = sum(x / y for x, y in zip(xs, ys, strict=True))
    det = s00 * s11 - s01 * s01
    a, b = ((s11 * r0 - s01 * r1) / det, (s00 * r1 - s01 * r0) / det) if det > 0 else (-1.0, -1.0)
    if a < 0 or b < 0:         # no fixed part (or no per-row part): the best line through one of the axes
        through_origin = (0.0, r1 / s11)
        constant = (r0 / s00, 0.0)

        def error(fit: tuple[float, float]) -> float:
            return sum(((fit[0] + fit[1] * x) / y - 1) ** 2 for x, y in zip(xs, ys, strict=True))

        a, b = min(through_origin, constant, key=error)
    return a, b


@dataclass
class Profile:
    """Measured costs of one model on one host, backend and BLAS thread count."""

    data: dict[str, Any]        # the cached JSON: key, layers (groups, signatures, optimizer), comm
    comm: CommModel
    from_cache: bool = False
    _fits: dict = field(default_factory=dict, repr=False)     # (op, signature) -> affine_fit

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

    def seconds(self, op: str, index: int, rows: int, pipelined: bool = False, schedule: str = "1f1b") -> float:
        """Seconds of action op (F, I, W or B) of layer group ``index`` on a micro-batch of ``rows`` samples.

        The bench's time scaled by the engine's factor for the group (:mod:`engine_calibration`): when
        ``pipelined`` (pp > 1), the pipeline run's of ``schedule``'s family (GPipe and ZB-H1: the
        ZB-H1 run, else the 1F1B run) if there was one, else the replicas run's.
        """
        engine = self.data.get("engine") or {}
        run = None
        if pipelined:
            run = (engine.get("pipeline_zb") if schedule in ZB_CALIBRATED else None) or engine.get("pipeline")
        run = run or engine.get("replicas") or {}
        factors = run.get("forward" if op == "F" else "backward")
        factor = float(factors[index]) if factors and index < len(factors) else 1.0
        return factor * self.raw_seconds(op, index, rows)

    @property
    def sync_share(self) -> float:
        """Wait of data-parallel replicas at the allreduce, as a share of a step's compute (0 when not measured)."""
        return float(((self.data.get("engine") or {}).get("replicas") or {}).get("sync_share", 0.0))

    def raw_seconds(self, op: str, index: int, rows: int) -> float:
        """Seconds of action op of group ``index`` on ``rows`` samples as the layer bench measured them."""
        key = (op, self.layers["signatures"][index])
        fit = self._fits.get(key)
        if fit is None:
            fit = self._fits[key] = affine_fit(self._group(index)[op])
        return fit[0] + fit[1] * rows

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


PROFILE_ARRAY_BYTES = 128 << 20    # the widest activation a profiled micro-batch may have


def largest_profiled_rows(config: Config) -> int:
    """The largest micro-batch the profile measures; larger ones are extrapolated (times affine, bytes linear)."""
    from hpcpipe.nn.model_spec import model_def

    model = model_def(config)
    widest = max(math.prod(model.boundary(i, 1)[0]) for i in range(model.n_layers + 1))
    return max(1, PROFILE_ARRAY_BYTES // (8 * widest))


def profile_sizes(wanted: list[int], limit: int = 10, largest: int | None = None) -> list[int]:
    """The micro-batch sizes to measure: all wanted ones, or ``limit`` of them spread geometrically.

    Sizes above ``largest`` are measured at ``largest`` instead: a huge global
    batch must not make the profile allocate what no rank could hold.
    """
    sizes = sorted({min(w, largest) if largest else w for w in wanted})
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
    cached, problem = (None, None) if refresh else profile_cache.inspect(cache_dir, key)
    if problem:
        log(f"hpcpipe.plan: the cached profile {problem}: measuring it again")
    if cached and cached["layers"].get("concurrent", 1) != concurrent:
        cached = None
    have = set(Profile(cached, CommModel.from_dict(cached["comm"])).sizes) if cached and "comm" in cached else set()
    missing = [s for s in sizes if s not in have]
    comm_dict = cached.get("comm") if cached else None
    if cached and not missing and "engine" in cached:
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
    if missing:
        log(f"hpcpipe.plan: profiling {config.n_layers} layer groups at micro-batch sizes {missing} "
            f"({threads} BLAS thread{'s' if threads > 1 else ''}, {concurrent} process{'es' if concurrent > 1 else ''} "
            f"side by side) ...")
        measured = profile_cache.run_layer_profile(config, missing, threads, concurrent)
        layers = measured if not cached else profile_cache.merge_layers(cached["layers"], measured)
    else:
        layers = cached["layers"]
    data = {"key": key, "layers": layers, "comm": comm_dict}
    data["engine"] = (cached or {}).get("engine") or _engine_factors(config, Profile(data, CommModel.from_dict(
        comm_dict)), concurrent, log)
    data["seconds"] = round(time.perf_counter() - start, 2) + (cached or {}).get("seconds", 0.0)
    path = profile_cache.write(cache_dir, key, data)
    log(f"hpcpipe.plan: profile saved to {path} ({time.perf_counter() - start:.1f} s)")
    return Profile(data, CommModel.from_dict(comm_dict))


def _engine_factors(config: Config, profile: Profile, ranks: int, log: Any) -> dict:
    """The engine calibration of the profile, or none (said so) when its runs cannot be made here."""
    from hpcpipe.plan.engine_calibration import calibrate

    log(f"hpcpipe.plan: calibrating against real training runs on {ranks} rank(s) ...")
    try:
        engine = calibrate(config, profile, ranks)
    except ConfigError as exc:
        first = str(exc).splitlines()[0]
        log(f"hpcpipe.plan: warning: a calibration run failed, predicting from the layer bench alone: {first}")
        return {"failed": first}
    def factors(values: list[float]) -> str:
        return ", ".join(f"{f:.2f}" for f in values)

    for name in ("replicas", "pipeline", "pipeline_zb"):
        run = engine.get(name)
        if run:
            log(f"hpcpipe.plan: engine over bench, {name} (cut {run['stage_layers']}): "
                f"F x {factors(run['forward'])}; B x {factors(run['backward'])}")
    log(f"hpcpipe.plan: replicas wait {engine['replicas']['sync_share']:.1%} of a step's compute at the allreduce")
    return engine


def default_cache_dir() -> str:
    """Where profiles are kept: $HPCPIPE_PROFILE_DIR, else $XDG_CACHE_HOME/hpcpipe/profiles (~/.cache/...)."""
    explicit = os.environ.get("HPCPIPE_PROFILE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "hpcpipe", "profiles")
