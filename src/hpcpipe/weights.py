"""Single-file HDF5 weights: /layers/NNNN/{weight,bias} by global layer index (DESIGN.md schema)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from .errors import ConfigError
from .model import LayerSpec

FORMAT = "hpcpipe"
FORMAT_VERSION = 1


def layer_group(index: int) -> str:
    """Return the HDF5 group name of a global layer."""
    return f"layers/{index:04d}"


def write_weights(path: str | Path, arrays: dict[int, dict[str, np.ndarray]], *, n_layers: int,
                  model_config: dict[str, Any] | None = None, step: int = 0) -> None:
    """Write {layer: {'weight', 'bias'}} as a weights file (checksummed datasets)."""
    with h5py.File(path, "w") as f:
        f.attrs["format"] = FORMAT
        f.attrs["format_version"] = FORMAT_VERSION
        f.attrs["step"] = step
        f.attrs["n_layers"] = n_layers
        f.attrs["model"] = json.dumps(model_config or {}, sort_keys=True)
        for index in sorted(arrays):
            group = f.create_group(layer_group(index))
            for name, array in arrays[index].items():
                group.create_dataset(name, data=np.asarray(array), fletcher32=True)


def check_weights(path: str | Path, specs: list[LayerSpec]) -> None:
    """Raise ConfigError unless the file holds every layer of the model with the right shapes."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"weights file {str(p)!r} does not exist")
    try:
        f = h5py.File(p, "r")
    except OSError as exc:
        raise ConfigError(f"weights file {str(p)!r} is not a readable HDF5 file: {exc}") from None
    with f:
        if f.attrs.get("format") != FORMAT:
            raise ConfigError(f"weights file {str(p)!r} is not an hpcpipe file (root attribute format = "
                              f"{f.attrs.get('format')!r})")
        stored = sorted(f["layers"].keys()) if "layers" in f else []
        expected = [f"{s.index:04d}" for s in specs]
        if stored != expected:
            raise ConfigError(f"weights file {str(p)!r} has layers {stored} but the model has {len(specs)} "
                              f"layers {expected}")
        for s in specs:
            group = f[layer_group(s.index)]
            shapes = {"weight": (s.fan_in, s.fan_out)}
            if s.bias:
                shapes["bias"] = (s.fan_out,)
            if sorted(group.keys()) != sorted(shapes):
                raise ConfigError(f"weights file {str(p)!r}: layer {s.index} holds {sorted(group.keys())}, "
                                  f"the model needs {sorted(shapes)}")
            for name, shape in shapes.items():
                if group[name].shape != shape:
                    raise ConfigError(f"weights file {str(p)!r}: {layer_group(s.index)}/{name} has shape "
                                      f"{group[name].shape}, the model needs {shape}")


def read_weights(path: str | Path, indices: list[int]) -> dict[int, dict[str, np.ndarray]]:
    """Read the given global layers from a weights file (call check_weights first)."""
    with h5py.File(path, "r") as f:
        return {i: {name: f[layer_group(i)][name][...] for name in f[layer_group(i)]} for i in indices}
