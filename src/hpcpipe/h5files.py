"""Opening HDF5 inputs with errors that name the file and what it was meant to be; noticing files that change.

HDF5 reads past the end of a file return zeros instead of failing (the
default sec2 driver fills short reads), and it checks the file's length
only when it opens it. So a data or input file truncated while a run has
it open would be read as rows of zeros. :class:`WatchedFile` records the
file's identity and size when the run first looks at it and re-checks the
size with one ``fstat`` after every read: any change is a DataError naming
the file.

Links are where an HDF5 file can lead nowhere: a soft link may name nothing or
loop back on itself, an external link may name a file that cannot be opened.
h5py reports those as KeyError, OSError or RuntimeError from deep inside a
lookup; :func:`member` turns them into one ConfigError naming the file and the
link, and :func:`broken_symlink` does the same for the path of the file itself.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path
from typing import Any

from hpcpipe.errors import ConfigError, DataError
from hpcpipe.lazy_h5py import h5py


def open_hdf5(path: str | Path, label: str, hint: str = "") -> h5py.File:
    """Open path read-only, or raise ConfigError '<label> does not exist' / '... is not a readable HDF5 file'."""
    p = Path(path)
    broken = broken_symlink(p)
    if broken:
        raise ConfigError(f"{label} {broken}")
    if p.is_dir():
        raise ConfigError(f"{label} is a directory, not an HDF5 file")
    if not p.is_file():
        raise ConfigError(f"{label} is not a regular file" if p.exists() else f"{label} does not exist")
    try:
        return h5py.File(path, "r")
    except OSError as exc:
        raise ConfigError(f"{label} is not a readable HDF5 file{hint}: {exc}") from None


def broken_symlink(path: str | Path) -> str | None:
    """Say how path leads nowhere through symbolic links (a loop, ELOOP; a dangling link), else None.

    Without this both read as "does not exist", which sends the user looking for a missing file.
    """
    try:
        os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            where = "is" if os.path.islink(path) else "passes through"
            return f"{where} a symbolic link loop (ELOOP: too many levels of symbolic links)"
        if exc.errno == errno.ENOENT and os.path.islink(path):
            return f"is a symbolic link to {os.readlink(path)!r}, which does not exist"
    return None


# what h5py raises for a link it cannot follow: KeyError (names nothing, a file that cannot be
# opened), RuntimeError (a cycle: "too many links"), OSError and ValueError (other HDF5 failures)
LINK_ERRORS = (KeyError, OSError, RuntimeError, ValueError)


def member(group: h5py.Group, name: str, label: str) -> Any:
    """Return ``group[name]`` (name may be a path, ``a/b``), None when nothing is linked there.

    A soft link that names nothing or loops, or an external link that cannot be resolved,
    anywhere on the way, is a ConfigError ``<label>: <link> is a soft link to ...`` naming
    the file (``label``) and the link; any other failure to open it names the object.
    """
    try:
        return group[name]
    except LINK_ERRORS as exc:
        problem = broken_link(group, name)
        if problem is not None:
            raise ConfigError(f"{label}: {problem}") from None
        if isinstance(exc, KeyError) and not _linked(group, name):   # no such name (or a name below a dataset)
            return None
        raise ConfigError(f"{label}: cannot open {_path(group, name)} (corrupt: {_reason(exc)})") from None


def broken_link(group: h5py.Group, name: str) -> str | None:
    """Describe the first soft or external link on the way to ``group[name]`` that leads nowhere, else None."""
    node: Any = group
    for part in [p for p in name.split("/") if p]:
        if not isinstance(node, h5py.Group):
            return None
        try:
            link = node.get(part, getlink=True)
        except LINK_ERRORS:
            return None
        if link is None:
            return None
        try:
            node = node[part]
        except LINK_ERRORS as exc:
            return describe_link(_path(node, part), link, exc)
    return None


def describe_link(path: str, link: Any, exc: BaseException) -> str | None:
    """Say why a link could not be followed: '<path> is a soft link to '/b' that loops ...'; None for a hard link."""
    looped = isinstance(exc, RuntimeError) or "too many links" in str(exc)
    if isinstance(link, h5py.SoftLink):
        what = " that loops back on itself (a cycle of soft links)" if looped else \
            ", which names nothing in the file (a dangling link)"
        return f"{path} is a soft link to {link.path!r}{what}"
    if isinstance(link, h5py.ExternalLink):
        why = "a cycle of links" if looped else _reason(exc)
        return f"{path} is an external link to {link.path!r} in {link.filename!r}, which cannot be resolved ({why})"
    return None


def check_links(group: h5py.Group, label: str, depth: int = 3) -> None:
    """Raise ConfigError for the first link below group (``depth`` levels) that leads nowhere."""
    for name in group:
        obj = member(group, name, label)
        if isinstance(obj, h5py.Group) and depth > 1:
            check_links(obj, label, depth - 1)


def _linked(group: h5py.Group, name: str) -> bool:
    """Whether a link named ``name`` exists (a hard link whose object cannot be opened is corrupt, not missing)."""
    try:
        return group.get(name, getlink=True) is not None
    except LINK_ERRORS:
        return False


def _path(group: h5py.Group, name: str) -> str:
    """The name of group/name inside its file, without the leading slash (as messages name datasets)."""
    try:
        base = group.name or "/"
    except LINK_ERRORS:
        base = "/"
    return f"{base.rstrip('/')}/{name}".lstrip("/")


def _reason(exc: BaseException) -> str:
    """HDF5's own words from an h5py error: 'Unable to ... (can't open file)' gives "can't open file"."""
    text = str(exc).strip("'\"")
    found = re.search(r"\(([^()]*)\)\s*$", text)
    return found.group(1) if found else text


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
