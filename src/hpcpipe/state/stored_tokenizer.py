"""The tokenizer that travels with weights, checkpoints and token data: one root attribute, plus files for kind hf.

Every hpcpipe HDF5 file of a language model may carry its tokenizer:

* the root attribute ``tokenizer``: JSON ``{"kind": "bytes"}``, ``{"kind": "chars", "chars": "..."}``
  (:mod:`hpcpipe.state.tokenizer`) or ``{"kind": "hf"}``;
* for kind ``hf``, the group ``/tokenizer/`` holding the model's tokenizer files (``tokenizer.json``,
  ``tokenizer_config.json``, ``generation_config.json``, ...) as uint8 datasets, one per file
  (:mod:`hpcpipe.hf.tokenizer`): real ones are megabytes, too large for an attribute.

:class:`StoredTokenizer` is that pair, read from a file, a Hugging Face directory or a token data file,
written again into every file a run saves, and turned into a working tokenizer with :meth:`load`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py

from hpcpipe.errors import ConfigError
from hpcpipe.h5files import check_links, member
from hpcpipe.state.tokenizer import Tokenizer

HF_KIND = "hf"


@dataclass(frozen=True)
class StoredTokenizer:
    """A tokenizer as stored: its ``tokenizer`` attribute (JSON text) and, for kind hf, its files."""

    attr: str
    files: tuple[tuple[str, bytes], ...] = ()
    _loaded: list = field(default_factory=list, compare=False, repr=False)   # the loaded tokenizer, once

    @property
    def kind(self) -> str:
        """bytes | chars | hf."""
        return json.loads(self.attr).get("kind", "")

    def load(self) -> Any:
        """Return the working tokenizer (Tokenizer for bytes and chars, HFTokenizer for hf); ValueError if invalid."""
        if not self._loaded:
            if self.kind == HF_KIND:
                from hpcpipe.hf.tokenizer import from_files
                self._loaded.append(from_files(dict(self.files)))
            else:
                self._loaded.append(Tokenizer.from_json(self.attr))
        return self._loaded[0]

    @property
    def vocab_size(self) -> int:
        """Token ids the tokenizer can produce (for kind hf: the largest id + 1, added tokens included)."""
        return int(self.load().vocab_size)

    def eos_ids(self) -> tuple[int, ...]:
        """Token ids that end a generation (none for bytes and chars)."""
        return tuple(getattr(self.load(), "eos_ids", ()) or ())

    def describe(self) -> str:
        """One line for `checkpoint info`: the kind and the vocabulary."""
        if self.kind == HF_KIND:
            names = ", ".join(name for name, _ in self.files)
            return f"hf ({self.vocab_size} tokens; files {names})"
        return self.attr

    def write(self, f: Any) -> None:
        """Store this tokenizer in an open, writable h5py file (root attribute, and the files group for hf)."""
        if self.kind == HF_KIND:
            from hpcpipe.hf.tokenizer import write_tokenizer_group
            write_tokenizer_group(f, dict(self.files))
        else:
            f.attrs["tokenizer"] = self.attr


def from_attr(value: Any, f: Any, label: str) -> StoredTokenizer:
    """Return the StoredTokenizer of a file's ``tokenizer`` attribute value (and its files group for hf).

    ``f`` is the open h5py file the attribute came from; any problem is a ConfigError naming ``label``.
    """
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            raise ConfigError(f"{label}: root attribute tokenizer is not UTF-8 text") from None
    try:
        doc = json.loads(value) if isinstance(value, str) else None
    except json.JSONDecodeError:
        doc = None       # Tokenizer.from_json below says what is wrong
    if isinstance(doc, dict) and doc.get("kind") == HF_KIND:
        from hpcpipe.hf.tokenizer import GROUP, read_tokenizer_files
        files = member(f, GROUP, label)   # a link that leads nowhere is named here, before the files are read
        if isinstance(files, h5py.Group):
            check_links(files, label, depth=1)
        stored = StoredTokenizer(value, tuple(sorted(read_tokenizer_files(f).items())))
        try:
            stored.load()
        except ConfigError as exc:
            raise ConfigError(f"{label}: root attribute tokenizer: {exc}") from None
        return stored
    try:
        Tokenizer.from_json(value)
    except ValueError as exc:    # "tokenizer: ..." as Tokenizer.from_json words it
        raise ConfigError(f"{label}: root attribute {exc}") from None
    return StoredTokenizer(value)


def read_stored(f: Any, label: str) -> StoredTokenizer | None:
    """Return the tokenizer stored in an open h5py file, None when it has none; ConfigError naming label."""
    value = f.attrs.get("tokenizer")
    return None if value is None else from_attr(value, f, label)


def from_hf_directory(directory: str | Path) -> StoredTokenizer:
    """Return the tokenizer of a Hugging Face model directory (its tokenizer files), checked by loading it."""
    from hpcpipe.hf.tokenizer import KIND_JSON, tokenizer_files
    stored = StoredTokenizer(KIND_JSON, tuple(sorted(tokenizer_files(directory).items())))
    try:
        stored.load()
    except ValueError as exc:
        raise ConfigError(f"{str(Path(directory) / 'tokenizer.json')!r}: {exc}") from None
    return stored
