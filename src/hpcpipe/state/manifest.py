"""What makes a checkpoint valid: its manifest, and each file against the manifest.

One set of checks for every reader, so they cannot drift: ``python -m
hpcpipe.checkpoint verify``, ``--resume``, ``model.init``, ``infer
--weights`` and ``evaluate`` all read a checkpoint through
:func:`read_manifest` (structure, the directory's name and files) and
:func:`check_stage_file` (size, SHA-256, step, layers, shapes, optimizer
state of one file before its first use). ``verify`` adds only a read of
every dataset through its fletcher32 checksum. Every problem is a
ConfigError naming the file.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from hpcpipe.errors import ConfigError
from hpcpipe.h5files import broken_symlink, member
from hpcpipe.hf.json_text import JSONTextError, loads
from hpcpipe.state import directory_protocol as cf
from hpcpipe.state.kinds import config_specs, count_text, specs_kind
from hpcpipe.state.weights import (
    check_group,
    check_layers,
    open_checked,
    optimizer_group,
    state_names,
    state_shapes,
    stored_layers,
    version_problem,
)

_STAGE_RE = re.compile(r"^stage-(\d{3,})\.h5$")
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
_OPTIMIZERS = ("sgd", "adam", "adamw")


class _Malformed(Exception):
    """A manifest field has the wrong type or value (turned into one ConfigError naming the manifest)."""


def _int(value: Any, what: str, low: int = 0, high: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        bound = f"an integer >= {low}" if high is None else f"an integer in {low}..{high}"
        raise _Malformed(f"{what} is {value!r}, expected {bound}")
    return value


def _dict(manifest: dict[str, Any], key: str) -> dict[str, Any]:
    value = manifest.get(key)
    if not isinstance(value, dict):
        raise _Malformed(f"{key!r} is {type(value).__name__}, expected an object")
    return value


def _check_files(manifest: dict[str, Any], n_layers: int) -> None:
    files = manifest.get("files")
    if not isinstance(files, list) or not 1 <= len(files) <= n_layers:
        count = len(files) if isinstance(files, list) else type(files).__name__
        raise _Malformed(f"'files' has {count} entries, expected 1..{n_layers} (one per stage file, each "
                         f"holding at least one of the {n_layers} layers)")
    names = set()
    for entry in files:
        if not isinstance(entry, dict):
            raise _Malformed(f"a file entry is {type(entry).__name__}, expected an object")
        name = entry.get("name")
        match = _STAGE_RE.match(name) if isinstance(name, str) else None
        if not match:
            raise _Malformed(f"bad file name {name!r} (expected stage-PPP.h5)")
        if name in names:
            raise _Malformed(f"file {name!r} is listed twice")
        names.add(name)
        if _int(entry.get("pp_rank"), f"{name} pp_rank") != int(match.group(1)):
            raise _Malformed(f"{name} has pp_rank {entry['pp_rank']}")
        layers = entry.get("layers")
        if not isinstance(layers, list) or not layers:
            raise _Malformed(f"{name} layers is {layers!r}, expected a non-empty list")
        for i in layers:
            _int(i, f"{name} layer", 0, n_layers - 1)
        _int(entry.get("bytes"), f"{name} bytes")
        if not isinstance(entry.get("sha256"), str) or not _SHA_RE.match(entry["sha256"]):
            raise _Malformed(f"{name} sha256 is {str(entry.get('sha256'))[:70]!r}, expected 64 hex digits")


def manifest_specs(manifest: dict[str, Any], label: str) -> list[Any]:
    """Return the specs (one per layer group) of the model a manifest's config describes; ConfigError when invalid."""
    try:
        return config_specs(manifest["config"])
    except ConfigError as exc:
        raise ConfigError(f"{label} holds an invalid config: {exc}") from None


def validate_manifest(manifest: Any, step_dir: Path, label: str) -> list[Any]:
    """Check a parsed manifest's structure, its agreement with the directory it is in, and its files' presence.

    Returns the model's layer specs. The single check every reader of a checkpoint runs.
    """
    if not isinstance(manifest, dict) or manifest.get("format") != cf.MANIFEST_FORMAT:
        raise ConfigError(f"{label} is not an hpcpipe checkpoint manifest")
    problem = version_problem(manifest.get("format_version"), current=cf.MANIFEST_VERSION)
    if problem:
        raise ConfigError(f"{label} {problem}")
    try:
        step = _int(manifest.get("step"), "step")
        n_layers = _int(manifest.get("n_layers"), "n_layers", 1)
        _dict(manifest, "layout")
        if not isinstance(_dict(manifest, "config").get("model"), dict):
            raise _Malformed("config has no model section")
        opt = _dict(manifest, "optimizer")
        if opt.get("name") not in _OPTIMIZERS:
            raise _Malformed(f"optimizer name is {opt.get('name')!r}, expected one of {', '.join(_OPTIMIZERS)}")
        _int(opt.get("steps"), "optimizer steps (update count)", 0, step)
        state = opt.get("state", [])
        if not isinstance(state, list) or not all(isinstance(s, str) for s in state):
            raise _Malformed(f"optimizer state is {state!r}, expected a list of names")
        data = _dict(manifest, "data")
        _int(data.get("samples_seen"), "data samples_seen")
        _check_files(manifest, n_layers)
    except _Malformed as exc:
        raise ConfigError(f"{label} is malformed: {exc}") from None
    seen = sorted(int(i) for e in manifest["files"] for i in e["layers"])
    if seen != list(range(n_layers)):
        raise ConfigError(f"{label} maps layers {seen[:20]} to files; expected each of 0..{n_layers - 1} exactly once")
    named = cf.step_of_dir_name(step_dir.name)
    if named is not None and not named[1]:
        raise ConfigError(f"{str(step_dir)!r} is an interrupted save, not a committed checkpoint")
    if named is not None and named[0] != step:
        raise ConfigError(f"checkpoint directory {str(step_dir)!r} is named for step {named[0]} but its manifest "
                          f"says step {step} (renamed or copied over?)")
    specs = manifest_specs(manifest, label)
    if len(specs) != n_layers:
        kind = specs_kind(specs)
        model = "model config" if kind == "gpt" else "model.dims"
        raise ConfigError(f"{label}: n_layers {n_layers} disagrees with its {model} ({count_text(kind, len(specs))})")
    listed = {e["name"] for e in manifest["files"]}
    for name in sorted(listed):
        if not (step_dir / name).is_file():
            why = broken_symlink(step_dir / name) or "is missing"
            raise ConfigError(f"checkpoint file {str(step_dir / name)!r} {why}")
    extra = sorted(c.name for c in step_dir.iterdir() if _STAGE_RE.match(c.name) and c.name not in listed)
    if extra:
        raise ConfigError(f"checkpoint directory {str(step_dir)!r} holds {extra[:5]}, which its manifest does "
                          f"not list (foreign files?)")
    return specs


def read_manifest(step_dir: str | Path) -> dict[str, Any]:
    """Read and validate a checkpoint's manifest (see :func:`validate_manifest`); ConfigError naming the file."""
    step_dir = Path(step_dir)
    path = step_dir / cf.MANIFEST
    if not path.is_file():
        raise ConfigError(f"checkpoint {str(step_dir)!r} has no {cf.MANIFEST} (incomplete or not a checkpoint)")
    try:
        manifest = loads(cf.read_regular(path, cf.MANIFEST_BYTES, "manifest"))
    except JSONTextError as exc:
        raise ConfigError(f"manifest {str(path)!r} {exc}") from None
    validate_manifest(manifest, step_dir, f"manifest {str(path)!r}")
    return manifest


def check_stage_file(step_dir: Path, entry: dict[str, Any], manifest: dict[str, Any],
                     specs: list[Any]) -> Path:
    """Check one stage file against its manifest entry: size, SHA-256, step, layers, shapes, optimizer state."""
    path = cf.check_file(step_dir, entry)
    label = f"checkpoint file {str(path)!r}"
    layers = sorted(int(i) for i in entry["layers"])
    states = sorted(manifest["optimizer"].get("state", []))
    with open_checked(path) as f:
        if int(f.attrs.get("step", -1)) != int(manifest["step"]):
            raise ConfigError(f"{label} is from step {f.attrs.get('step')}, the manifest says {manifest['step']}")
        if stored_layers(f) != layers:
            raise ConfigError(f"{label} holds layers {stored_layers(f)}, the manifest says {entry['layers']}")
        check_layers(f, [specs[i] for i in layers], label)
        for i in layers:
            group = optimizer_group(i)
            found = state_names(f, group, label)
            if found != states:
                raise ConfigError(f"{label}: layer {i} has optimizer state {found}, the manifest says {states}")
            for state in states:   # each state mirrors the parameters: same (nested) names and shapes
                name = f"{group}/{state}"
                check_group(member(f, name, label), name, i, state_shapes(specs[i]), label,
                            what=f"the {state} state of layer")
    return path
