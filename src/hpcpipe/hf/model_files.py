"""The files of a Hugging Face model directory that hpcpipe reads: inside the directory, and regular files.

A model directory is untrusted input. A ``chat_template.jinja`` that is a symbolic link to ``/etc/passwd``
was followed and its text embedded in every weights file imported from the directory, and a
``model.safetensors`` linked to ``/dev/zero`` was reported as missing. Every file hpcpipe reads from a
model directory (config.json, generation_config.json, the tokenizer files, the safetensors files and
their index) is opened through :func:`model_file`: a symbolic link is followed only when it resolves
inside the model directory, and what it names must be a regular file; anything else is one line naming
the link and its target.

Inside means below the directory itself, or, for a snapshot of the Hugging Face hub cache
(``models--ORG--NAME/snapshots/REVISION/``, whose files link to ``../../blobs/``), below the
repository's cache folder ``models--ORG--NAME``.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from hpcpipe.errors import ConfigError


def model_root(directory: Path) -> Path:
    """The folder a model directory's links may lead into: itself (resolved), or its hub cache repository folder."""
    real = directory.resolve()
    repo = real.parent.parent
    if real.parent.name == "snapshots" and repo.name.startswith("models--") and (repo / "blobs").is_dir():
        return repo
    return real


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def model_file(directory: Path, name: str, what: str) -> Path | None:
    """Return ``directory / name`` when it is there (None when it is not): a regular file, or a link to one
    inside the model directory; ConfigError of one line naming the path otherwise."""
    path = directory / name
    if not os.path.lexists(path):
        return None
    real = path.resolve()
    root = model_root(directory)
    if not real.is_relative_to(root):
        raise ConfigError(f"{what} {str(path)!r} is a symbolic link to {str(real)!r}, outside the model directory "
                          f"{str(root)!r}: hpcpipe reads no file outside it (copy the file into the directory)")
    try:
        mode = os.stat(real).st_mode
    except OSError as exc:
        raise ConfigError(f"{what} {str(path)!r} is a symbolic link to {str(real)!r}, which cannot be read: "
                          f"{exc.strerror or exc}") from None
    if not stat.S_ISREG(mode):
        raise ConfigError(f"{what} {str(path)!r} is {_kind(mode)}, not a regular file")
    return path
