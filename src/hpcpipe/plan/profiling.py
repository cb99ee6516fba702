"""Measuring a profile: which micro-batch sizes, the layer bench in subprocesses, the probe, the calibration.

:func:`load_profile` returns the cached profile for the configured model on this
host (:mod:`hpcpipe.profiles`), measuring first what it lacks: the layer groups
(``python -m hpcpipe.plan.layer_profile`` in as many processes side by side as
the planned job runs on a node), the communication probe and a bare rank's
memory (:mod:`hpcpipe.plan.launch`), and the engine calibration's short
training runs (:mod:`hpcpipe.plan.engine_calibration`).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpcpipe.config import Config
from hpcpipe.errors import ConfigError
from hpcpipe.plan import engine_calibration
from hpcpipe.plan.launch import measure_comm, measure_rank_baseline
from hpcpipe.plan.layer_profile import read_share
from hpcpipe.profiles import cache as profile_cache
from hpcpipe.profiles.comm_model import CommModel
from hpcpipe.profiles.load import busier, busy_warning, machine_load
from hpcpipe.profiles.profile import Profile
from hpcpipe.runtime.progress import Progress

PROFILE_ARRAY_BYTES = 128 << 20    # the widest activation a profiled micro-batch may have


def largest_profiled_rows(config: Config) -> int:
    """The largest micro-batch the profile measures; larger ones are extrapolated (times affine, bytes linear)."""
    from hpcpipe.nn.registry import model_def

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
                 concurrent: int = 1, log: Any = None, before_measuring: Callable[[], None] | None = None,
                 tps: tuple[int, ...] = ()) -> Profile:
    """Return the profile of the configured model on this host: from the cache, measuring what it lacks.

    ``tps``: the tensor-parallel widths the plans may use; the groups are measured split at each
    (a size is measured again when some width lacks it).

    ``concurrent`` ranks of the planned job compute at once on a node: the layers are
    measured with as many copies side by side (a cached profile taken with another
    count is measured again). ``before_measuring`` runs before anything is measured
    (the planner's memory check: it raises to refuse). The machine's load is stored
    with what is measured, and a profile measured on a busy machine, or measured
    now on one, is warned about.
    """
    log = log or (lambda text: print(text, file=sys.stderr, flush=True))
    key = profile_cache.layer_key(config, threads)
    cached, problem = (None, None) if refresh else profile_cache.inspect(cache_dir, key)
    if problem:
        log(f"hpcpipe.plan: the cached profile {problem}: measuring it again")
    if cached and cached["layers"].get("concurrent", 1) != concurrent:
        cached = None
    have: set[int] = set()
    if cached and "comm" in cached:
        known = Profile(cached, CommModel.from_dict(cached["comm"]))
        have = set(known.sizes).intersection(*(known.sizes_at(tp) for tp in tps))
    missing = [s for s in sizes if s not in have]
    comm_dict = cached.get("comm") if cached else None
    used = (cached or {}).get("load")
    if cached and not missing and "engine" in cached:
        warning = busy_warning(used, None, measuring=False)
        if warning:
            log(warning)
        return Profile(cached, CommModel.from_dict(comm_dict), from_cache=True)
    if before_measuring is not None:
        before_measuring()
    now = machine_load()
    warning = busy_warning(used, now, measuring=True)
    if warning:
        log(warning)
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
        split = f", whole and split over tp = {', '.join(map(str, tps))}" if tps else ""
        log(f"hpcpipe.plan: profiling {config.n_layers} layer groups at micro-batch sizes {missing}{split} "
            f"({threads} BLAS thread{'s' if threads > 1 else ''}, {concurrent} process{'es' if concurrent > 1 else ''} "
            f"side by side) ...")
        measured = run_layer_profile(config, missing, threads, concurrent, tps=tps)
        layers = measured if not cached else profile_cache.merge_layers(cached["layers"], measured)
    else:
        layers = cached["layers"]
    data = {"key": key, "layers": layers, "comm": comm_dict, "load": busier(used, now) if cached else now}
    data["engine"] = (cached or {}).get("engine") or _engine_factors(config, Profile(data, CommModel.from_dict(
        comm_dict)), concurrent, log)
    data["seconds"] = round(time.perf_counter() - start, 2) + (cached or {}).get("seconds", 0.0)
    path = profile_cache.write(cache_dir, key, data)
    log(f"hpcpipe.plan: profile saved to {path} ({time.perf_counter() - start:.1f} s)")
    return Profile(data, CommModel.from_dict(comm_dict))


def _engine_factors(config: Config, profile: Profile, ranks: int, log: Any) -> dict:
    """The engine calibration of the profile, or none (said so) when its runs cannot be made here."""
    log(f"hpcpipe.plan: calibrating against real training runs on {ranks} rank(s) ...")
    progress = Progress()
    runs = {"done": 0, "total": 1}

    def started(done: int, total: int) -> None:
        runs.update(done=done, total=total)

    try:
        with progress.ticking(lambda: f"hpcpipe.plan: calibration run {min(runs['done'] + 1, runs['total'])} of "
                                      f"{runs['total']}", lambda: runs["done"] / runs["total"]):
            engine = engine_calibration.calibrate(config, profile, ranks, on_run=started)
        progress.close(f"hpcpipe.plan: calibration runs done ({runs['total']})")
    except ConfigError as exc:
        first = str(exc).splitlines()[0]
        progress.close()
        log(f"hpcpipe.plan: warning: a calibration run failed, predicting from the layer bench alone: {first}")
        return {"failed": first}
    finally:
        progress.close()          # a redrawn line ends before whatever is printed next (Ctrl-C's line too)

    def factors(values: list[float]) -> str:
        return ", ".join(f"{f:.2f}" for f in values)

    for name in ("replicas", "pipeline", "pipeline_zb"):
        run = engine.get(name)
        if run:
            log(f"hpcpipe.plan: engine over bench, {name} (cut {run['stage_layers']}): "
                f"F x {factors(run['forward'])}; B x {factors(run['backward'])}")
    log(f"hpcpipe.plan: replicas wait {engine['replicas']['sync_share']:.1%} of a step's compute at the allreduce")
    if engine.get("tensor"):
        run = engine["tensor"]
        log(f"hpcpipe.plan: engine over bench, tp={run['tp']}: F x {factors(run['forward'][:1])}, "
            f"B x {factors(run['backward'][:1])}; {run['collectives']:.0f} tp collectives took "
            f"{run['collective_s'] * 1e3:.1f} ms a micro-batch of {run['rows']}")
    return engine


def thread_env(threads: int) -> dict[str, str]:
    """The environment of a process computing with ``threads`` BLAS threads (as a rank of the planned job)."""
    env = dict(os.environ)
    env.pop("HPCPIPE_AUTO_THREADS", None)      # these counts are chosen, not inherited
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS", "HPCPIPE_THREADS"):
        env[name] = str(threads)
    return env


def _average(results: list[dict]) -> dict:
    """One layer profile from the copies that ran side by side: mean times, largest bytes."""
    out = json.loads(json.dumps(results[0]))
    for key, entry in out["groups"].items():
        for field, values in entry.items():
            if not isinstance(values, dict):
                continue
            for rows in values:
                column = [r["groups"][key][field][rows] for r in results]
                values[rows] = max(column) if field.endswith("bytes") else sum(column) / len(column)
    return out


def run_layer_profile(config: Config, sizes: list[int], threads: int, concurrent: int = 1,
                      timeout_s: float = 600.0, tps: tuple[int, ...] = ()) -> dict:
    """Measure the layer groups in ``concurrent`` subprocesses side by side, each with the planned BLAS threads.

    The planned job runs that many ranks at once on a node like this one: they share
    its memory bandwidth and caches, so each is measured while its siblings compute
    the model, as a rank of the real run is.
    """
    with tempfile.TemporaryDirectory(prefix="hpcpipe-profile-") as tmp:
        request = os.path.join(tmp, "request.json")
        with open(request, "w") as f:
            json.dump({"config": config.to_dict(), "sizes": sizes, "tps": list(tps)}, f)
        outs = [os.path.join(tmp, f"profile-{k}.json") for k in range(concurrent)]
        # copy k starts its passes k / concurrent of the way through the sizes
        cmds = [[sys.executable, "-m", "hpcpipe.plan.layer_profile", request, out, str(k * len(sizes) // concurrent)]
                for k, out in enumerate(outs)]
        procs = [subprocess.Popen(cmd, env=thread_env(threads), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  text=True) for cmd in cmds]
        failures = []
        progress = Progress()

        def share() -> float:
            return min(read_share(out + ".progress") for out in outs)

        try:
            with progress.ticking(lambda: f"hpcpipe.plan: profiling layers {share():.0%}", share):
                for proc in procs:
                    _, err = proc.communicate(timeout=timeout_s)
                    if proc.returncode != 0:
                        failures.append((proc.returncode, err))
            if not failures:
                progress.close("hpcpipe.plan: profiling layers done")
        except subprocess.TimeoutExpired:
            raise ConfigError(f"profiling the layers took more than {timeout_s:.0f} s ({' '.join(cmds[0])})") from None
        finally:
            progress.close()
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        if failures:
            code, err = failures[0]
            tail = "\n".join(err.strip().splitlines()[-5:])
            raise ConfigError(f"profiling the layers failed (exit {code}): {tail}")
        results = [profile_cache.read_json(Path(out)) for out in outs]
    if any(r is None for r in results):
        raise ConfigError("profiling the layers wrote no result")
    data = _average(results)
    data["concurrent"] = concurrent
    return data
