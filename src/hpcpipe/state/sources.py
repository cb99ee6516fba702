"""Where a model's layers are stored: one weights file or the files of one checkpoint, read by global layer index.

:func:`resolve_weights` takes whatever a user names (a checkpoint root, whose ``latest`` is
followed into the run that wrote it; a run directory; a ``step-NNNNNNNN`` directory; a
``latest`` pointer file; a single weights file) and returns a :class:`WeightsSource` that reads
any layer whatever layout wrote it, checking each checkpoint file (size, SHA-256, names,
shapes) before its first use. No MPI here: :mod:`hpcpipe.state.collective` decides who reads what.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py

from hpcpipe.errors import ConfigError
from hpcpipe.h5files import broken_symlink
from hpcpipe.state import directory_protocol as cf
from hpcpipe.state.hf_source import HFSource, hf_source, is_hf_directory
from hpcpipe.state.kinds import check_kind, count_text, specs_kind, stored_kind
from hpcpipe.state.manifest import check_stage_file, manifest_specs, read_manifest
from hpcpipe.state.outputs import file_kind
from hpcpipe.state.root_latest import lagging_root
from hpcpipe.state.tokenizer import StoredTokenizer, read_stored
from hpcpipe.state.weights import (
    LayerArrays,
    OptimizerArrays,
    check_layers,
    check_weights,
    open_checked,
    read_layers,
    read_optimizer,
    stored_layers,
)


@dataclass
class WeightsSource:
    """Where each global layer of a model is stored: one weights file or the files of one checkpoint.

    Build it with :func:`resolve_weights`. ``read`` returns layers by global
    index whatever layout wrote them; for a checkpoint each file's size and
    SHA-256 are checked against the manifest before its first use.
    """

    path: Path                         # the file or step directory that was resolved
    kind: str                          # "file" | "checkpoint"
    step: int
    n_layers: int
    model: dict[str, Any]              # the model config stored with the weights ({} when unknown)
    files: dict[int, Path]             # global layer -> file holding it
    manifest: dict[str, Any] | None = None
    specs: list[Any] | None = None     # the model of a checkpoint's manifest
    _verified: set[Path] = field(default_factory=set)

    def _entry(self, path: Path) -> dict[str, Any]:
        return next(e for e in self.manifest["files"] if e["name"] == path.name)

    def _verify(self, path: Path) -> None:
        if self.manifest is not None and path not in self._verified:
            check_stage_file(self.path, self._entry(path), self.manifest, self.specs)
            self._verified.add(path)

    def _by_file(self, indices: list[int]) -> dict[Path, list[int]]:
        missing = [i for i in indices if i not in self.files]
        if missing:
            raise ConfigError(f"{self.describe()} has no layer(s) {missing} (it holds {self.n_layers} layers)")
        out: dict[Path, list[int]] = {}
        for i in indices:
            out.setdefault(self.files[i], []).append(i)
        return out

    def describe(self) -> str:
        """Return a short human label, e.g. "checkpoint '/ck/step-00000006'"."""
        return f"{'checkpoint' if self.kind == 'checkpoint' else 'weights file'} {str(self.path)!r}"

    @property
    def model_kind(self) -> str:
        """The kind of the stored model: "mlp" (also when none is recorded) or "gpt"; ConfigError if unknown."""
        return stored_kind(self.model, self.describe())

    def check(self, specs: list[Any], key: str = "") -> None:
        """Raise ConfigError unless kind, layer count, names and shapes match the model (metadata only).

        ``key`` names what the user set (``model.init``, ``checkpoint.dir``, ``--weights``)
        in the message about a file of the other model kind, which comes first.
        """
        check_kind(self.model, self.n_layers, specs, f"{key} {str(self.path)!r}" if key else self.describe())
        if self.n_layers != len(specs):
            kind = specs_kind(specs)
            raise ConfigError(f"{self.describe()} holds {count_text(kind, self.n_layers)} but "
                              f"{'model.dims' if kind == 'mlp' else 'the model config'} describes {len(specs)}")
        if self.kind == "file":
            check_weights(self.path, specs)
            return
        for path, indices in self._by_file([s.index for s in specs]).items():
            label = f"checkpoint file {str(path)!r}"
            if not path.is_file():
                raise ConfigError(f"{label} is missing")
            with open_checked(path) as f:
                check_layers(f, [specs[i] for i in indices], label)

    def tokenizer(self, verify: bool = True) -> StoredTokenizer | None:
        """Return the tokenizer stored with the weights (attribute, and files for kind hf), None when there is none.

        For a checkpoint it is read from the file holding layer 0 (every stage file
        carries it), after that file's checks unless ``verify`` is False; an invalid
        value is a ConfigError naming the file.
        """
        path = self.files.get(0, self.path)
        if self.kind == "checkpoint" and verify:
            self._verify(path)
        with open_checked(path) as f:
            return read_stored(f, f"{'checkpoint' if self.kind == 'checkpoint' else 'weights'} file {str(path)!r}")

    def read(self, indices: list[int], shards: Any = None) -> LayerArrays:
        """Return {layer: {parameter name: array}} for the given global layers; ConfigError naming a bad file.

        ``shards(index, names)``: only this tensor-parallel rank's part of each tensor (hyperslab reads).
        """
        out: LayerArrays = {}
        for path, mine in self._by_file(indices).items():
            self._verify(path)
            out.update(read_layers(path, mine, shards))
        return out

    def read_optimizer(self, indices: list[int], shards: Any = None) -> tuple[dict[str, Any], OptimizerArrays]:
        """Return (optimizer attributes, per-layer optimizer state) for the given layers (checkpoints only)."""
        if self.kind != "checkpoint":
            raise ConfigError(f"{self.describe()} is a weights file and holds no optimizer state")
        attrs: dict[str, Any] = {}
        out: OptimizerArrays = {}
        for path, mine in self._by_file(indices).items():
            self._verify(path)
            attrs, part = read_optimizer(path, mine, shards)
            out.update(part)
        return attrs, out


def _file_source(path: Path) -> WeightsSource:
    with open_checked(path) as f:
        layers = stored_layers(f)
        n_layers = int(f.attrs.get("n_layers", len(layers)))
        try:
            model = json.loads(f.attrs.get("model", "{}"))
        except (json.JSONDecodeError, TypeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"weights file {str(path)!r}: root attribute model is not JSON text ({exc})") from None
        if not isinstance(model, dict):
            raise ConfigError(f"weights file {str(path)!r}: root attribute model must be a JSON object, "
                              f"got {type(model).__name__}")
        step = int(f.attrs.get("step", 0))
    return WeightsSource(path, "file", step, n_layers, model, {i: path for i in layers})


def checkpoint_source(step_dir: str | Path) -> WeightsSource:
    """Return the source of one committed checkpoint directory (manifest validated, files not yet hashed)."""
    step_dir = Path(step_dir)
    manifest = read_manifest(step_dir)
    files = {int(i): step_dir / e["name"] for e in manifest["files"] for i in e["layers"]}
    specs = manifest_specs(manifest, f"manifest {str(step_dir / cf.MANIFEST)!r}")
    return WeightsSource(step_dir, "checkpoint", int(manifest["step"]), int(manifest["n_layers"]),
                         manifest["config"]["model"], files, manifest, specs)


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
    if p.is_dir():
        raise ConfigError(f"{str(p)!r} is neither a checkpoint directory (no {cf.MANIFEST}), a checkpoint root "
                          f"(no '{cf.LATEST}' pointer) nor a Hugging Face model directory (no config.json)")
    raise ConfigError(f"checkpoint {str(p)!r} does not exist")


def resolve_weights(path: str | Path, key: str = "", hint: str = "") -> WeightsSource | HFSource:
    """Resolve what a user gave as weights into a source that reads layers by global index.

    ``path`` may be a single HDF5 weights file (``/layers/NNNN/{weight,bias}``),
    a checkpoint root directory (its ``latest`` pointer is followed), a
    ``step-NNNNNNNN`` checkpoint directory, a ``latest`` pointer file, or a
    Hugging Face model directory (config.json and safetensors: :class:`HFSource`).
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
        hint = hint or " (give a weights file or a checkpoint directory)"
        raise ConfigError(f"{key} {str(p)!r} does not exist{hint}")
    if p.exists() and not (p.is_file() or p.is_dir()):   # a FIFO was reported as a checkpoint that does not exist
        raise ConfigError(f"{key or 'weights path'} {str(p)!r} is {file_kind(p)}, not a weights file or a checkpoint")
    if p.is_file() and p.name != cf.LATEST:
        if not h5py.is_hdf5(p):
            raise ConfigError(f"weights file {str(p)!r} is not an HDF5 file")
        return _file_source(p)
    if is_hf_directory(p) and not (p / cf.MANIFEST).exists() and not (p / cf.LATEST).exists():
        return hf_source(p)
    return checkpoint_source(resolve_step_dir(p))


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

