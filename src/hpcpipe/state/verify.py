"""``checkpoint verify``: every check a reader runs, plus a read of every dataset, on a checkpoint, a weights file
(one stage's file of a checkpoint included) or a Hugging Face model directory."""

from __future__ import annotations

import os
from pathlib import Path

from hpcpipe.config import from_dict
from hpcpipe.errors import ConfigError
from hpcpipe.h5files import member
from hpcpipe.nn.registry import model_def
from hpcpipe.state import directory_protocol as cf
from hpcpipe.state.hdf5_source import checkpoint_source
from hpcpipe.state.hf_source import hf_source, is_hf_directory
from hpcpipe.state.kinds import stored_specs
from hpcpipe.state.sources import resolve_step_dir, resolve_weights
from hpcpipe.state.tokenizer import check_vocabulary
from hpcpipe.state.weights import check_layers, check_weights, open_checked, read_layers, read_optimizer
from hpcpipe.state.weights_source import WeightsSource


def verify(path: str | Path) -> WeightsSource:
    """Fully check one checkpoint or weights file: manifest, sizes, SHA-256, format, layers, shapes, checksums.

    The checks are those every reader runs (:mod:`hpcpipe.state.manifest`) on every file,
    plus a read of every dataset. Raises ConfigError naming the first bad file.
    """
    p = Path(path)
    if p.is_file() and p.name != cf.LATEST:
        return _verify_weights_file(p)
    if hf_directory(p):
        return _verify_hf(p)
    source = checkpoint_source(resolve_step_dir(p))
    for entry in source.manifest["files"]:
        path_i = source.path / entry["name"]
        source.verify_file(path_i)
        layers = [int(i) for i in entry["layers"]]
        read_layers(path_i, layers)                       # every dataset through its fletcher32 check
        read_optimizer(path_i, layers)
    return source


def _verify_weights_file(path: Path) -> WeightsSource:
    """Check a single weights file: format, layers 0..n-1 with the shapes its stored model needs, checksums; one
    stage's file of a checkpoint against its step's manifest (size, SHA-256, its layers), then its datasets."""
    source = resolve_weights(path)
    label = f"weights file {str(path)!r}"
    if not source.model:
        raise ConfigError(f"{label} records no model config, so its shapes cannot be checked")
    held, specs = sorted(source.files), stored_specs(source.model, label)
    if not source.is_partial():
        check_weights(path, specs)
    elif source.is_stage_file():                         # one stage's file: what its step's manifest says of it
        step = checkpoint_source(path.parent)
        if not any(entry["name"] == path.name for entry in step.manifest["files"]):
            raise ConfigError(f"{label} holds only {source.partial()}, but that step's {cf.MANIFEST} does not list "
                              f"it (a stage file copied there?): verify the step directory {str(path.parent)!r}, "
                              f"or move the file out of it to check it alone")
        step.verify_file(path.parent / path.name)
    else:                                                # some layers only: those, with their shapes
        with open_checked(path) as f:
            check_layers(f, [s for s in specs if s.index in held], label)
    source.tokenizer()                                   # valid when present
    read_layers(path, held)                              # every dataset through its fletcher32 check
    with open_checked(path) as f:
        has_optimizer = member(f, "optimizer", label) is not None
    if has_optimizer:
        read_optimizer(path, held)
    return source


def hf_directory(p: Path) -> bool:
    """A Hugging Face model directory (config.json), not a checkpoint that happens to hold one."""
    return is_hf_directory(p) and not (p / cf.MANIFEST).exists() and not os.path.lexists(p / cf.LATEST)


def _verify_hf(path: Path) -> WeightsSource:
    """Check a Hugging Face model directory as generate would read it: config.json, tokenizer, every tensor's name,
    shape and values (finite), a layer group at a time."""
    source = hf_source(path)
    config = from_dict({"model": source.model, "parallel": {"pp": 1}})
    source.check(model_def(config).specs)
    stored = source.tokenizer()
    check_vocabulary(stored, config.model.vocab_size, source.describe())
    for index in range(source.n_layers):
        source.read([index])
    return source
