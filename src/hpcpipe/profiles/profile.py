"""The measured profile the planner predicts from: per layer group and micro-batch size, plus comm and memory.

:class:`Profile` answers "how long does op F/I/W/B of layer group i take on
``rows`` samples" from a line fitted through the measured sizes, and "how many
bytes does it keep or need" by interpolating linearly between them (and scaling
in proportion to the rows beyond them). The planner measures it
(:func:`hpcpipe.plan.profiling.load_profile`); ``parallel.stage_layers = "profile"`` only reads it.
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass, field
from typing import Any

from hpcpipe.profiles.check import optimizer_name
from hpcpipe.profiles.comm_model import CommModel

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

    def seconds(self, op: str, index: int, rows: int, pipelined: bool = False, schedule: str = "1f1b",
                tp: int = 1) -> float:
        """Seconds of action op (F, I, W or B) of layer group ``index`` on a micro-batch of ``rows`` samples
        (at tensor-parallel width ``tp``: one tp rank's compute, :meth:`raw_seconds`).

        The bench's time scaled by the engine's factor for the group (:mod:`engine_calibration`): when
        ``pipelined`` (pp > 1), the pipeline run's of ``schedule``'s family (GPipe and ZB-H1: the
        ZB-H1 run, else the 1F1B run) if there was one, else the replicas run's; at ``tp`` > 1 the
        tensor-parallel run's when there was one.
        """
        engine = self.data.get("engine") or {}
        run = self.tensor if tp > 1 else None
        if pipelined and run is None:
            run = (engine.get("pipeline_zb") if schedule in ZB_CALIBRATED else None) or engine.get("pipeline")
        run = run or engine.get("replicas") or {}
        factors = run.get("forward" if op == "F" else "backward")
        factor = float(factors[index]) if factors and index < len(factors) else 1.0
        return factor * self.raw_seconds(op, index, rows, tp)

    @property
    def tensor(self) -> dict[str, Any] | None:
        """The tensor-parallel calibration run's factors and collective seconds (None when there was none)."""
        return (self.data.get("engine") or {}).get("tensor") or None

    @property
    def sync_share(self) -> float:
        """Wait of data-parallel replicas at the allreduce, as a share of a step's compute (0 when not measured)."""
        return float(((self.data.get("engine") or {}).get("replicas") or {}).get("sync_share", 0.0))

    def raw_seconds(self, op: str, index: int, rows: int, tp: int = 1) -> float:
        """Seconds of action op of group ``index`` on ``rows`` samples as the layer bench measured them.

        At ``tp`` > 1: the group split as tp rank 0 holds it, measured at its split shapes
        (``F/tp2``, ...) when the profile has them, else the whole group's time / tp.
        """
        field = op if tp == 1 else f"{op}/tp{tp}"
        points = self._group(index).get(field)
        if not points:
            return self.raw_seconds(op, index, rows) / tp
        key = (field, self.layers["signatures"][index])
        fit = self._fits.get(key)
        if fit is None:
            fit = self._fits[key] = affine_fit(points)
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
        return self.layers["optimizer"][optimizer_name(train)]

    @property
    def baseline_bytes(self) -> int:
        """Resident memory of a rank before any array: interpreter, libraries, MPI, BLAS buffers."""
        return int(self.comm.baseline_rss_bytes) + int(self.layers.get("blas_rss_bytes", 0))

    @property
    def sizes(self) -> list[int]:
        """Micro-batch sizes measured."""
        return self.sizes_at(1)

    def sizes_at(self, tp: int) -> list[int]:
        """Micro-batch sizes measured at tensor-parallel width tp for every group (split shapes; none when not
        profiled)."""
        field = "F" if tp == 1 else f"F/tp{tp}"
        measured = [set(group.get(field, {})) for group in self.layers["groups"].values()]
        return sorted(int(k) for k in set.intersection(*measured))


def default_cache_dir() -> str:
    """Where profiles are kept: $HPCPIPE_PROFILE_DIR, else $XDG_CACHE_HOME/hpcpipe/profiles (~/.cache/...)."""
    explicit = os.environ.get("HPCPIPE_PROFILE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "hpcpipe", "profiles")
