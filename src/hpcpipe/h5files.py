"""Opening HDF5 inputs with errors that name the file and what it was meant to be; noticing files that change.

HDF5 reads past the end of a file return zeros instead of failing (the
default sec2 driver fills short reads), and it checks the file's length
only when it opens it. So a data or input file truncated while a run has
it open would be read as rows of zeros. :class:`WatchedFile` records the
file's identity and size when the run first looks at it and re-checks the
size with one ``fstat`` after every read: any change is a DataError naming
the file.
"""

from __future__ import annotations

import os
from pathlib import Path

import h5py

from hpcpipe.errors import ConfigError, DataError


def open_hdf5(path: str | Path, label: str, hint: str = "") -> h5py.File:
    """Open path read-only, or raise ConfigError '<label> does not exist' / '... is not a readable HDF5 file'."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{label} is a directory, not an HDF5 file")
    if not p.is_file():
        raise ConfigError(f"{label} is not a regular file" if p.exists() else f"{label} does not exist")
    try:
        return h5py.File(path, "r")
    except OSError as exc:
        raise ConfigError(f"{label} is not a readable HDF5 file{hint}: {exc}") from None


def file_identity(path: str | Path) -> tuple[int, int, int]:
    """Return (st_dev, st_ino, st_size) of path, to compare later with :class:`WatchedFile`."""
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size


class WatchedFile:
    """An HDF5 file open read-only whose size must stay what it was when the run checked it.

    ``expected`` is :func:`file_identity` taken when the file was validated
    (before step 0); opening a different or resized file then, or the size
    changing after any read, raises DataError naming the file.
    """

    def __init__(self, path: str | Path, label: str, expected: tuple[int, int, int] | None = None):
        self.path, self.label = str(path), label
        try:
            self.file = h5py.File(path, "r")
        except OSError as exc:
            raise DataError(f"{label} cannot be opened any more: {exc}") from None
        st = os.fstat(self.file.id.get_vfd_handle())
        self.size = st.st_size if expected is None else expected[2]
        if expected is not None and (st.st_dev, st.st_ino) != expected[:2]:
            self.file.close()
            raise DataError(f"{label} was replaced by another file during the run")
        self.check()

    def check(self) -> None:
        """Raise DataError if the file's size on disk differs from the size it had when checked."""
        size = os.fstat(self.file.id.get_vfd_handle()).st_size
        if size != self.size:
            raise DataError(f"{self.label} changed size during the run ({size} bytes, was {self.size}): "
                            f"truncated or replaced; its rows can no longer be trusted")

    def read_failed(self, what: str, exc: Exception) -> DataError:
        """Return the DataError for a failed read (a size change, if any, is the likelier story)."""
        try:
            self.check()
        except DataError as changed:
            return changed
        return DataError(f"{self.label}: cannot read {what}: {exc}")

    def close(self) -> None:
        """Close the file."""
        self.file.close()
