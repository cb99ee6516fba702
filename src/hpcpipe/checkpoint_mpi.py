"""Collective checkpoint save and state load: who writes, who reads, and agreement before anyone proceeds.

Save: after the data-parallel averaged update every replica of a stage holds
the same parameters and optimizer state, so dp-rank 0 of each pipeline rank
writes that rank's layers (by global index) into the temporary directory,
all writers in parallel; world rank 0 then writes the manifest, commits,
moves ``latest`` and prunes (see :mod:`hpcpipe.ckpt_files`).

Load: every rank reads only its own layers from whichever files hold them
(the manifest maps layer -> file), so a checkpoint written at any
(dp, pp, schedule) loads at any other. Each rank checks what it reads
(SHA-256 against the manifest, fletcher32 on every dataset, names, shapes),
then all ranks agree; if anyone failed, every rank raises the same
AgreedError naming the bad file. Nobody hangs and nothing loads half.

Test hook (environment, never config): ``HPCPIPE_CRASH_IN_SAVE=step=S,rank=R[,point=write|commit]``
kills world rank R with SIGKILL while it saves step S: ``write`` after its
file's layers are written and before the optimizer state, ``commit`` (rank
0) after the manifest is written and before the rename.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import ckpt_files as cf
from .checkpoint import WeightsSource
from .comm import Poller, agree, broadcast, gather_to_root
from .errors import AgreedError, ConfigError
from .weights import OptimizerArrays, weights_image, write_file_durably


def _crash_due(point: str, step: int, world_rank: int) -> bool:
    """Whether HPCPIPE_CRASH_IN_SAVE names this point, step and rank."""
    spec = os.environ.get("HPCPIPE_CRASH_IN_SAVE", "")
    if not spec:
        return False
    fields = dict(item.split("=", 1) for item in spec.split(",") if "=" in item)
    return (fields.get("point", "write") == point and int(fields.get("step", -1)) == step
            and int(fields.get("rank", 0)) == world_rank)


def _crash_hook(point: str, step: int, world_rank: int) -> None:
    """Kill this process (SIGKILL) when HPCPIPE_CRASH_IN_SAVE names this point, step and rank."""
    if _crash_due(point, step, world_rank):
        os.kill(os.getpid(), signal.SIGKILL)


def human_bytes(n: float) -> str:
    """Return a size as e.g. '180 KiB' or '1.2 MiB'."""
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit in ("bytes", "KiB") else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def free_bytes(path: Path) -> int:
    """Return the bytes an unprivileged writer may still use on path's file system."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


# per file: its size rounded up to whole blocks; plus the directory, manifest and two pointers
_BLOCK = 4096
_SLACK = 4 * _BLOCK


def space_needed(sizes: list[int]) -> int:
    """Return about how many bytes a checkpoint with files of these sizes takes on disk."""
    return sum(-(-n // _BLOCK) * _BLOCK for n in sizes) + _SLACK


def _space_message(root: Path, where: Path, step: int, needed: int) -> str:
    try:
        free = human_bytes(free_bytes(where))
    except OSError:
        free = "no space"
    try:
        previous = cf.read_latest(where if where.name != cf.tmp_name(step) else where.parent)
    except ConfigError:
        previous = None
    kept = f"{previous} is kept" if previous else "nothing was saved"
    return (f"checkpoint.dir {str(root)!r} has {free} free, the checkpoint of step {step} needs about "
            f"{human_bytes(needed)}; {kept} (free some space or set checkpoint.dir)")


def _failure(exc: Exception, what: str, root: Path, where: Path, step: int, needed: int) -> str:
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return _space_message(root, where, step, needed)
    return f"{what}: {type(exc).__name__}: {exc}"


def _agreed(world: Any, poller: Poller, error: str | None, code: int) -> None:
    """Raise AgreedError(code) on every rank if any rank reported an error (collective)."""
    message = agree(world, poller, error)
    if message is not None:
        raise AgreedError(message, code)


def optimizer_arrays(params: Any, optimizer: Any) -> OptimizerArrays:
    """Slice the optimizer's flat state buffers per global layer with the parameters' views (host copies)."""
    out: OptimizerArrays = {}
    for i in params.layer_indices():
        out[i] = {}
        for state, buf in optimizer.state.items():
            out[i][state] = {name: np.array(params.host(params.slice_of(buf, i, name))) for name in params.views[i]}
    return out


@dataclass(frozen=True)
class SaveInfo:
    """What the manifest records beside the files: layout, config, optimizer and data position."""

    layout: dict[str, Any]
    config: dict[str, Any]
    samples_seen: int
    global_batch: int


def _abandon(tmp: Path | None, run_dir: Path | None, made_run: bool) -> None:
    """Remove what a failed save of this run left: its temporary directory, and a run directory it just made."""
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    if made_run and run_dir is not None:
        try:
            run_dir.rmdir()   # only while empty: never anything else
        except OSError:
            pass


def _commit(root: Path, run_dir: Path, tmp: Path, step: int, manifest: dict[str, Any], keep: int) -> Path:
    """Rank 0: write the manifest, commit, move the run's latest and ROOT's, prune the run's old checkpoints."""
    cf.write_json_durably(tmp / cf.MANIFEST, manifest)
    _crash_hook("commit", step, 0)
    final = cf.commit(run_dir, tmp, step)
    try:
        cf.set_latest(run_dir, final.name)
    except OSError:
        aside = run_dir / f".del-{final.name}"   # nothing points at it: this run's own, removed
        os.rename(final, aside)
        shutil.rmtree(aside, ignore_errors=True)
        raise
    if run_dir.resolve() != root.resolve():
        cf.set_latest(root, f"{run_dir.name}/{final.name}", cf.root_latest_tmp(run_dir))
    cf.prune(run_dir, keep)
    return final


def save(world: Any, poller: Poller, root: str | Path, step: int, *, run_dir: Path | None, dp_rank: int,
         pp_rank: int, params: Any, optimizer: Any, n_layers: int, info: SaveInfo, keep: int) -> Path:
    """Save a checkpoint of `step` completed steps (collective over world); return its directory.

    ``run_dir`` is the run's directory under the root ``checkpoint.dir``; None for a fresh
    run's first save, which creates ROOT/run-NNNN (world rank 0, the next free number).
    Any failure on any rank (disk full, permissions) raises AgreedError(code=1) on every
    rank after rank 0 removed the save's temporary directory; the previous checkpoint and
    every ``latest`` stay as they were. Free space is checked before any file is written.
    """
    rank = world.Get_rank()
    root = Path(root)
    fresh = run_dir is None
    made_run, tmp, error = False, None, None
    if rank == 0:
        try:
            if run_dir is None:
                run_dir, made_run = cf.new_run_dir(root), True
            cf.clean_leftovers(run_dir)
            (root / cf.root_latest_tmp(run_dir)).unlink(missing_ok=True)
            tmp = run_dir / cf.tmp_name(step)
            tmp.mkdir()
        except OSError as exc:
            error = f"cannot create checkpoint directory {str(tmp or run_dir or root)!r}: {exc}"
    failed = agree(world, poller, error)
    if failed is not None:
        if rank == 0:
            _abandon(tmp, run_dir, made_run)
        raise AgreedError(failed, 1)
    if fresh:
        run_dir = Path(broadcast(world, str(run_dir) if rank == 0 else None))
    tmp = run_dir / cf.tmp_name(step)

    def fail_if(error: str | None) -> None:
        failed = agree(world, poller, error)
        if failed is not None:
            if rank == 0:
                _abandon(tmp, run_dir, made_run)
            raise AgreedError(failed, 1)

    # 1. every writer builds its file in memory; rank 0 checks there is room for all of them
    image, entry, error = None, None, None
    path = tmp / cf.stage_file(pp_rank)
    if dp_rank == 0:
        try:
            opt = optimizer_arrays(params, optimizer)

            def crash_point(partial: bytes) -> None:
                if _crash_due("write", step, rank):   # leave the half-written file a killed writer would
                    path.write_bytes(partial)
                    _crash_hook("write", step, rank)

            image = weights_image(params.export(), n_layers=n_layers, model_config=info.config["model"], step=step,
                                  optimizer=opt, optimizer_attrs={"name": info.config["train"]["optimizer"],
                                                                  "steps": optimizer.steps},
                                  attrs={"pp_rank": pp_rank}, after_layers=crash_point)
            entry = {"name": path.name, "pp_rank": pp_rank, "layers": params.layer_indices(),
                     "bytes": len(image), "sha256": hashlib.sha256(image).hexdigest()}
        except Exception as exc:  # noqa: BLE001 - any failure must be agreed on, not hang the others
            error = f"cannot build checkpoint file {str(path)!r}: {type(exc).__name__}: {exc}"
    entries = gather_to_root(world, entry)
    needed = 0
    if rank == 0:
        needed = space_needed([e["bytes"] for e in entries if e is not None])
        try:
            if error is None and free_bytes(tmp) < needed:
                error = _space_message(root, tmp, step, needed)
        except OSError as exc:
            error = f"cannot check free space in {str(tmp)!r}: {exc}"
    fail_if(error)
    needed = broadcast(world, needed)

    # 2. every writer writes its file (in parallel)
    if image is not None:
        try:
            write_file_durably(path, image)
        except Exception as exc:  # noqa: BLE001
            error = _failure(exc, f"cannot write checkpoint file {str(path)!r}", root, tmp, step, needed)
    image = None
    fail_if(error)

    # 3. rank 0 commits
    final = run_dir / cf.step_name(step)
    if rank == 0:
        try:
            manifest = cf.build_manifest(
                step, n_layers, info.layout, info.config,
                {"name": info.config["train"]["optimizer"], "steps": optimizer.steps, "state": sorted(optimizer.state)},
                {"samples_seen": info.samples_seen, "global_batch": info.global_batch,
                 "shuffle": info.config["data"]["shuffle"], "seed": info.config["data"]["seed"]},
                [e for e in entries if e is not None], run=run_dir.name)
            final = _commit(root, run_dir, tmp, step, manifest, keep)
        except Exception as exc:  # noqa: BLE001
            error = _failure(exc, f"cannot commit checkpoint {str(final)!r}", root, run_dir, step, needed)
    fail_if(error)
    return final


@dataclass
class LoadedState:
    """One rank's share of a loaded state."""

    arrays: dict[int, dict[str, np.ndarray]]
    optimizer_attrs: dict[str, Any]
    optimizer: OptimizerArrays | None


def load(world: Any, poller: Poller, source: WeightsSource, indices: list[int], with_optimizer: bool,
         clean_root: str | Path | None = None) -> LoadedState:
    """Read this rank's layers (and optimizer state) from source; all ranks agree before returning.

    Raises AgreedError(code=2) naming the bad file on every rank if any rank failed. With
    clean_root, world rank 0 then removes leftovers of interrupted saves there.
    """
    error, state = None, None
    try:
        arrays = source.read(indices)
        attrs, opt = source.read_optimizer(indices) if with_optimizer else ({}, None)
        state = LoadedState(arrays, attrs, opt)
    except ConfigError as exc:
        error = str(exc)
    except Exception as exc:  # noqa: BLE001 - an unexpected failure must be agreed on too
        error = f"cannot load {source.describe()}: {type(exc).__name__}: {exc}"
    _agreed(world, poller, error, 2)
    if clean_root is not None and world.Get_rank() == 0:
        cf.clean_leftovers(clean_root)
    return state
