"""Which existing file an output may replace: only an earlier output of the same kind that hpcpipe wrote.

hpcpipe writes an output whole under a temporary name and renames it into
place, and the rename replaces whatever the path held. A run must not destroy
a file it did not create, such as someone's dataset, a config or notes. So an
output path that already exists is refused unless it carries the mark hpcpipe
writes into every output of that kind:

* an inference output has the root attribute ``format = "hpcpipe-infer"``;
* a JSON document (trace, report, generation result) starts with the key
  ``"writer": "hpcpipe..."``. For a Chrome trace this is extra top-level
  metadata, which trace viewers ignore.

A rerun, for example a requeued job, still replaces its own earlier result.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import h5py

from hpcpipe.errors import ConfigError

INFER_FORMAT = "hpcpipe-infer"
_JSON_MARK = b'{"writer": "hpcpipe'
_KINDS = {"infer": f"an hpcpipe.infer output (root attribute format = {INFER_FORMAT!r})",
          "json": "a JSON file hpcpipe wrote (it starts with {\"writer\": \"hpcpipe...\"})"}


def marked_json(obj: dict[str, Any], writer: str = "hpcpipe") -> dict[str, Any]:
    """Return obj with the ``writer`` key first, the mark check_replaceable looks for."""
    if not writer.startswith("hpcpipe"):
        raise ValueError(f"writer {writer!r} must start with 'hpcpipe'")
    return {"writer": writer, **{k: v for k, v in obj.items() if k != "writer"}}


def dump_marked_json(obj: dict[str, Any], f: Any, writer: str = "hpcpipe") -> None:
    """Write obj as JSON with the writer mark first (json's default separators give the mark's exact bytes)."""
    json.dump(marked_json(obj, writer), f)


def _is_marked(path: Path, kind: str) -> bool:
    """True when the existing regular file at path is an hpcpipe output of this kind."""
    try:
        if kind == "infer":
            with h5py.File(path, "r") as f:
                value = f.attrs.get("format")
            return (value.decode() if isinstance(value, bytes) else value) == INFER_FORMAT
        with open(path, "rb") as f:
            return f.read(len(_JSON_MARK)) == _JSON_MARK
    except (OSError, ValueError):   # unreadable, or not HDF5 at all
        return False


def check_replaceable(path: str | Path, kind: str, what: str) -> None:
    """Raise ConfigError when path exists and is not an earlier hpcpipe output of this kind ("infer", "json")."""
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
