"""Reading state: weights files and checkpoints by global layer index; ``verify``, ``export``, ``info``.

    python -m hpcpipe.checkpoint verify PATH         # manifest, sizes, SHA-256, shapes, checksums; exit 1 naming the bad file
    python -m hpcpipe.checkpoint export PATH out.h5  # one weights file holding every layer
    python -m hpcpipe.checkpoint info PATH           # runs, step, layout, optimizer, files (or a weights file's layers)

PATH is a checkpoint root (its ``latest`` is followed into the run that
wrote it), a run directory, a ``step-NNNNNNNN`` directory, a ``latest``
pointer file, or (verify, info, export) a single weights file. Nothing here
uses MPI: the collective save and load live in :mod:`hpcpipe.checkpoint_mpi`,
the directory protocol in :mod:`hpcpipe.ckpt_files`, what makes a
checkpoint valid in :mod:`hpcpipe.ckpt_check`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py

from . import ckpt_files as cf
from .ckpt_check import check_stage_file, manifest_specs, read_manifest
from .errors import ConfigError
from .model import LayerSpec
from .weights import (
    LayerArrays,
    OptimizerArrays,
    check_layers,
    check_weights,
    open_checked,
    read_layers,
    read_optimizer,
    stored_layers,
    write_weights,
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
    specs: list[LayerSpec] | None = None  # the model of a checkpoint's manifest
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

    def check(self, specs: list[LayerSpec]) -> None:
        """Raise ConfigError unless layer count, names and shapes match the model (metadata only)."""
        if self.n_layers != len(specs):
            raise ConfigError(f"{self.describe()} holds {self.n_layers} layers but model.dims describes "
                              f"{len(specs)}")
        if self.kind == "file":
            check_weights(self.path, specs)
            return
        for path, indices in self._by_file([s.index for s in specs]).items():
            label = f"checkpoint file {str(path)!r}"
            if not path.is_file():
                raise ConfigError(f"{label} is missing")
            with open_checked(path) as f:
                check_layers(f, [specs[i] for i in indices], label)

    def read(self, indices: list[int]) -> LayerArrays:
        """Return {layer: {'weight', 'bias'}} for the given global layers; ConfigError naming a bad file."""
        out: LayerArrays = {}
        for path, mine in self._by_file(indices).items():
            self._verify(path)
            out.update(read_layers(path, mine))
        return out

    def read_optimizer(self, indices: list[int]) -> tuple[dict[str, Any], OptimizerArrays]:
        """Return (optimizer attributes, per-layer optimizer state) for the given layers (checkpoints only)."""
        if self.kind != "checkpoint":
            raise ConfigError(f"{self.describe()} is a weights file and holds no optimizer state")
        attrs: dict[str, Any] = {}
        out: OptimizerArrays = {}
        for path, mine in self._by_file(indices).items():
            self._verify(path)
            attrs, part = read_optimizer(path, mine)
            out.update(part)
        return attrs, out


def _file_source(path: Path) -> WeightsSource:
    with open_checked(path) as f:
        layers = stored_layers(f)
        n_layers = int(f.attrs.get("n_layers", len(layers)))
        try:
            model = json.loads(f.attrs.get("model", "{}"))
        except json.JSONDecodeError:
            model = {}
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
    """Return the step directory a checkpoint root's `latest` names; ConfigError when there is none."""
    root = Path(root)
    name = cf.read_latest(root)
    if name is None:
        raise ConfigError(f"checkpoint directory {str(root)!r} has no 'latest' pointer (no complete checkpoint)")
    step_dir = root / name
    if not step_dir.is_dir():
        raise ConfigError(f"{str(root / cf.LATEST)!r} names {name!r}, which does not exist")
    return step_dir


def resolve_step_dir(path: str | Path) -> Path:
    """Return the step directory meant by a checkpoint root, a step directory or a `latest` file."""
    p = Path(path)
    if p.is_file() and p.name == cf.LATEST:
        return latest_dir(p.parent)
    if p.is_dir() and (p / cf.MANIFEST).exists():
        return p
    if p.is_dir() and (p / cf.LATEST).exists():
        return latest_dir(p)
    if p.is_dir():
        raise ConfigError(f"{str(p)!r} is neither a checkpoint directory (no {cf.MANIFEST}) nor a checkpoint "
                          f"root (no '{cf.LATEST}' pointer)")
    raise ConfigError(f"checkpoint {str(p)!r} does not exist")


def resolve_weights(path: str | Path) -> WeightsSource:
    """Resolve what a user gave as weights into a source that reads layers by global index.

    ``path`` may be a single HDF5 weights file (``/layers/NNNN/{weight,bias}``),
    a checkpoint root directory (its ``latest`` pointer is followed), a
    ``step-NNNNNNNN`` checkpoint directory, or a ``latest`` pointer file.
    Cheap checks (existence, format, manifest) happen here and raise
    ConfigError naming the path; call ``source.check(specs)`` to compare with
    a model and ``source.read(indices)`` to load (hashes are checked then).
    """
    p = Path(path)
    if not str(path):
        raise ConfigError("no weights path given")
    if p.is_file() and p.name != cf.LATEST:
        if not h5py.is_hdf5(p):
            raise ConfigError(f"weights file {str(p)!r} is not an HDF5 file")
        return _file_source(p)
    return checkpoint_source(resolve_step_dir(p))


def verify(path: str | Path) -> WeightsSource:
    """Fully check one checkpoint or weights file: manifest, sizes, SHA-256, format, layers, shapes, checksums.

    The checks are those every reader runs (:mod:`hpcpipe.ckpt_check`) on every file,
    plus a read of every dataset. Raises ConfigError naming the first bad file.
    """
    p = Path(path)
    if p.is_file() and p.name != cf.LATEST:
        return _verify_weights_file(p)
    source = checkpoint_source(resolve_step_dir(p))
    for entry in source.manifest["files"]:
        path_i = check_stage_file(source.path, entry, source.manifest, source.specs)
        layers = [int(i) for i in entry["layers"]]
        read_layers(path_i, layers)                       # every dataset through its fletcher32 check
        read_optimizer(path_i, layers)
        source._verified.add(path_i)
    return source


def _verify_weights_file(path: Path) -> WeightsSource:
    """Check a single weights file: format, layers 0..n-1 with the shapes its stored model needs, checksums."""
    from .config import from_dict
    from .model import layer_specs
    source = resolve_weights(path)
    label = f"weights file {str(path)!r}"
    if not source.model:
        raise ConfigError(f"{label} records no model config, so its shapes cannot be checked")
    try:
        specs = layer_specs(from_dict({"model": source.model, "parallel": {"pp": 1}}))
    except ConfigError as exc:
        raise ConfigError(f"{label} records an invalid model: {exc}") from None
    check_weights(path, specs)
    read_layers(path, list(range(source.n_layers)))      # every dataset through its fletcher32 check
    with open_checked(path) as f:
        has_optimizer = "optimizer" in f
    if has_optimizer:
        read_optimizer(path, list(range(source.n_layers)))
    return source


def export(path: str | Path, out: str | Path, with_optimizer: bool = False) -> WeightsSource:
    """Write every layer of a checkpoint (or weights file) into one weights file, atomically."""
    source = resolve_weights(path)
    indices = list(range(source.n_layers))
    arrays = source.read(indices)
    optimizer, attrs = None, None
    if with_optimizer and source.kind == "checkpoint":
        attrs, optimizer = source.read_optimizer(indices)
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    write_weights(tmp, arrays, n_layers=source.n_layers, model_config=source.model, step=source.step,
                  optimizer=optimizer, optimizer_attrs=attrs)
    cf.fsync_path(tmp)
    os.replace(tmp, out)
    return source


def _describe_dir(p: Path) -> list[str]:
    """Lines about a root or run directory: where latest points, runs, committed steps, leftovers."""
    kind = "run directory" if cf.is_run_dir(p) else "checkpoint root"
    lines = [f"{kind} {str(p)!r}: latest -> {cf.read_latest(p)}"]
    for d in [p] + cf.run_dirs(p):
        steps = cf.committed_steps(d)
        if d is p and not steps:
            continue
        where = "." if d is p else d.name
        lines.append(f"  {where}: {', '.join(cf.step_name(s) for s in steps) or 'no committed checkpoint'}")
        for extra in cf.leftovers(d):
            lines.append(f"  leftover from an interrupted save (ignored): {where}/{extra.name}")
    return lines


def _describe_weights_file(source: WeightsSource) -> list[str]:
    lines = [(f"weights file {str(source.path)!r} (not a checkpoint directory): step {source.step}, "
              f"{source.n_layers} layers, dims {source.model.get('dims')}")]
    with open_checked(source.path) as f:
        for i in stored_layers(f):
            group = f[f"layers/{i:04d}"]
            shapes = ", ".join(f"{name} {tuple(group[name].shape)}" for name in sorted(group))
            lines.append(f"  layer {i}: {shapes}")
        if "optimizer" in f:
            attrs = dict(f["optimizer"].attrs)
            lines.append(f"  optimizer state of {attrs.get('name')} (update count {attrs.get('steps')})")
    return lines


def info(path: str | Path) -> str:
    """Return a human summary of a checkpoint root, run, one checkpoint or a weights file."""
    p = Path(path)
    if p.is_file() and p.name != cf.LATEST:
        return "\n".join(_describe_weights_file(resolve_weights(p)))
    lines = _describe_dir(p) if p.is_dir() and not (p / cf.MANIFEST).exists() else []
    source = checkpoint_source(resolve_step_dir(p))
    m = source.manifest
    lay, opt, data = m["layout"], m["optimizer"], m.get("data", {})
    model = m["config"]["model"]
    lines.append(f"checkpoint {str(source.path)!r}: step {source.step}, {source.n_layers} layers, "
                 f"dims {model.get('dims')}")
    lines.append(f"  saved at dp={lay.get('dp')} pp={lay.get('pp')} schedule={lay.get('schedule')} "
                 f"virtual_stages={lay.get('virtual_stages')}")
    lines.append(f"  optimizer {opt.get('name')} (update count {opt.get('steps')}, state "
                 f"{', '.join(opt.get('state', [])) or 'none'}); data position {data.get('samples_seen')} samples")
    for e in m["files"]:
        lines.append(f"  {e['name']}: layers {e['layers']}, {e['bytes']} bytes, sha256 {e['sha256'][:16]}...")
    return "\n".join(lines)


def all_checkpoints(root: Path) -> list[Path]:
    """Return every committed checkpoint under a root or run directory (its own and its runs'), oldest run first."""
    return [d / cf.step_name(s) for d in [root] + cf.run_dirs(root) for s in cf.committed_steps(d)]


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m hpcpipe.checkpoint``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m hpcpipe.checkpoint",
                                     description="Verify, export and describe hpcpipe checkpoints and weights "
                                                 "files. PATH: a checkpoint root (checkpoint.dir; its latest is "
                                                 "followed), a run-NNNN or step-NNNNNNNN directory, a latest file, "
                                                 "or a weights file.",
                                     epilog="exit status: 0 ok, 1 the checkpoint is bad (the message names the "
                                            "file), 2 usage error")
    sub = parser.add_subparsers(dest="command", required=True)
    p_verify = sub.add_parser("verify", help="check manifest, sizes, SHA-256, shapes and checksums")
    p_verify.add_argument("dir", metavar="PATH", help="checkpoint root, run or step directory, latest file, "
                                                       "or weights file")
    p_verify.add_argument("--all", action="store_true", help="with a root: verify every committed checkpoint of "
                                                             "every run")
    p_export = sub.add_parser("export", help="write one weights file holding every layer: export PATH OUT")
    p_export.add_argument("dir", metavar="PATH")
    p_export.add_argument("out", metavar="OUT", help="output HDF5 weights file")
    p_export.add_argument("--optimizer", action="store_true", help="also copy the optimizer state")
    p_info = sub.add_parser("info", help="print runs, step, layout, optimizer and files (or a weights file's layers)")
    p_info.add_argument("dir", metavar="PATH")
    args = parser.parse_args(argv)
    try:
        if args.command == "verify":
            root = Path(args.dir)
            targets = all_checkpoints(root) if args.all and root.is_dir() and not (root / cf.MANIFEST).exists() \
                else [root]
            if not targets:
                raise ConfigError(f"{str(root)!r} holds no committed checkpoint")
            for target in targets:
                source = verify(target)
                files = f"{len(source.manifest['files'])} files, " if source.manifest else ""
                print(f"ok: {source.describe()} step {source.step}, {files}{source.n_layers} layers")
        elif args.command == "export":
            source = export(args.dir, args.out, args.optimizer)
            print(f"exported {source.describe()} step {source.step} ({source.n_layers} layers) to {args.out!r}")
        else:
            print(info(args.dir))
    except ConfigError as exc:
        print(f"hpcpipe.checkpoint: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"hpcpipe.checkpoint: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
