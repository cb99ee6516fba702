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

import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import ckpt_files as cf
from .checkpoint import WeightsSource
from .comm import Poller, agree, gather_to_root
from .errors import AgreedError, ConfigError
from .weights import OptimizerArrays, write_weights


def _crash_hook(point: str, step: int, world_rank: int) -> None:
    """Kill this process (SIGKILL) when HPCPIPE_CRASH_IN_SAVE names this point, step and rank."""
    spec = os.environ.get("HPCPIPE_CRASH_IN_SAVE", "")
    if not spec:
        return
    fields = dict(item.split("=", 1) for item in spec.split(",") if "=" in item)
    if (fields.get("point", "write") == point and int(fields.get("step", -1)) == step
            and int(fields.get("rank", 0)) == world_rank):
        os.kill(os.getpid(), signal.SIGKILL)


def _agreed(world: Any, poller: Poller, error: str | None, code: int) -> None:
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


def save(world: Any, poller: Poller, root: str | Path, step: int, *, dp_rank: int, pp_rank: int,
         params: Any, optimizer: Any, n_layers: int, info: SaveInfo, keep: int) -> Path:
    """Save a checkpoint of `step` completed steps (collective over world); return its directory.

    Any failure on any rank (disk full, permissions) raises AgreedError(code=1) on every rank.
    """
    rank = world.Get_rank()
    root = Path(root)
    tmp = root / cf.tmp_name(step)
    error = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            cf.clean_leftovers(root)
            tmp.mkdir()
        except OSError as exc:
            error = f"cannot create checkpoint directory {str(tmp)!r}: {exc}"
    _agreed(world, poller, error, 1)

    entry, error = None, None
    if dp_rank == 0:
        path = tmp / cf.stage_file(pp_rank)
        try:
            opt = optimizer_arrays(params, optimizer)
            write_weights(path, params.export(), n_layers=n_layers, model_config=info.config["model"], step=step,
                          optimizer=opt, optimizer_attrs={"name": info.config["train"]["optimizer"],
                                                          "steps": optimizer.steps},
                          attrs={"pp_rank": pp_rank}, after_layers=lambda: _crash_hook("write", step, rank))
            cf.fsync_path(path)
            entry = {"name": path.name, "pp_rank": pp_rank, "layers": params.layer_indices(),
                     "bytes": path.stat().st_size, "sha256": cf.sha256_file(path)}
        except Exception as exc:  # noqa: BLE001 - any failure must be agreed on, not hang the others
            error = f"cannot write checkpoint file {str(path)!r}: {type(exc).__name__}: {exc}"
    _agreed(world, poller, error, 1)

    entries = gather_to_root(world, entry)
    final, error = root / cf.step_name(step), None
    if rank == 0:
        try:
            manifest = cf.build_manifest(
                step, n_layers, info.layout, info.config,
                {"name": info.config["train"]["optimizer"], "steps": optimizer.steps, "state": sorted(optimizer.state)},
                {"samples_seen": info.samples_seen, "global_batch": info.global_batch,
                 "shuffle": info.config["data"]["shuffle"], "seed": info.config["data"]["seed"]},
                [e for e in entries if e is not None])
            cf.write_json_durably(tmp / cf.MANIFEST, manifest)
            _crash_hook("commit", step, rank)
            final = cf.commit(root, tmp, step)
            cf.set_latest(root, final.name)
            cf.prune(root, keep)
        except Exception as exc:  # noqa: BLE001
            error = f"cannot commit checkpoint {str(final)!r}: {type(exc).__name__}: {exc}"
    _agreed(world, poller, error, 1)
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
