"""One HDF5 weights file: /layers/NNNN/<parameter> by global layer index (the schema in docs/state.md).

An MLP layer holds ``weight`` and ``bias``; a GPT layer group holds nested
names (``tok_emb``, ``ln1/weight``, ``attn/qkv/weight``, ...), each a dataset
below ``/layers/NNNN/``; a spec's ``shapes`` says which. A checkpoint's
per-stage file uses the same schema for the layers it holds and adds the
optimizer state of those layers::

    /layers/0003/weight                    (in, out)
    /layers/0003/bias                      (out,)
    /layers/0001/attn/qkv/weight           (d, 3d)      (GPT)
    /optimizer/layers/0003/<state>/weight  same shape as the parameter
    /optimizer/layers/0001/<state>/attn/qkv/weight
    /optimizer attrs: name (sgd | adam | adamw), steps (the optimizer's update count)

Root attributes: format, format_version, step, n_layers, model (JSON), and
any others a writer adds (``tokenizer`` of a GPT, ``pp_rank`` of a stage file).

Every dataset is written with the fletcher32 checksum filter, so a flipped
bit is an error on read, never a silently wrong number. Reading errors are
turned into ConfigError naming the file, and so is a soft or external link
that leads nowhere (:func:`hpcpipe.h5files.member`). A file whose
``format_version`` is newer than :data:`FORMAT_VERSION` is refused: it was
written by a newer hpcpipe, whose layout this one cannot know.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from hpcpipe import __version__
from hpcpipe.errors import ConfigError
from hpcpipe.h5files import member, open_hdf5
from hpcpipe.lazy_h5py import h5py
from hpcpipe.state.kinds import count_text, specs_kind

FORMAT = "hpcpipe"
FORMAT_VERSION = 1

LayerArrays = dict[int, dict[str, np.ndarray]]            # layer -> {parameter name: array}
OptimizerArrays = dict[int, dict[str, dict[str, np.ndarray]]]   # layer -> state -> {parameter name: array}
MAX_DEPTH = 3   # parameter names have at most three parts: attn/qkv/weight
_IMAGES = itertools.count()   # distinct names for in-memory files open at once


def layer_group(index: int) -> str:
    """Return the HDF5 group name of a global layer."""
    return f"layers/{index:04d}"


def optimizer_group(index: int) -> str:
    """Return the HDF5 group holding a global layer's optimizer state."""
    return f"optimizer/layers/{index:04d}"


def param_shapes(spec: Any) -> dict[str, tuple[int, ...]]:
    """Return the parameter names (possibly nested, 'attn/qkv/weight') and shapes of a layer group's spec."""
    return dict(spec.shapes)


def state_shapes(spec: Any) -> dict[str, tuple[int, ...]]:
    """The parameters of a layer group that have optimizer state: all but the frozen ones (LoRA's base)."""
    return {name: shape for name, shape in spec.shapes.items() if name not in getattr(spec, "frozen", ())}


def members(group: h5py.Group, depth: int = MAX_DEPTH, prefix: str = "", label: str = "") -> dict[str, Any]:
    """Return {nested name: object} of everything below a group that is not a group.

    Groups nested deeper than any parameter name (``depth`` levels) are returned
    as they are, so a cycle of hard links cannot recurse forever; a soft or
    external link that leads nowhere is a ConfigError naming the file (``label``,
    default the file's name) and the link.
    """
    label = label or f"file {str(group.file.filename)!r}"
    out: dict[str, Any] = {}
    for name in group:
        obj = member(group, name, label)
        path = f"{prefix}{name}"
        if isinstance(obj, h5py.Group) and depth > 1:
            out.update(members(obj, depth - 1, f"{path}/", label))
        else:
            out[path] = obj
    return out


def weights_image(arrays: LayerArrays, *, n_layers: int, model_config: dict[str, Any] | None = None,
                  step: int = 0, optimizer: OptimizerArrays | None = None,
                  optimizer_attrs: dict[str, Any] | None = None, attrs: dict[str, Any] | None = None,
                  after_layers: Callable[[bytes], None] | None = None, tokenizer: Any = None) -> bytes:
    """Return the bytes of a checksummed HDF5 weights file holding `arrays` (and optionally optimizer state).

    Built in memory (HDF5 core driver, no backing store), so HDF5 never writes to the
    target file system: a full disk is then a plain OSError from :func:`write_file_durably`.
    (HDF5 2.0 closing a file after a failed write segfaulted the process.) ``after_layers``
    (a test hook) gets the image once the parameters are in, before the optimizer state.
    ``tokenizer`` (a :class:`hpcpipe.state.tokenizer.StoredTokenizer`) is stored with it.
    """
    image_name = f"hpcpipe-image-{os.getpid()}-{next(_IMAGES)}.h5"
    with h5py.File(image_name, "w", driver="core", backing_store=False) as f:
        f.attrs["format"] = FORMAT
        f.attrs["format_version"] = FORMAT_VERSION
        f.attrs["step"] = step
        f.attrs["n_layers"] = n_layers
        f.attrs["model"] = json.dumps(model_config or {}, sort_keys=True)
        for key, value in (attrs or {}).items():
            f.attrs[key] = value
        if tokenizer is not None:
            tokenizer.write(f)
        for index in sorted(arrays):
            group = f.create_group(layer_group(index))
            for name, array in arrays[index].items():
                group.create_dataset(name, data=np.asarray(array), fletcher32=True)
        if after_layers is not None:
            f.flush()
            after_layers(f.id.get_file_image())
        if optimizer is not None:
            root = f.require_group("optimizer")
            for key, value in (optimizer_attrs or {}).items():
                root.attrs[key] = value
            for index in sorted(optimizer):
                for state, tensors in optimizer[index].items():
                    group = f.create_group(f"{optimizer_group(index)}/{state}")
                    for name, array in tensors.items():
                        group.create_dataset(name, data=np.asarray(array), fletcher32=True)
        f.flush()
        return f.id.get_file_image()


def write_file_durably(path: str | Path, data: bytes) -> None:
    """Write bytes to a new file and fsync it; on any error (e.g. disk full) remove the partial file and raise."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        Path(path).unlink(missing_ok=True)
        raise
    os.close(fd)


def write_weights(path: str | Path, arrays: LayerArrays, *, n_layers: int,
                  model_config: dict[str, Any] | None = None, step: int = 0,
                  optimizer: OptimizerArrays | None = None, optimizer_attrs: dict[str, Any] | None = None,
                  attrs: dict[str, Any] | None = None, tokenizer: Any = None) -> None:
    """Write {layer: {'weight', 'bias'}} (and optionally optimizer state) as one checksummed HDF5 file, fsynced."""
    write_file_durably(path, weights_image(arrays, n_layers=n_layers, model_config=model_config, step=step,
                                           optimizer=optimizer, optimizer_attrs=optimizer_attrs, attrs=attrs,
                                           tokenizer=tokenizer))


def open_checked(path: str | Path) -> h5py.File:
    """Open an hpcpipe HDF5 file of a format_version this hpcpipe reads, or raise ConfigError naming it."""
    p = Path(path)
    f = open_hdf5(p, f"weights file {str(p)!r}", " (truncated or foreign?)")
    fmt = f.attrs.get("format")
    if fmt != FORMAT:
        names = sorted(f.keys())
        f.close()
        what = f"root attribute format = {fmt!r}" if fmt is not None else f"no root attribute format = {FORMAT!r}"
        if "layers" not in names and names:   # a data or token file given for weights says what it holds
            what += f"; it holds {', '.join(names[:5])}{', ...' if len(names) > 5 else ''}: a data file?"
        raise ConfigError(f"weights file {str(p)!r} is not an hpcpipe weights file ({what})")
    problem = version_problem(f.attrs.get("format_version", FORMAT_VERSION))
    if problem:
        f.close()
        raise ConfigError(f"weights file {str(p)!r} {problem}")
    return f


def version_problem(version: Any, what: str = "format_version", current: int = FORMAT_VERSION) -> str | None:
    """Say why a file's format version cannot be read here (newer than ``current``, or not a version), else None.

    Files written before the attribute existed have none and read as version ``current``.
    """
    if isinstance(version, np.generic):
        version = version.item()
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        return f"has {what} {version!r}, not a format version (1, 2, ...): not written by hpcpipe"
    if version > current:
        return (f"has {what} {version}, written by a newer hpcpipe: this hpcpipe ({__version__}) reads "
                f"{what} {current} and older; read it with the hpcpipe version that wrote it (or a later one)")
    return None


def stored_layers(f: h5py.File) -> list[int]:
    """Return the global layer indices a file holds, ascending; ConfigError if /layers is malformed."""
    label = f"weights file {str(f.filename)!r}"
    layers = member(f, "layers", label)
    if layers is None:
        return []
    if not isinstance(layers, h5py.Group):
        raise ConfigError(f"{label}: layers is a {_kind(layers)}, not a group of layers")
    names = list(layers.keys())
    bad = [name for name in names if not (name.isascii() and name.isdigit())]
    if bad:
        raise ConfigError(f"{label}: layers/{bad[0]} is not a layer (layers are named by index: 0000, 0001, ...)")
    return sorted(int(name) for name in names)


def _kind(obj: Any) -> str:
    """Return what an HDF5 object is, for messages: group, dataset, or what else h5py gave."""
    if isinstance(obj, h5py.Group):
        return "group"
    if isinstance(obj, h5py.Dataset):
        return "dataset"
    if obj is None:
        return "link to nothing"
    return type(obj).__name__


def dataset_problem(obj: Any, shape: tuple[int, ...]) -> str | None:
    """Return why obj cannot hold a parameter of the given shape (None when it can).

    A parameter must be a dataset (not a group or link) of real floating-point
    numbers (not integers, strings, bytes, compound, object or complex values)
    with exactly that shape (a scalar or empty dataset is refused).
    """
    if not isinstance(obj, h5py.Dataset):
        return f"is a {_kind(obj)}, not a dataset"
    dtype = obj.dtype
    if dtype.kind != "f" or dtype.fields is not None or dtype.subdtype is not None:
        return f"holds {dtype} values, not real floating-point numbers"
    if obj.shape is None or obj.shape != shape:
        return f"has shape {obj.shape}, the model needs {shape}"
    return None


def check_group(group: Any, name: str, index: int, shapes: dict[str, tuple[int, ...]], label: str,
                what: str = "layer") -> None:
    """Raise ConfigError unless group holds exactly the datasets ``shapes`` names (nested names), each of its shape."""
    if not isinstance(group, h5py.Group):
        held = "weight and bias" if set(shapes) <= {"weight", "bias"} else "its parameters"
        raise ConfigError(f"{label}: {name} is a {_kind(group)}, not a group holding {held}")
    found = members(group, label=label)
    if sorted(found) != sorted(shapes):
        for param in shapes:   # a parameter stored as a group says so by name
            if param not in found:
                obj = member(group, param, label)
                if obj is not None and not isinstance(obj, h5py.Dataset):
                    raise ConfigError(f"{label}: {name}/{param} is a {_kind(obj)}, not a dataset")
        if len(shapes) <= 2:
            raise ConfigError(f"{label}: {what} {index} holds {sorted(found)}, the model needs {sorted(shapes)}")
        missing, extra = sorted(set(shapes) - set(found)), sorted(set(found) - set(shapes))
        parts = ([f"lacks {missing}"] if missing else []) + \
            ([f"holds {extra}, which the model does not have"] if extra else [])
        raise ConfigError(f"{label}: {what} {index} ({name}) {' and '.join(parts)}")
    for param, shape in shapes.items():
        problem = dataset_problem(found[param], shape)
        if problem:
            raise ConfigError(f"{label}: {name}/{param} {problem}")


def check_layers(f: h5py.File, specs: list[Any], label: str) -> None:
    """Raise ConfigError unless the file holds each given layer with the model's names, types and shapes."""
    for s in specs:
        name = layer_group(s.index)
        group = member(f, name, label)
        if group is None:
            raise ConfigError(f"{label}: layer {s.index} ({name}) is missing")
        check_group(group, name, s.index, param_shapes(s), label)


def check_weights(path: str | Path, specs: list[Any]) -> None:
    """Raise ConfigError unless the file holds every layer of the model with the right shapes."""
    label = f"weights file {str(path)!r}"
    with open_checked(path) as f:
        stored = stored_layers(f)
        expected = [s.index for s in specs]
        if stored != expected:
            raise ConfigError(f"{label} has layers {stored} but the model has "
                              f"{count_text(specs_kind(specs), len(specs))} {expected}")
        check_layers(f, specs, label)


def _hyperslab(obj: h5py.Dataset, part: Any) -> np.ndarray:
    """Read ``part`` (a Shard: positions along one axis) of a dataset, or all of it when part is None or whole."""
    if part is None or part.axis is None:
        return obj[...]
    key: list[Any] = [slice(None)] * obj.ndim
    key[part.axis] = part.index if isinstance(part.index, slice) else np.asarray(part.index).tolist()
    return obj[tuple(key)]


def _read(f: h5py.File, group: str, label: str, cut: dict[str, Any] | None = None) -> dict[str, np.ndarray]:
    """Read every dataset of a group (only ``cut``'s parts of them, hyperslabs, when given); ConfigError naming file
    and dataset if one is corrupt, malformed or not finite."""
    out = {}
    holder = member(f, group, label)
    if holder is None:
        raise ConfigError(f"{label}: cannot read {group} (it is missing)")
    try:
        if not isinstance(holder, h5py.Group):
            raise ConfigError(f"{label}: {group} is a {_kind(holder)}, not a group of datasets")
        for name, obj in members(holder, label=label).items():
            problem = dataset_problem(obj, obj.shape if isinstance(obj, h5py.Dataset) else ())
            if problem:
                raise ConfigError(f"{label}: {group}/{name} {problem}")
            out[name] = _hyperslab(obj, (cut or {}).get(name))
    except (OSError, KeyError) as exc:   # fletcher32 mismatch, truncated chunk, missing object
        raise ConfigError(f"{label}: cannot read {group} (corrupt: {exc})") from None
    for name, array in out.items():
        bad = array.size - int(np.count_nonzero(np.isfinite(array)))
        if bad:
            raise ConfigError(f"{label}: {group}/{name} holds {bad} non-finite value(s) (NaN or Inf) "
                              f"of {array.size}")
    return out


def _cut(f: h5py.File, group: str, label: str, index: int, shards: Any) -> dict[str, Any] | None:
    """The parts ``shards(index, names)`` gives for the datasets of one group, or None (read them whole)."""
    if shards is None:
        return None
    holder = member(f, group, label)
    return shards(index, list(members(holder, label=label))) if isinstance(holder, h5py.Group) else None


def read_layers(path: str | Path, indices: list[int], shards: Any = None) -> LayerArrays:
    """Read the given global layers from an hpcpipe file; ConfigError naming the file on any corruption.

    ``shards(index, names)`` ({name: hpcpipe.nn.core.sharding.Shard}, tensor parallelism): read only this rank's
    part of each dataset, as hyperslabs.
    """
    label = f"weights file {str(path)!r}"
    with open_checked(path) as f:
        return {i: _read(f, layer_group(i), label, _cut(f, layer_group(i), label, i, shards)) for i in indices}


def read_optimizer(path: str | Path, indices: list[int], shards: Any = None
                   ) -> tuple[dict[str, Any], OptimizerArrays]:
    """Read optimizer attributes and the given layers' optimizer state (``shards``: parts only, as
    :func:`read_layers`); ConfigError naming the file."""
    label = f"checkpoint file {str(path)!r}"
    with open_checked(path) as f:
        root = member(f, "optimizer", label)
        if root is None:
            raise ConfigError(f"{label} holds no optimizer state")
        attrs = {k: (v.item() if hasattr(v, "item") else v) for k, v in root.attrs.items()}
        out: OptimizerArrays = {}
        for i in indices:
            group = optimizer_group(i)
            states = state_names(f, group, label)
            out[i] = {state: _read(f, f"{group}/{state}", label, _cut(f, f"{group}/{state}", label, i, shards))
                      for state in states}
        return attrs, out


def state_names(f: h5py.File, group: str, label: str) -> list[str]:
    """Return the optimizer states stored for one layer (``optimizer/layers/NNNN``'s members), sorted."""
    holder = member(f, group, label)
    if holder is None:
        return []
    if not isinstance(holder, h5py.Group):
        raise ConfigError(f"{label}: {group} is a {_kind(holder)}, not a group of optimizer states")
    return sorted(holder.keys())
