"""Resolving what a user names as weights into a source of layers, and what writing must never touch.

:func:`resolve_weights` takes whatever a user names (a checkpoint root, whose ``latest`` is
followed into the run that wrote it; a run directory; a ``step-NNNNNNNN`` directory; a
``latest`` pointer file; a single weights file; a Hugging Face model directory) and returns a
:class:`hpcpipe.state.weights_source.WeightsSource` that reads any layer whatever layout wrote it.
:func:`protected_paths` and :func:`refuse_overwrite` keep a run's outputs off the weights it reads.
No MPI here: :mod:`hpcpipe.state.collective` decides who reads what.
"""

from __future__ import annotations

import os
from pathlib import Path

from hpcpipe.errors import ConfigError
from hpcpipe.h5files import broken_symlink
from hpcpipe.hf.config import refuse_adapter_directory
from hpcpipe.lazy_h5py import h5py
from hpcpipe.state import directory_protocol as cf
from hpcpipe.state.hdf5_source import checkpoint_source, file_source
from hpcpipe.state.hf_source import hf_source, is_hf_directory
from hpcpipe.state.outputs import file_kind
from hpcpipe.state.root_latest import lagging_root
from hpcpipe.state.weights_source import WeightsSource


def latest_dir(root: str | Path) -> Path:
    """Return the step directory a checkpoint root's `latest` names; ConfigError when there is none.

    When the root's pointer lags behind the run it names (a save that could not move it:
    :func:`hpcpipe.state.root_latest.lagging_root`), the run's newer checkpoint is taken.
    """
    root = Path(root)
    name = cf.read_latest(root)
    if name is None:
        raise ConfigError(f"checkpoint directory {str(root)!r} has no 'latest' pointer (no complete checkpoint)")
    lag = lagging_root(root)
    if lag is not None and lag.named == name:
        name = lag.newer
    step_dir = root / name
    if not step_dir.is_dir():
        raise ConfigError(f"{str(root / cf.LATEST)!r} names {name!r}, which does not exist")
    return step_dir


def resolve_step_dir(path: str | Path) -> Path:
    """Return the step directory meant by a checkpoint root, a step directory or a `latest` file."""
    p = Path(path)
    # a dangling or looping `latest` symlink is still the pointer: reading it names what is wrong with it
    if p.name == cf.LATEST and (p.is_file() or p.is_symlink()):
        return latest_dir(p.parent)
    if p.is_dir() and (p / cf.MANIFEST).exists():
        return p
    if p.is_dir() and ((p / cf.LATEST).exists() or (p / cf.LATEST).is_symlink()):
        return latest_dir(p)
    broken = broken_symlink(p)
    if broken:
        raise ConfigError(f"checkpoint {str(p)!r} {broken}")
    refuse_adapter_directory(p)
    if p.is_dir():
        raise ConfigError(f"{str(p)!r} is neither a checkpoint directory (no {cf.MANIFEST}), a checkpoint root "
                          f"(no '{cf.LATEST}' pointer) nor a Hugging Face model directory (no config.json)")
    if p.exists() and not p.is_file():   # a named pipe, a socket, a device (it used to "not exist")
        raise ConfigError(f"checkpoint {str(p)!r} is {file_kind(p)}, not a checkpoint directory or a weights file")
    raise ConfigError(f"checkpoint {str(p)!r} does not exist")


def resolve_weights(path: str | Path, key: str = "", hint: str = "") -> WeightsSource:
    """Resolve what a user gave as weights into a source that reads layers by global index.

    ``path`` may be a single HDF5 weights file (``/layers/NNNN/{weight,bias}``),
    a checkpoint root directory (its ``latest`` pointer is followed), a
    ``step-NNNNNNNN`` checkpoint directory, a ``latest`` pointer file, or a
    Hugging Face model directory (config.json and safetensors: :class:`hpcpipe.state.hf_source.HFSource`).
    Cheap checks (existence, format, manifest) happen here and raise
    ConfigError naming the path; call ``source.check(specs)`` to compare with
    a model and ``source.read(indices)`` to load (hashes are checked then).
    ``key`` names the setting the path came from (``model.init``,
    ``--weights``) in the message about a path that does not exist, which
    ends with ``hint`` when given.
    """
    p = Path(path)
    if not str(path):
        raise ConfigError("no weights path given")
    broken = broken_symlink(p) if p.name != cf.LATEST else None   # a broken `latest` is named as the pointer
    if broken:   # it would read as a path that does not exist
        raise ConfigError(f"{key or 'weights path'} {str(p)!r} {broken}")
    if key and not os.path.lexists(p):
        hint = hint or " (give a weights file, a checkpoint directory or a Hugging Face model directory)"
        raise ConfigError(f"{key} {str(p)!r} does not exist{hint}")
    if p.exists() and not (p.is_file() or p.is_dir()):   # a FIFO was reported as a checkpoint that does not exist
        raise ConfigError(f"{key or 'weights path'} {str(p)!r} is {file_kind(p)}, not a weights file or a checkpoint")
    if p.is_file() and p.name != cf.LATEST:
        if not h5py.is_hdf5(p):
            raise ConfigError(f"{key or 'weights file'} {str(p)!r} is not an HDF5 weights file{_hf_file_hint(p)}")
        return file_source(p)
    if is_hf_directory(p) and not (p / cf.MANIFEST).exists() and not (p / cf.LATEST).exists():
        return hf_source(p)
    refuse_adapter_directory(p, key)
    if key and p.is_dir() and not (p / cf.MANIFEST).exists() and not os.path.lexists(p / cf.LATEST):
        raise ConfigError(f"{key} {str(p)!r} is neither a checkpoint directory (no {cf.MANIFEST}), a checkpoint "
                          f"root (no '{cf.LATEST}' pointer) nor a Hugging Face model directory (no config.json)"
                          f"{hint}")
    return checkpoint_source(resolve_step_dir(p))


def _hf_file_hint(p: Path) -> str:
    """For a file inside a Hugging Face model directory (its config.json, a safetensors shard) or a checkpoint's
    step directory (its manifest.json): name the directory to give instead."""
    if (p.parent / cf.MANIFEST).is_file():
        return (f"; it is a file of the checkpoint step directory {str(p.parent)!r}: give the directory itself, "
                f"which is read whole (its manifest and stage files)")
    if not is_hf_directory(p.parent):
        return ""
    return (f"; it is a file of the Hugging Face model directory {str(p.parent)!r}: give the directory itself "
            f"({str(p.parent)!r}), which is read whole (config.json, safetensors, tokenizer)")


Protected = tuple[tuple[str, Path], ...]   # (label, path): "the weights file 'w.h5'", Path("w.h5")


def protected_paths(given: str | Path, source: WeightsSource) -> tuple[Protected, Protected]:
    """Return (files, directories) nothing may be written into: the weights file, or the checkpoint's files and dirs.

    ``given`` is the path the user named (a checkpoint root, a run or step
    directory, a ``latest`` pointer). For a checkpoint, its step directory, the
    run directory holding it and that run's root are all protected, whichever
    of them was named, and so is each of its stage files wherever it really is
    (a symlink's target, another name of a hard link).
    """
    if source.kind == "file":
        return ((f"the weights file {str(source.path)!r}", Path(source.path)),), ()
    if source.kind == "hf":
        return (), ((f"the Hugging Face model directory {str(source.path)!r}", Path(source.path)),)
    given = Path(given)
    step_dir = Path(source.path)
    dirs = [given.parent if given.is_file() else given, step_dir, step_dir.parent]   # a `latest` file: its root
    if cf.is_run_dir(step_dir.parent) and (step_dir.parent.parent / cf.LATEST).is_file():
        dirs.append(step_dir.parent.parent)
    unique: dict[str, Path] = {}
    for d in dirs:
        unique.setdefault(os.path.realpath(d), d)
    # its files too: a stage file may be a symlink to, or a hard link of, a file outside these directories
    files = tuple((f"a file of the checkpoint (its stage file {str(f)!r})", Path(f))
                  for f in sorted(set(source.files.values())))
    return files, tuple((f"the checkpoint directory {str(d)!r} that holds the weights", d) for d in unique.values())


def same_file(a: Path, b: Path) -> bool:
    """True when both exist and are one file (symlinks followed, hard links included: same device and inode)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def inside(path: Path, directory: Path) -> bool:
    """True when path, with symlinks resolved, is directory itself or lies under it."""
    real, top = Path(os.path.realpath(path)), Path(os.path.realpath(directory))
    return real == top or top in real.parents


def refuse_overwrite(path: str | Path, files: Protected, dirs: Protected, what: str) -> None:
    """Raise ConfigError when writing path would replace one of ``files`` or land inside one of ``dirs``."""
    p = Path(path)
    for label, directory in dirs:
        if inside(p, directory):
            raise ConfigError(f"{what} {str(p)!r} is inside {label}; choose a path outside it")
    for label, other in files:
        if same_file(p, other) or os.path.realpath(p) == os.path.realpath(other):
            raise ConfigError(f"{what} {str(p)!r} is {label}; writing there would destroy it")
    state = checkpoint_member(p)
    if state:
        raise ConfigError(f"{what} {str(p)!r} is {state}; writing there would destroy it")


def checkpoint_member(path: Path) -> str:
    """Describe path when it is part of any checkpoint (a file of a step directory, a ``latest`` pointer), else ''."""
    parent = path.parent
    if (parent / cf.MANIFEST).is_file():
        return f"inside the checkpoint directory {str(parent)!r}"
    if path.name == cf.LATEST and (path.exists() or path.is_symlink()):
        try:
            if cf.read_latest(parent) is not None:
                return f"the checkpoint pointer of {str(parent)!r}"
        except ConfigError:
            pass
    return ""

