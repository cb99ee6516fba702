"""What communication and a bare rank cost, fitted from the MPI probe (hpcpipe.plan.probe); pure Python, no MPI.

The probe measures, on 2 ranks of this machine, one-way point-to-point times
and 2-rank allreduce times at sizes from 4 KiB to 64 MiB. Each is fitted as
``latency + seconds_per_byte * nbytes`` by least squares on the relative
error (small messages weigh as much as big ones, so the microsecond latency
is not drowned by the noise of a 10 ms transfer), with both coefficients
kept non-negative.

Allreduce over r ranks is scaled from the 2-rank fit with the ring model:
a ring allreduce moves ``2 (r-1)/r x nbytes`` per rank in ``2 (r-1)`` steps,
so ``t(r) = (r-1) x allreduce_latency_s + 2 (r-1)/r x nbytes x allreduce_seconds_per_byte``,
which equals the measured fit at r = 2. Assumptions: every link is as fast as
the one measured (ranks on other nodes go over the network: a plan beyond
this machine is a prediction), and the library runs a ring; for small
messages at many ranks MPI libraries switch to log(r)-step algorithms, so the
latency term is pessimistic there.

A straight line does not fit the whole range well: messages that leave the
caches move at about half the speed of those that stay in them (the 2-rank
allreduce of 64 MiB took twice what the line through 4 KiB .. 64 MiB says).
So the model also keeps the measured points, and p2p() and allreduce()
interpolate between them (made non-decreasing first); outside the measured
range they extend the nearest point with the line's latency and the steeper
of the line's and the last segment's per-byte time. The fitted
coefficients stay the summary (and what a model without points uses).

The tensor-parallel collectives are waited for by polling a nonblocking allreduce
(:class:`hpcpipe.runtime.tp_group.TPGroup`), which MPI advances only inside its
calls: over TCP that took 18x the blocking allreduce's time for 1 MiB reached after
computing (bench/bench_tp_collectives.py between 2 emulated nodes). The probe times
that path too (``tp_allreduce``), and
:meth:`CommModel.tp_allreduce` reads it (the blocking allreduce's points where a
probe did not measure it).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from hpcpipe.errors import ConfigError

LAUNCHER_ENV = "HPCPIPE_MPIEXEC"
STDERR_LINES = 12
MIB = float(1 << 20)   # the fit works in MiB so its sums stay well conditioned


def _pairs(probe: dict, key: str, where: str = "communication probe result") -> list[tuple[float, float]]:
    """Return probe[key] as (nbytes, seconds) pairs, checked: positive finite numbers, 2 sizes or more."""
    raw = probe.get(key) if isinstance(probe, dict) else None
    pairs = []
    for item in raw if isinstance(raw, list) else [None]:
        ok = isinstance(item, (list, tuple)) and len(item) == 2 and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0 for v in item)
        if not ok:
            raise ConfigError(f"{where}: {key!r} must be a list of [nbytes, seconds] pairs of "
                              f"positive numbers, got {item!r} in {raw!r}"[:400])
        pairs.append((float(item[0]), float(item[1])))
    if len({n for n, _ in pairs}) < 2:
        raise ConfigError(f"{where}: {key!r} needs at least 2 different message sizes, "
                          f"got {[n for n, _ in pairs]}")
    return pairs


def fit_line(pairs: list[tuple[float, float]]) -> tuple[float, float]:
    """Return (latency_s, seconds_per_byte) >= 0 minimising the squared relative error over (nbytes, seconds)."""
    rows = [(1.0 / (t * t), n / MIB, t) for n, t in pairs]   # (weight, x, t)

    def error(a: float, b: float) -> float:
        return sum(w * (a + b * x - t) ** 2 for w, x, t in rows)

    s, sx, st = sum(w for w, _, _ in rows), sum(w * x for w, x, _ in rows), sum(w * t for w, _, t in rows)
    sxx, sxt = sum(w * x * x for w, x, _ in rows), sum(w * x * t for w, x, t in rows)
    # the unconstrained optimum if it is non-negative, else the best fit on either edge (a = 0 or b = 0)
    candidates = [(0.0, sxt / sxx), (st / s, 0.0)]
    det = s * sxx - sx * sx
    if det > 0:
        b = (s * sxt - sx * st) / det
        a = (st - b * sx) / s
        if a >= 0 and b >= 0:
            candidates.append((a, b))
    a, b = min(candidates, key=lambda ab: error(*ab))
    return a, b / MIB


Points = tuple[tuple[float, float], ...]


def monotone_points(pairs: list[tuple[float, float]]) -> Points:
    """Return the (nbytes, seconds) pairs sorted by size, the fastest time per size, times made non-decreasing."""
    best: dict[float, float] = {}
    for n, t in pairs:
        best[n] = min(t, best.get(n, math.inf))
    points, slowest = [], 0.0
    for n in sorted(best):
        slowest = max(slowest, best[n])   # a bigger message never costs less than a smaller one
        points.append((n, slowest))
    return tuple(points)


def interpolate(points: Points, latency: float, per_byte: float, nbytes: float) -> float:
    """Return the time of nbytes read off the measured points (see the module docstring); the line if none."""
    if len(points) < 2:
        return latency + per_byte * nbytes
    (n0, t0), (n_last, t_last) = points[0], points[-1]
    if nbytes <= n0:
        return max(min(latency, t0), t0 - per_byte * (n0 - nbytes))
    if nbytes >= n_last:
        n_prev, t_prev = points[-2]
        tail = max(per_byte, (t_last - t_prev) / (n_last - n_prev))
        return t_last + tail * (nbytes - n_last)
    for (na, ta), (nb, tb) in zip(points, points[1:], strict=False):
        if nbytes <= nb:
            return ta + (tb - ta) * (nbytes - na) / (nb - na)
    return t_last   # not reached: nbytes < n_last


@dataclass(frozen=True)
class CommModel:
    """Fitted costs: one-way p2p and 2-rank allreduce as latency + per-byte time, and a bare rank's memory."""

    latency_s: float
    seconds_per_byte: float
    allreduce_latency_s: float
    allreduce_seconds_per_byte: float
    baseline_rss_bytes: int
    mpi: str = ""
    p2p_points: Points = ()          # measured (nbytes, one-way seconds), non-decreasing
    allreduce_points: Points = ()    # measured (nbytes, 2-rank allreduce seconds), non-decreasing
    tp_allreduce_points: Points = ()     # the same made as tp collectives are (nonblocking, polled); () unmeasured

    @classmethod
    def from_probe(cls, probe: dict) -> CommModel:
        """Fit the model to a probe result (the JSON of hpcpipe.plan.probe, as a dict)."""
        p2p, allreduce = _pairs(probe, "p2p"), _pairs(probe, "allreduce")
        rss = probe.get("baseline_rss_bytes")
        if not isinstance(rss, int) or isinstance(rss, bool) or rss <= 0:
            raise ConfigError(f"communication probe result: 'baseline_rss_bytes' must be a positive integer, "
                              f"got {rss!r}")
        polled = monotone_points(_pairs(probe, "tp_allreduce")) if probe.get("tp_allreduce") else ()
        return cls(*fit_line(p2p), *fit_line(allreduce), rss, str(probe.get("mpi", "")),
                   monotone_points(p2p), monotone_points(allreduce), polled)

    @property
    def bandwidth_bytes_per_s(self) -> float:
        """Point-to-point bandwidth (1 / seconds_per_byte; infinite when the fit found no per-byte cost)."""
        return 1.0 / self.seconds_per_byte if self.seconds_per_byte > 0 else math.inf

    def p2p(self, nbytes: float) -> float:
        """Return the predicted one-way time in seconds of a message of nbytes between two ranks."""
        if nbytes < 0:
            raise ValueError(f"p2p: nbytes {nbytes} is negative")
        return interpolate(self.p2p_points, self.latency_s, self.seconds_per_byte, nbytes)

    def allreduce(self, nbytes: float, ranks: int) -> float:
        """Return the predicted time in seconds of an allreduce of nbytes over ranks (ring model; 0 for 1 rank)."""
        if nbytes < 0 or ranks < 1:
            raise ValueError(f"allreduce: nbytes {nbytes} must be >= 0 and ranks {ranks} >= 1")
        if ranks == 1:
            return 0.0
        return self._ring(self.allreduce_points, nbytes, ranks)

    def tp_allreduce(self, nbytes: float, ranks: int) -> float:
        """Return the predicted seconds of a tp collective's sum of nbytes over ranks: the polled nonblocking
        allreduce's measured points (the blocking ones' where none were measured), ring-scaled."""
        if nbytes < 0 or ranks < 1:
            raise ValueError(f"tp_allreduce: nbytes {nbytes} must be >= 0 and ranks {ranks} >= 1")
        if ranks == 1:
            return 0.0
        return self._ring(self.tp_allreduce_points or self.allreduce_points, nbytes, ranks)

    def _ring(self, points: Points, nbytes: float, ranks: int) -> float:
        two = interpolate(points, self.allreduce_latency_s, self.allreduce_seconds_per_byte, nbytes)
        latency = min(self.allreduce_latency_s, two)
        # ring: the latency grows with the r-1 steps, the bytes term with the 2(r-1)/r of the data each rank moves
        return (ranks - 1) * latency + 2.0 * (ranks - 1) / ranks * (two - latency)

    def to_dict(self) -> dict:
        """Return the model as a JSON-ready dict (for the planner's cache)."""
        data = asdict(self)
        for key in ("p2p_points", "allreduce_points", "tp_allreduce_points"):
            data[key] = [list(point) for point in data[key]]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> CommModel:
        """Rebuild a model from to_dict's output; ConfigError naming the key if one is missing or wrong."""
        if not isinstance(data, dict):
            raise ConfigError(f"cached communication model: expected a table, got {type(data).__name__}")
        values = {}
        for field in fields(cls):
            value = data.get(field.name)
            if field.name == "mpi":
                values["mpi"] = str(value or "")
                continue
            if field.name.endswith("_points"):
                pairs = _pairs({field.name: value}, field.name, "cached communication model") if value else []
                values[field.name] = monotone_points(pairs)
                continue
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not number or not math.isfinite(value) or value < 0:
                raise ConfigError(f"cached communication model: {field.name!r} must be a non-negative number, "
                                  f"got {value!r}")
            values[field.name] = int(value) if field.name == "baseline_rss_bytes" else float(value)
        return cls(**values)


@dataclass(frozen=True)
class Placement:
    """Where a plan's ranks sit: ranks_per_node consecutive world ranks a node, one link model within, one between.

    hpcpipe's world rank w of grid cell (d, p, t) is ``(d x pp + p) x tp + t``, and launchers
    fill nodes with consecutive ranks (hydra's ``-ppn``, Slurm's block distribution), so:

    * a tp group (tp consecutive ranks) leaves its node when tp > R or R is no multiple of tp;
    * a pipeline (pp x tp consecutive ranks) does so when pp x tp > R or R is no multiple of it;
    * the replicas of a stage are pp x tp ranks apart: they span nodes whenever the job does.

    A collective or message over an axis whose groups span nodes is costed with the link between
    nodes (its slowest hop: a ring is as fast as its slowest link), otherwise with the link within.
    ``ranks_per_node`` None means the whole job on one node.
    """

    within: CommModel
    between: CommModel | None = None
    ranks_per_node: int | None = None

    def crosses(self, axis: str, dp: int, pp: int, tp: int) -> bool:
        """Whether some group along axis ("dp", "pp", "tp" or "world") spans two nodes."""
        if axis not in ("dp", "pp", "tp", "world"):
            raise ValueError(f"crosses: axis {axis!r} is not dp, pp, tp or world")
        per_node = self.ranks_per_node
        if per_node is None or dp * pp * tp <= per_node:
            return False
        if axis == "tp":
            return tp > 1 and (tp > per_node or per_node % tp != 0)
        if axis == "pp":
            return pp > 1 and (pp * tp > per_node or per_node % (pp * tp) != 0)
        return dp > 1 if axis == "dp" else True

    def link(self, axis: str, dp: int, pp: int, tp: int) -> CommModel:
        """The model that costs axis's messages and collectives for a dp x pp x tp layout."""
        if self.between is not None and self.crosses(axis, dp, pp, tp):
            return self.between
        return self.within
