"""Training's checks against the machine before the first collective: outputs can be written, the model fits.

Called by :func:`hpcpipe.train.setup.prepare` on every rank (identically), so a
metrics path in a missing directory or a model too large for the node is
refused with one message and exit status 2 before step 0, instead of a
traceback at the first write or a MemoryError after minutes of allocation.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import sys
from pathlib import Path

from hpcpipe.config import Config
from hpcpipe.errors import ConfigError
from hpcpipe.h5files import broken_symlink
from hpcpipe.nn.memory import ITEMSIZE, MemoryEstimate, estimate_rank_bytes, trained_params
from hpcpipe.nn.optim import make_optimizer
from hpcpipe.nn.registry import model_specs
from hpcpipe.runtime.host_memory import rank_share
from hpcpipe.runtime.launcher import launcher_rank, local_rank_count
from hpcpipe.state import directory_protocol as cf
from hpcpipe.state.hdf5_source import HDF5Source
from hpcpipe.state.hf_source import is_hf_directory
from hpcpipe.state.outputs import check_replaceable, check_writable
from hpcpipe.state.root_latest import lagging_root
from hpcpipe.state.run_lock import in_use_error, live_holder
from hpcpipe.state.sources import protected_paths, refuse_overwrite, same_file
from hpcpipe.state.weights import state_shapes
from hpcpipe.state.weights_source import WeightsSource

GIB = 1024 ** 3


def _gib(n: float) -> str:
    return f"{n / GIB:.3g} GiB"


def check_memory(config: Config, stage_ranges: list[range], pp: int, placement: str, world_size: int,
                 available: int | None = None, ranks_here: int | None = None,
                 headroom: int | None = None) -> MemoryEstimate:
    """Raise ConfigError when one rank's estimated need exceeds its share of this node's memory.

    The share is the available memory over the ranks on this node (from the
    launcher's environment; all world_size ranks when it does not say), or less
    when the process's address-space limit (``ulimit -v``) leaves less
    (:func:`hpcpipe.runtime.host_memory.rank_share`; ``available`` and
    ``headroom`` decide instead of measuring). Skipped when the arrays may live
    on a GPU (run.backend cupy, or auto with CuPy installed) or when the memory
    cannot be read.
    """
    dp = max(1, world_size // (pp * config.parallel.tp))
    need = estimate_rank_bytes(config, stage_ranges, pp, placement, dp)
    backend = config.run.backend
    if backend == "cupy" or (backend == "auto" and importlib.util.find_spec("cupy") is not None):
        return need
    ranks_here = ranks_here or local_rank_count(default=world_size)
    share, where = rank_share(ranks_here, available, headroom)
    if share is not None and need.total > share:
        raise ConfigError(
            f"the model needs about {_gib(need.total)} per rank (parameters and gradients "
            f"{_gib(need.parameters)}, optimizer {_gib(need.optimizer)}, activations {_gib(need.activations)}, "
            f"data {_gib(need.data)}) with {config.layers_text()}, parallel.pp = {pp}, "
            f"train.micro_batches x micro_batch_size = {config.train.micro_batches} x "
            f"{config.train.micro_batch_size}; {where}: use more pipeline stages or nodes{_zero_hint(config, dp)}, "
            f"or a smaller {_lora_hint(config)}model or micro-batch")
    return need


def _lora_hint(config: Config) -> str:
    """'train.lora_rank (now R), ' under LoRA: a rank far above the maps' widths is what fills the memory then."""
    rank = config.train.lora_rank
    return f"train.lora_rank (now {rank}), " if rank else ""


def _zero_hint(config: Config, dp: int) -> str:
    """', train.zero = 1 (optimizer state / dp)' where it would shrink the need, else ''."""
    train = config.train
    if dp > 1 and not train.zero and (train.optimizer != "sgd" or train.momentum):
        return f", train.zero = 1 (the optimizer state / {dp})"
    return ""


def check_checkpoint_dir(directory: str, resume: bool) -> None:
    """Raise ConfigError unless checkpoint.dir is, or can be created as, a directory this process can write.

    Checked before step 0 so that a bad directory never costs a run its steps. The
    nearest existing ancestor must be a directory on a writable file system; the
    permission bits are checked only when not root (root passes os.access anyway).
    """
    path = Path(directory)
    broken = broken_symlink(path)
    if broken:   # it would read as missing, and no directory can be made through it
        raise ConfigError(f"checkpoint.dir {directory!r} {broken}")
    if path.exists() and not path.is_dir():
        raise ConfigError(f"checkpoint.dir {directory!r} is a file, not a directory (set checkpoint.dir to a "
                          f"directory, or \"\" to save no checkpoints)")
    _check_is_a_root(path, directory, resume)
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"checkpoint.dir {directory!r} cannot be created: {str(existing)!r} is not a directory")
    try:
        read_only = bool(os.statvfs(existing).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    if read_only or (os.geteuid() != 0 and not os.access(existing, os.W_OK | os.X_OK)):
        why = "is on a read-only file system" if read_only else "is not writable"
        raise ConfigError(f"checkpoint.dir {directory!r} cannot be written: {str(existing)!r} {why} (set "
                          f"checkpoint.dir to a writable directory, or \"\" to save no checkpoints)")


HDF5_BYTES_PER_DATASET = 4096


def check_checkpoint_space(config: Config, n_files: int) -> None:
    """Raise ConfigError when checkpoint.dir's file system cannot hold one checkpoint; warn below keep + 1.

    A checkpoint's size is fixed by the model and the optimizer (parameters and
    state buffers in the model's dtype, in ``n_files`` stage files), so a
    directory too small for one is refused before step 0 instead of after the
    whole run. Rank 0 warns (the caller prints nothing else) when the space is
    short of the checkpoints a run keeps plus the one being written.
    """
    import numpy as np

    from hpcpipe.state.collective import free_bytes, human_bytes, space_needed

    existing = Path(config.checkpoint.dir)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        free = free_bytes(existing)
    except OSError:
        return
    specs = model_specs(config)
    buffers = len(make_optimizer(config.train, np, 0, np.float32).state)
    # the parameters, and each optimizer state buffer of the trained ones (LoRA: the adapters), as datasets
    data = sum(spec.n_params + buffers * trained_params(spec) for spec in specs) * ITEMSIZE[config.model.dtype]
    # HDF5's own bytes: measured 4.1-5.4 KiB per dataset (object header, B-tree, groups), the lower end taken
    datasets = sum(len(spec.shapes) + buffers * len(state_shapes(spec)) for spec in specs)
    one = space_needed([(data + HDF5_BYTES_PER_DATASET * datasets) // n_files] * n_files)
    where = f"checkpoint.dir {config.checkpoint.dir!r}"
    if free < one:
        raise ConfigError(f"{where} has {human_bytes(free)} free, a checkpoint of this model and optimizer needs "
                          f"about {human_bytes(one)}; nothing was trained (free some space, set checkpoint.dir "
                          f"elsewhere, or \"\" to save no checkpoints)")
    keep = max(config.checkpoint.keep, 1) + 1
    if free < keep * one and launcher_rank() == 0:
        print(f"hpcpipe: warning: {where} has {human_bytes(free)} free; keeping checkpoint.keep = "
              f"{config.checkpoint.keep} checkpoints of about {human_bytes(one)} while the next is written needs "
              f"about {human_bytes(keep * one)}: a later save may not fit", file=sys.stderr, flush=True)


def _check_is_a_root(path: Path, directory: str, resume: bool) -> None:
    """checkpoint.dir must be a root of runs (or, with --resume, a run): never a step, never another run's inside."""
    if not path.is_dir():
        return
    if (path / cf.MANIFEST).exists() or cf.step_of_dir_name(path.name) is not None:
        raise ConfigError(f"checkpoint.dir {directory!r} is a checkpoint step directory; saving there would write "
                          f"into a committed checkpoint: set checkpoint.dir to its root ({str(path.parent.parent)!r} "
                          f"or {str(path.parent)!r})")
    if not resume and cf.is_run_dir(path) and (path.parent / cf.LATEST).exists():
        raise ConfigError(f"checkpoint.dir {directory!r} is a run directory of {str(path.parent)!r}; a fresh run "
                          f"writes a new run-NNNN under the root: set checkpoint.dir = {str(path.parent)!r}, or "
                          f"add --resume to continue this run")
    if not resume and is_hf_directory(path):
        raise ConfigError(f"checkpoint.dir {directory!r} is a Hugging Face model directory (config.json): a run's "
                          f"latest pointer there would make every reader (model.init, --weights, checkpoint) take it "
                          f"for a checkpoint root instead of the model; set checkpoint.dir to another directory")
    pointer = path / cf.LATEST
    if (pointer.exists() or pointer.is_symlink()) and not pointer.is_file():
        raise ConfigError(f"checkpoint.dir {directory!r}: {str(pointer)!r} is not a file (the root's checkpoint "
                          f"pointer); move it away or set another checkpoint.dir")
    if not resume:
        _refuse_old_layout(path, directory)


def _refuse_old_layout(path: Path, directory: str) -> None:
    """A fresh run must not take the pointer of a root written before run directories (its steps in the root).

    Its first save would point ROOT/latest at the fresh run's checkpoint, and nothing
    would name the old run's any more: --resume could never continue it. A `latest` that
    is no checkpoint pointer at all (someone else's file) is refused too: the save would replace it.
    """
    try:
        name = cf.read_latest(path)
    except ConfigError as exc:   # not a pointer hpcpipe wrote: its first save would replace the file
        raise ConfigError(f"checkpoint.dir {directory!r}: {exc}; a fresh run's first save would replace that file: "
                          f"move it away or set another checkpoint.dir") from None
    if name is not None and "/" not in name:
        raise ConfigError(f"checkpoint.dir {directory!r} holds a run saved before run directories existed (its "
                          f"latest names {name}, in the root itself): a fresh run would point that latest at its own "
                          f"checkpoints and --resume could no longer continue the old run; continue it with --resume, "
                          f"or set checkpoint.dir to another directory for a fresh run")


def check_nothing_newer(source: HDF5Source) -> None:
    """Raise ConfigError when a live run holds the resumed checkpoint's run, or it holds a later step.

    The live run is named first, before anything else is checked: while it
    writes, the newest step, ``latest`` and the pruned steps change under
    this job's feet, and any other message (such as "continue the newest")
    would be wrong advice. The trainer takes the lock itself later; this only
    probes it, on every rank. A root ``latest`` that lagged behind the resumed
    run's own (and was therefore passed over) is said in one warning line (rank 0).
    """
    run_dir = Path(source.path).parent
    holder = live_holder(run_dir)
    if holder is not None:
        raise in_use_error(run_dir, holder)
    newer = [s for s in cf.committed_steps(run_dir) if s > source.step]
    if newer:
        raise ConfigError(f"cannot resume from {source.describe()}: its run directory {str(run_dir)!r} already "
                          f"holds {cf.step_name(max(newer))}, which resuming from step {source.step} would "
                          f"overwrite; {_how_to_continue(run_dir, max(newer))}")
    lag = lagging_root(run_dir.parent) if cf.is_run_dir(run_dir) else None
    if lag is not None and lag.newer == f"{run_dir.name}/{Path(source.path).name}" and launcher_rank() == 0:
        pointer = str(lag.root / cf.LATEST)
        print(f"hpcpipe: warning: {pointer!r} names {lag.named}, behind {run_dir.name}'s own latest (a save "
              f"committed {lag.newer} but could not move the root's pointer); resuming {lag.newer}, whose run's "
              f"next save moves {pointer!r} forward", file=sys.stderr, flush=True)


def _how_to_continue(run_dir: Path, newest: int) -> str:
    """The advice that ends the refusal above: the exact --set when the run's pointer names its newest step."""
    try:
        own = cf.read_latest(run_dir)
    except ConfigError:
        own = None
    if own == cf.step_name(newest):   # the root's pointer lags (and another run is newer): name the run itself
        value = shlex.quote(f"checkpoint.dir={json.dumps(str(run_dir))}")
        return f"to continue {cf.step_name(newest)}, run the same command with --resume --set {value}"
    pointer = run_dir / cf.LATEST
    named = f"names {own} (moved back by hand?)" if own else "names no checkpoint"
    return (f"{str(pointer)!r} {named}: to continue {cf.step_name(newest)}, write that name into it and --resume "
            f"again; to continue the older step, first move the later steps out of {str(run_dir)!r}")


def check_log_files(config: Config, init: WeightsSource | None, resume: HDF5Source | None) -> None:
    """Raise ConfigError unless log.metrics and log.trace can be written without touching what the run reads."""
    files: list[tuple[str, Path]] = []
    dirs: list[tuple[str, Path]] = []
    if config.data.path:
        files.append((f"the data file data.path {config.data.path!r}", Path(config.data.path)))
    if config.data.eval_path:
        files.append((f"the held-out file data.eval_path {config.data.eval_path!r}", Path(config.data.eval_path)))
    for source, given in ((init, config.model.init), (resume, config.checkpoint.dir)):
        if source is not None:
            more_files, more_dirs = protected_paths(given, source)
            files += more_files
            dirs += more_dirs
    metrics, trace = config.log.metrics, config.log.trace
    if metrics and trace and (os.path.realpath(metrics) == os.path.realpath(trace) or same_file(metrics, trace)):
        raise ConfigError(f"log.metrics and log.trace are the same file {metrics!r}; give each its own")
    for key, path in (("metrics", metrics), ("trace", trace)):
        if path:
            check_writable(path, f"log.{key}", append=True)
            refuse_overwrite(path, tuple(files), tuple(dirs), f"log.{key}")
    if metrics:
        check_metrics_file(metrics)
    if trace:   # the trace is written whole at the end, replacing the file: only an earlier trace may be there
        check_replaceable(trace, "trace", "log.trace")
    for key, path in (("metrics", metrics), ("trace", trace)):
        if path:    # last (a refused path's folder stays untouched): as root /proc passes the permission bits,
            # and log.metrics = "/proc/x" was a FileNotFoundError traceback, log.trace a warning after training
            check_writable(path, f"log.{key}", probe=True)


def check_metrics_file(path: str) -> None:
    """Raise ConfigError when log.metrics names an existing file that is not a JSON-lines metrics file.

    Metrics are appended, so a run continues its own file; appending to
    anything else (weights, a config, someone's notes) would change a file the
    run did not create.
    """
    p = Path(path)
    if p.is_symlink():   # appending would follow it into a file the run never named
        raise ConfigError(f"log.metrics {path!r} is a symbolic link; name the metrics file itself")
    if not p.exists():
        return
    if not p.is_file():   # a FIFO would block the open for ever, a device is no metrics file
        raise ConfigError(f"log.metrics {path!r} exists and is not a regular file; give a new path")
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
    except OSError as exc:
        raise ConfigError(f"log.metrics {path!r} cannot be read: {exc.strerror or exc}") from None
    first = head.split(b"\n", 1)[0].strip()
    if not head.strip():   # nothing to lose (a run that stopped before its first record leaves this)
        return
    try:
        record = json.loads(first)
    except ValueError:
        record = None
    # a training record, not just any JSON object (a package.json, a JSON-lines dataset, a report)
    if not isinstance(record, dict) or not {"step", "loss"} <= record.keys():
        raise ConfigError(f"log.metrics {path!r} exists and is not a metrics file (JSON lines): metrics are "
                          f"appended, so give a new path or an earlier run's metrics file")
