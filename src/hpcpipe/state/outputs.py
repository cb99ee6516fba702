"""Every file hpcpipe writes goes through here: can it be created, may it replace what is there, written whole.

Which existing file an output may replace: only an earlier output of the same kind that hpcpipe wrote.

hpcpipe writes an output whole under a temporary name and renames it into
place, and the rename replaces whatever the path held. A run must not destroy
a file it did not create, such as someone's dataset, a config or notes. So an
output path that already exists is refused unless it carries the mark hpcpipe
writes into every output of that kind:

* an inference output has the root attribute ``format = "hpcpipe-infer"``;
* a JSON document starts with the key ``"writer"`` naming its kind
  (``WRITERS``: a trace, an inference report, a generation result), so one
  kind never replaces another. For a Chrome trace this is extra top-level
  metadata, which trace viewers ignore.

A rerun, for example a requeued job, still replaces its own earlier result.
Outputs are committed by ``commit_output``, which checks again at the end of
the run: a file that appeared at the path meanwhile is left alone.

Files that are hpcpipe's own bookkeeping (a stop marker, a pid file, a
profile cache entry, a probe result) are replaced whole by
:func:`hpcpipe.runtime.atomic_write.write_atomic` (below ``state``: the runtime
writes them too); it is importable from here as well, for the planner and the
profile cache.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
from pathlib import Path
from typing import Any

from hpcpipe.errors import ConfigError
from hpcpipe.runtime.atomic_write import write_atomic as write_atomic  # the planner, the profile cache
from hpcpipe.runtime.atomic_write import write_json_atomic as write_json_atomic

INFER_FORMAT = "hpcpipe-infer"
TEMP_SUFFIX_BYTES = 14   # ".NAME.tmp-XXXXXXXX" (the longest temporary name hpcpipe gives an output)
# JSON kinds and the writer each marks its files with: one kind never replaces another kind's file
WRITERS = {"trace": "hpcpipe.trace", "report": "hpcpipe.infer.report", "generate": "hpcpipe.generate"}
_KINDS = {"infer": f"an hpcpipe.infer output (whose root attribute format is {INFER_FORMAT!r})",
          **{kind: f"a file hpcpipe wrote as a {kind} (it starts with {{\"writer\": \"{w}\"}})"
             for kind, w in WRITERS.items()}}


def _mark(kind: str) -> bytes:
    return b'{"writer": "' + WRITERS[kind].encode() + b'"'


def marked_json(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    """Return obj with the ``writer`` key of this kind first, the mark check_replaceable looks for."""
    if kind not in WRITERS:
        raise ValueError(f"unknown JSON output kind {kind!r}")
    return {"writer": WRITERS[kind], **{k: v for k, v in obj.items() if k != "writer"}}


def dump_marked_json(obj: dict[str, Any], f: Any, kind: str) -> None:
    """Write obj as JSON with the writer mark first (json's default separators give the mark's exact bytes)."""
    json.dump(marked_json(obj, kind), f)


def _is_marked(path: Path, kind: str) -> bool:
    """True when the existing regular file at path is an hpcpipe output of this kind."""
    try:
        if kind == "infer":
            import h5py  # here: the bookkeeping writers below must not pay for loading HDF5

            with h5py.File(path, "r") as f:
                value = f.attrs.get("format")
            return (value.decode() if isinstance(value, bytes) else value) == INFER_FORMAT
        with open(path, "rb") as f:
            return f.read(len(_mark(kind))) == _mark(kind)
    except (OSError, ValueError):   # unreadable, or not HDF5 at all
        return False


def check_replaceable(path: str | Path, kind: str, what: str) -> None:
    """Raise ConfigError when path exists and is not an earlier hpcpipe output of this kind (see WRITERS)."""
    if kind not in _KINDS:
        raise ValueError(f"unknown output kind {kind!r}")
    p = Path(path)
    if not (p.exists() or p.is_symlink()):
        return
    if p.is_symlink():
        # the rename would replace the link, and the file it points to would no longer be the output
        raise ConfigError(f"{what} {str(p)!r} is a symbolic link; hpcpipe replaces only its own earlier output "
                          f"there: name the real file or choose another path")
    if not p.is_file():
        raise ConfigError(f"{what} {str(p)!r} exists and is not a regular file; choose another path")
    if not _is_marked(p, kind):
        raise ConfigError(f"{what} {str(p)!r} already exists and is not {_KINDS[kind]}; hpcpipe replaces only its "
                          f"own earlier output: move the file away or choose another path")


def file_kind(path: str | Path) -> str:
    """Name what is at an existing path that is not a regular file ("a named pipe", "a socket", ...)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return "unreadable"
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def check_writable(path: str | Path, what: str = "output path", append: bool = False, probe: bool = False) -> None:
    """Raise ConfigError unless a file can be created at path: a name, in a directory that exists and is writable.

    ``what`` names the option in the one-line message ("output path", "--json path", "log.metrics").
    With ``append`` an existing regular file must be writable (it is appended to, not replaced). With
    ``probe`` a file is created and removed beside a new path, for a check before minutes of work that the
    permission bits cannot give (root, /proc, read-only mounts); it changes the directory's mtime.
    """
    p = Path(path)
    if not str(path):
        raise ConfigError(f"{what} is empty: name the file to write")
    try:
        os.lstat(p)
    except (FileNotFoundError, NotADirectoryError):   # a missing or non-directory parent is named below
        pass
    except OSError as exc:   # ENAMETOOLONG, ELOOP, EACCES on a parent...: one line, not a traceback
        raise ConfigError(f"{what} {str(p)!r} is not usable: {exc.strerror}") from None
    try:
        name_max = os.pathconf(p.parent, "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    if len(os.fsencode(p.name)) + TEMP_SUFFIX_BYTES > name_max:
        raise ConfigError(f"{what} {str(p)!r}: the file name is too long ({len(os.fsencode(p.name))} bytes; hpcpipe "
                          f"writes it under a temporary name {TEMP_SUFFIX_BYTES} bytes longer, and names here hold at "
                          f"most {name_max})")
    if p.is_dir():
        raise ConfigError(f"{what} {str(p)!r} is a directory")
    if p.exists() and not p.is_file():   # a FIFO would block the writer, a device is no place for a result
        raise ConfigError(f"{what} {str(p)!r} exists and is {file_kind(p)}, not a regular file; choose another path")
    if append and p.is_file() and not os.access(p, os.W_OK):
        raise ConfigError(f"{what} {str(p)!r} exists and is not writable")
    parent = p.parent
    noun = what.removesuffix(" path")
    if not (parent.exists() or parent.is_symlink()):
        raise ConfigError(f"{noun} directory {str(parent)!r} does not exist (for {noun} {str(p)!r})")
    if not parent.is_dir():
        raise ConfigError(f"{what} {str(p)!r} is not writable: {str(parent)!r} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} {str(p)!r} is not writable: no write permission on {str(parent)!r}")
    if probe and not p.exists():
        _try_create(p, what)


def _try_create(p: Path, what: str) -> None:
    """Create and remove an empty file beside p: the permission bits do not tell (root, /proc, read-only mounts)."""
    probe = p.with_name(f".{p.name}.tmp-{secrets.token_hex(16)}")    # every rank probes the same folder at once
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        raise ConfigError(f"{what} {str(p)!r}: cannot create a file in {str(p.parent)!r}: "
                          f"{exc.strerror or exc}") from None
    os.close(fd)
    os.unlink(probe)


def commit_output(tmp: Path, final: Path, kind: str | None, what: str) -> None:
    """Move the complete temporary file to its final name without destroying a file that appeared meanwhile.

    The path was checked when the run started, but the run can take hours: a
    path that is free now is taken with a hard link, which fails if anything
    got there first; a path that holds something is checked again and only
    an earlier output of this ``kind`` is replaced (None: never replace).
    On a refusal the result stays at ``tmp`` and the error names it.
    """
    keep = f"; this run's result is kept as {str(tmp)!r}"
    if not (final.exists() or final.is_symlink()):
        try:
            os.link(tmp, final)
        except FileExistsError:
            raise ConfigError(f"{what} {str(final)!r} appeared while the run was writing; it was left alone"
                              f"{keep}") from None
        except OSError:   # a file system without hard links: a rename, checked just before
            os.replace(tmp, final)
            return
        os.unlink(tmp)
        return
    if kind is None:
        raise ConfigError(f"{what} {str(final)!r} appeared while the run was writing; it was left alone{keep}")
    try:
        check_replaceable(final, kind, what)
    except ConfigError as exc:
        raise ConfigError(f"{exc}{keep}") from None
    os.replace(tmp, final)


def write_json_output(path: str | Path, obj: dict[str, Any], kind: str, what: str) -> None:
    """Write obj as marked JSON beside path, then commit it there (commit_output): whole or not at all."""
    final = Path(path)
    tmp = final.with_name(f".{final.name}.tmp-{secrets.token_hex(4)}")
    try:
        with open(tmp, "w") as f:
            dump_marked_json(obj, f, kind)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    commit_output(tmp, final, kind, what)


def write_new(path: str | Path, what: str, text: str) -> None:
    """Write text to a new file at path, whole or not at all, never over a file that is there or appeared meanwhile."""
    final = Path(path)
    tmp = final.with_name(f".{final.name}.tmp-{secrets.token_hex(4)}")
    try:
        try:
            with open(tmp, "x") as f:
                f.write(text)
            os.link(tmp, final)      # unlike a rename, fails if the path (or a dangling symlink) exists by now
        finally:
            tmp.unlink(missing_ok=True)
    except FileExistsError:
        raise ConfigError(f"{what} {str(final)!r} appeared while the run was writing; it was left alone (the "
                          f"result is printed above)") from None
    except OSError as exc:
        raise ConfigError(f"{what} {str(final)!r}: cannot write: {exc.strerror or exc}") from None
