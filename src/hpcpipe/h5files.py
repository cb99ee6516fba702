"""Opening HDF5 inputs with errors that name the file and what it was meant to be."""

from __future__ import annotations

from pathlib import Path

import h5py

from .errors import ConfigError


def open_hdf5(path: str | Path, label: str, hint: str = "") -> h5py.File:
    """Open path read-only, or raise ConfigError '<label> does not exist' / '... is not a readable HDF5 file'."""
    if not Path(path).is_file():
        raise ConfigError(f"{label} does not exist")
    try:
        return h5py.File(path, "r")
    except OSError as exc:
        raise ConfigError(f"{label} is not a readable HDF5 file{hint}: {exc}") from None
