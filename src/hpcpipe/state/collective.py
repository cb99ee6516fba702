"""Collective checkpoint save and state load: who writes, who reads, and agreement before anyone proceeds.

Save: after the data-parallel averaged update every replica of a stage holds
the same parameters and optimizer state, so dp-rank 0 of each pipeline rank
writes that rank's layers (by global index) into the temporary directory,
all writers in parallel; world rank 0 then writes the manifest, commits,
moves ``latest`` and prunes (see :mod:`hpcpipe.state.directory_protocol`).

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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hpcpipe.errors import ConfigError, HpcpipeError
from hpcpipe.runtime.comm import Poller, broadcast, gather_to_root, together
from hpcpipe.runtime.faults import crash_due, crash_hook
from hpcpipe.state import directory_protocol as cf
from hpcpipe.state.weights import OptimizerArrays, weights_image, write_file_durably
from hpcpipe.state.weights_source import Shards, WeightsSource

if TYPE_CHECKING:
    from mpi4py.MPI import Comm


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
    order: str          # the sample order's name: "file", or the shuffled order's (train.shuffle.ORDER)
    tokenizer: Any = None     # the run's StoredTokenizer, written into every stage file


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
    crash_hook("commit", step, 0)
    final = cf.commit(run_dir, tmp, step)
    try:
        cf.set_latest(run_dir, final.name)
    except OSError:
        aside = run_dir / f".del-{final.name}"   # nothing points at it: this run's own, removed
        os.rename(final, aside)
        shutil.rmtree(aside, ignore_errors=True)
        raise
    # the root's pointer names the newest checkpoint of any run; when checkpoint.dir names the run
    # itself (resuming an older run), its root is the parent
    top = root if run_dir.resolve() != root.resolve() else \
        run_dir.parent if cf.is_run_dir(run_dir) and (run_dir.parent / cf.LATEST).is_file() else None
    if top is not None:
        cf.set_latest(top, f"{run_dir.name}/{final.name}", cf.root_latest_tmp(run_dir))
    cf.prune(run_dir, keep)
    return final


def save(world: Comm, poller: Poller, root: str | Path, step: int, *, run_dir: Path | None, dp_rank: int,
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
    made_run, tmp = False, None

    def abandon() -> None:
        if rank == 0:
            _abandon(tmp, run_dir, made_run)

    # 0. rank 0 makes the run directory (a fresh run's first save) and the temporary one
    with together(world, poller, 1,
                  lambda e: f"cannot create checkpoint directory {str(tmp or run_dir or root)!r}: {e}", abandon):
        if rank == 0:
            if run_dir is None:
                run_dir, made_run = cf.new_run_dir(root), True
            cf.clean_leftovers(run_dir)
            (root / cf.root_latest_tmp(run_dir)).unlink(missing_ok=True)
            tmp = run_dir / cf.tmp_name(step)
            tmp.mkdir()
    if fresh:
        run_dir = Path(broadcast(world, str(run_dir) if rank == 0 else None))
    tmp = run_dir / cf.tmp_name(step)
    path = tmp / cf.stage_file(pp_rank)

    # 1. every writer (a stage's first replica; with tensor parallelism its tp rank 0, which gathers the whole
    # tensors from the stage's tp ranks; with expert parallelism ep rank 0 of the first ep group, which gathers
    # the experts of the stage's ep ranks: a stage file holds whole tensors) builds its file in memory; rank 0
    # checks there is room for all of them
    image, entry, layers, opt = None, None, None, None
    if dp_rank < (params.ep.size if getattr(params, "ep", None) else 1):     # with ep: the first ep group
        layers = params.whole(params.export())                                  # collective over the tp/ep ranks
        opt = params.whole_states(optimizer_arrays(params, optimizer))
    with together(world, poller, 1, lambda e: f"cannot build checkpoint file {str(path)!r}: {type(e).__name__}: {e}",
                  abandon):
        if layers is not None:

            def crash_point(partial: bytes) -> None:
                if crash_due("write", step, rank):   # leave the half-written file a killed writer would
                    path.write_bytes(partial)
                    crash_hook("write", step, rank)

            image = weights_image(layers, n_layers=n_layers, model_config=info.config["model"], step=step,
                                  optimizer=opt, optimizer_attrs={"name": info.config["train"]["optimizer"],
                                                                  "steps": optimizer.steps},
                                  attrs={"pp_rank": pp_rank}, after_layers=crash_point, tokenizer=info.tokenizer)
            entry = {"name": path.name, "pp_rank": pp_rank, "layers": params.layer_indices(),
                     "bytes": len(image), "sha256": hashlib.sha256(image).hexdigest()}
    entries = gather_to_root(world, entry)
    needed = 0
    with together(world, poller, 1, lambda e: f"cannot check free space in {str(tmp)!r}: {e}", abandon):
        if rank == 0:
            needed = space_needed([e["bytes"] for e in entries if e is not None])
            if free_bytes(tmp) < needed:
                raise HpcpipeError(_space_message(root, tmp, step, needed))
    needed = broadcast(world, needed)

    # 2. every writer writes its file (in parallel)
    with together(world, poller, 1, lambda e: _failure(e, f"cannot write checkpoint file {str(path)!r}", root, tmp,
                                                         step, needed), abandon):
        if image is not None:
            write_file_durably(path, image)
    image = None

    # 3. rank 0 commits
    final = run_dir / cf.step_name(step)
    with together(world, poller, 1, lambda e: _failure(e, f"cannot commit checkpoint {str(final)!r}", root, run_dir,
                                                         step, needed), abandon):
        if rank == 0:
            manifest = cf.build_manifest(
                step, n_layers, info.layout, info.config,
                {"name": info.config["train"]["optimizer"], "steps": optimizer.steps, "state": sorted(optimizer.state)},
                {"samples_seen": info.samples_seen, "global_batch": info.global_batch,
                 "shuffle": info.config["data"]["shuffle"], "seed": info.config["data"]["seed"], "order": info.order},
                [e for e in entries if e is not None], run=run_dir.name)
            final = _commit(root, run_dir, tmp, step, manifest, keep)
    return final


@dataclass
class LoadedState:
    """One rank's share of a loaded state."""

    arrays: dict[int, dict[str, np.ndarray]]
    optimizer_attrs: dict[str, Any]
    optimizer: OptimizerArrays | None


def load(world: Comm, poller: Poller, source: WeightsSource, indices: list[int], with_optimizer: bool,
         clean_root: str | Path | None = None, shards: Shards | None = None) -> LoadedState:
    """Read this rank's layers (and optimizer state) from source; all ranks agree before returning.

    Raises AgreedError(code=2) naming the bad file on every rank if any rank failed. With
    clean_root, world rank 0 then removes leftovers of interrupted saves there. ``shards(index, names)``
    (tensor parallelism): each rank reads only its part of every tensor.
    """
    state = None
    with together(world, poller, 2, lambda e: f"cannot load {source.describe()}: {type(e).__name__}: {e}"):
        arrays = source.read(indices, shards)
        attrs, opt = source.read_optimizer(indices, shards) if with_optimizer else ({}, None)
        state = LoadedState(arrays, attrs, opt)
    if clean_root is not None and world.Get_rank() == 0:
        cf.clean_leftovers(clean_root)
    return state
