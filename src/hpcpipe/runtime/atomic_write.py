"""Replacing a small file whole: hpcpipe's own bookkeeping (a pid file, a stop marker, a profile cache entry).

A reader never sees half a file and an interrupted write leaves no temporary: the text goes to a
temporary name beside the target, then a rename replaces the target. Standard library only, so
the start-up path of a command (:mod:`hpcpipe.runtime.faults`) may use it before NumPy and MPI load.
Outputs a user names (which may replace only an earlier output of their kind) go through
:mod:`hpcpipe.state.outputs` instead.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any


def write_atomic(path: str | Path, text: str) -> None:
    """Replace path with text whole: a temporary file beside it, then a rename; no temporary is ever left.

    The temporary is created with the mode any new file gets under the umask
    (a shared cache directory stays readable to the group), and OSError
    reaches the caller, who names the file and the setting in its message.
    """
    final = Path(path)
    tmp = final.with_name(f".{final.name}.tmp-{secrets.token_hex(4)}")
    try:
        with open(tmp, "x") as f:
            f.write(text)
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_json_atomic(path: str | Path, obj: Any) -> None:
    """Replace path with obj as one line of JSON, whole (:func:`write_atomic`)."""
    write_atomic(path, json.dumps(obj) + "\n")
