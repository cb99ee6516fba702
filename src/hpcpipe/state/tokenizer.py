"""The tokenizer stored with weights, checkpoints and token data: bytes, chars, or a Hugging Face model's files.

Every hpcpipe HDF5 file of a language model may carry its tokenizer:

* the root attribute ``tokenizer``: JSON ``{"kind": "bytes"}``, ``{"kind": "chars", "chars": "..."}``
  or ``{"kind": "hf"}``;
* for kind ``hf``, the group ``/tokenizer/`` holding the model's tokenizer files (``tokenizer.json``,
  ``tokenizer_config.json``, ``generation_config.json``, ...) as uint8 datasets named by file name:
  real ones are megabytes, too large for an attribute.

The two kinds hpcpipe implements itself, exactly as the JSON contract:

- ``{"kind": "bytes"}``: the UTF-8 bytes of the text, vocabulary 256. Any id
  sequence decodes (bytes that are not valid UTF-8 become U+FFFD).
- ``{"kind": "chars", "chars": "..."}``: one id per character, id = the
  character's position in ``chars`` (distinct characters, fixed order).
  Text with a character outside ``chars`` cannot be encoded.

Kind ``hf`` is :mod:`hpcpipe.hf.tokenizer`'s (through the ``tokenizers`` package, loaded only when such a
tokenizer is built). :class:`StoredTokenizer` is the stored pair (attribute and files), read from a
file, a Hugging Face directory or a token data file, written again into every file a run saves, and turned
into a working tokenizer (:class:`Tokenizer` or ``HFTokenizer``) with :meth:`StoredTokenizer.load`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hpcpipe.errors import ConfigError
from hpcpipe.h5files import check_links, member
from hpcpipe.hf.json_text import JSONTextError, loads
from hpcpipe.hf.sampling_defaults import sampling_defaults
from hpcpipe.hf.tokenizer import KIND_JSON, from_files, plain_name, tokenizer_files
from hpcpipe.lazy_h5py import h5py

KINDS = ("bytes", "chars")


class Tokenizer:
    """A bytes or chars tokenizer: ``Tokenizer("bytes")``, ``Tokenizer("chars", chars)``, :func:`chars_tokenizer`
    or :meth:`from_json`."""

    def __init__(self, kind: str, chars: str | None = None):
        if kind == "bytes":
            if chars is not None:
                raise ValueError("tokenizer: kind 'bytes' takes no chars")
        elif kind == "chars":
            _check_chars(chars)
        else:
            raise ValueError(f"tokenizer: unknown kind {kind!r}; expected one of {list(KINDS)}")
        self.kind, self.chars = kind, chars
        if kind == "chars":
            codes = np.array([ord(c) for c in chars], dtype=np.int64)
            self._order = np.argsort(codes, kind="stable")
            self._sorted = codes[self._order]

    @property
    def vocab_size(self) -> int:
        """Number of token ids: 256 for bytes, len(chars) for chars."""
        return 256 if self.kind == "bytes" else len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        """Return the int64 token ids of text; ValueError names the first character outside a chars vocabulary."""
        if not isinstance(text, str):
            raise ValueError(f"tokenizer: encode needs a str, got {type(text).__name__}")
        if self.kind == "bytes":
            return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
        codes = np.frombuffer(text.encode("utf-32-le", errors="surrogatepass"), dtype="<u4").astype(np.int64)
        at = np.minimum(np.searchsorted(self._sorted, codes), len(self._sorted) - 1)
        unknown = np.flatnonzero(self._sorted[at] != codes)
        if unknown.size:
            pos = int(unknown[0])
            raise ValueError(f"tokenizer: character {text[pos]!r} (U+{ord(text[pos]):04X}) at position {pos} "
                             f"is not in the tokenizer's {len(self.chars)} chars")
        return self._order[at].astype(np.int64)

    def decode(self, ids) -> str:
        """Return the text of a sequence of token ids; ValueError if an id is outside [0, vocab_size)."""
        a = np.asarray(ids)
        if a.size == 0:
            return ""
        if a.dtype == bool or not np.issubdtype(a.dtype, np.integer):
            raise ValueError(f"tokenizer: decode needs integer ids, got dtype {a.dtype}")
        a = a.reshape(-1)
        bad = np.flatnonzero((a < 0) | (a >= self.vocab_size))
        if bad.size:
            raise ValueError(f"tokenizer: id {int(a[bad[0]])} at position {int(bad[0])} is outside the "
                             f"vocabulary [0, {self.vocab_size})")
        if self.kind == "bytes":
            return a.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
        return "".join(self.chars[i] for i in a.tolist())

    def to_json(self) -> str:
        """Return the JSON text stored as the ``tokenizer`` attribute."""
        doc = {"kind": "bytes"} if self.kind == "bytes" else {"kind": "chars", "chars": self.chars}
        return json.dumps(doc)

    @classmethod
    def from_json(cls, text) -> Tokenizer:
        """Parse and validate a ``tokenizer`` attribute; any problem is one ValueError saying what is wrong."""
        if isinstance(text, bytes | np.bytes_):
            try:
                text = bytes(text).decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError("tokenizer: the attribute is not UTF-8 text") from None
        if not isinstance(text, str):
            raise ValueError(f"tokenizer: the attribute must be JSON text, got {type(text).__name__}")
        try:
            doc = loads(text)
        except JSONTextError as exc:
            raise ValueError(f"tokenizer: the attribute {exc}") from None
        if not isinstance(doc, dict):
            raise ValueError(f"tokenizer: the attribute must be a JSON object like {{\"kind\": \"bytes\"}}, "
                             f"got {text[:60]!r}")
        kind = doc.get("kind")
        if kind not in KINDS:
            raise ValueError(f"tokenizer: unknown kind {kind!r}; expected one of {list(KINDS)}")
        allowed = {"kind"} if kind == "bytes" else {"kind", "chars"}
        extra = sorted(set(doc) - allowed)
        if extra:
            raise ValueError(f"tokenizer: kind {kind!r} does not take key(s) {extra}")
        if kind == "chars" and "chars" not in doc:
            raise ValueError("tokenizer: kind 'chars' needs a \"chars\" string")
        return cls(kind, doc.get("chars"))

    def __eq__(self, other) -> bool:
        return isinstance(other, Tokenizer) and (self.kind, self.chars) == (other.kind, other.chars)

    def __hash__(self) -> int:
        return hash((self.kind, self.chars))

    def __repr__(self) -> str:
        return f"Tokenizer({self.kind!r})" if self.kind == "bytes" else f"Tokenizer('chars', {self.chars!r})"


def chars_tokenizer(text: str) -> Tokenizer:
    """Return the chars tokenizer of text's distinct characters, sorted by code point."""
    if not isinstance(text, str) or not text:
        raise ValueError("tokenizer: a chars vocabulary needs a non-empty text")
    return Tokenizer("chars", "".join(sorted(set(text))))


def _check_chars(chars) -> None:
    """Raise ValueError unless chars is a non-empty string of distinct characters."""
    if not isinstance(chars, str):
        raise ValueError(f"tokenizer: \"chars\" must be a string, got {type(chars).__name__}")
    if not chars:
        raise ValueError("tokenizer: \"chars\" is empty; a chars vocabulary needs at least one character")
    seen: dict[str, int] = {}
    for i, c in enumerate(chars):
        if c in seen:
            raise ValueError(f"tokenizer: \"chars\" repeats {c!r} (positions {seen[c]} and {i}); "
                             f"each character must appear once")
        seen[c] = i


GROUP = "tokenizer"        # the HDF5 group holding a kind hf tokenizer's files
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

    def sampling_defaults(self, vocab_size: int, label: str) -> dict[str, float | int]:
        """The model's own sampling defaults (generation_config.json's temperature, top_p, top_k; none for bytes and
        chars): :mod:`hpcpipe.hf.sampling_defaults`. ConfigError names ``label`` and the key of a bad one."""
        data = dict(self.files).get("generation_config.json") if self.kind == HF_KIND else None
        if data is None:
            return {}
        where = f"{label}: generation_config.json"
        try:
            gen = loads(data)
        except JSONTextError as exc:
            raise ConfigError(f"{where} {exc}") from None
        return sampling_defaults(gen, where, vocab_size)

    def describe(self) -> str:
        """One line for `checkpoint info`: the kind and the vocabulary."""
        if self.kind == HF_KIND:
            names = ", ".join(name for name, _ in self.files)
            return f"hf ({self.vocab_size} tokens; files {names})"
        return self.attr

    def write(self, f: Any) -> None:
        """Store this tokenizer in an open, writable h5py file (root attribute, and the files group for hf)."""
        if self.kind == HF_KIND:
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
        doc = loads(value) if isinstance(value, str) else None
    except JSONTextError:
        doc = None       # Tokenizer.from_json below says what is wrong
    if isinstance(doc, dict) and doc.get("kind") == HF_KIND:
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


def check_vocabulary(stored: StoredTokenizer, vocab: int, label: str) -> None:
    """Refuse a tokenizer that makes ids the model has no embedding row for, naming those ids and tokens.

    A Hugging Face tokenizer's count is its largest id + 1 over tokenizer.json's vocabulary, its added tokens
    and the special tokens tokenizer_config.json (or the tokenizer class, by default) adds: a class default
    such as ``<unk>`` can push it past the model's vocabulary without any file listing it.
    """
    n = stored.vocab_size
    if n <= vocab:
        return
    tokenizer = stored.load()
    if stored.kind == HF_KIND:
        shown = [f"{i} {tokenizer.id_to_token(i)!r}" for i in range(vocab, min(n, vocab + 4))]
        more = f" and {n - vocab - len(shown)} more" if n - vocab > len(shown) else ""
        why = (f"ids {', '.join(shown)}{more} come from tokenizer.json's added tokens or the special tokens "
               f"tokenizer_config.json or the tokenizer class adds")
    else:
        why = f"a {stored.kind} tokenizer makes ids 0..{n - 1}"
    raise ConfigError(f"{label}: its tokenizer has {n} token ids (0..{n - 1}) but the model's vocabulary is "
                      f"model.vocab_size = {vocab} (ids 0..{vocab - 1}): {why}, and the model has no embedding "
                      f"row for them")


def read_stored(f: Any, label: str) -> StoredTokenizer | None:
    """Return the tokenizer stored in an open h5py file, None when it has none; ConfigError naming label."""
    value = f.attrs.get("tokenizer")
    return None if value is None else from_attr(value, f, label)


def from_hf_directory(directory: str | Path) -> StoredTokenizer:
    """Return the tokenizer of a Hugging Face model directory (its tokenizer files), checked by loading it."""
    stored = StoredTokenizer(KIND_JSON, tuple(sorted(tokenizer_files(directory).items())))
    try:    # loaded here, under the directory's name, so that a bad file is named with it
        stored._loaded.append(from_files(dict(stored.files), f"Hugging Face model directory {str(directory)!r}"))
    except ValueError as exc:
        raise ConfigError(f"{str(Path(directory) / 'tokenizer.json')!r}: {exc}") from None
    return stored


def write_tokenizer_group(h5file, files: dict[str, bytes]) -> None:
    """Store tokenizer files as uint8 datasets below /tokenizer/ (replacing any) and set the root attribute
    ``tokenizer`` to ``{"kind": "hf"}``."""
    for name in files:
        if not plain_name(name):
            raise ValueError(f"tokenizer: {name!r} is not a plain file name")
    if GROUP in h5file:
        del h5file[GROUP]
    group = h5file.create_group(GROUP)
    for name, data in sorted(files.items()):
        array = np.frombuffer(bytes(data), dtype=np.uint8)
        group.create_dataset(name, data=array, fletcher32=array.size > 0)
    h5file.attrs["tokenizer"] = KIND_JSON


def read_tokenizer_files(h5file) -> dict[str, bytes]:
    """Return the tokenizer files stored below /tokenizer/; ConfigError naming the HDF5 file if absent or corrupt."""
    label = f"weights file {str(h5file.filename)!r}"
    group = h5file.get(GROUP)
    if not isinstance(group, h5py.Group):
        raise ConfigError(f"{label} has no /{GROUP} group of tokenizer files (its tokenizer attribute says kind 'hf')")
    files = {}
    for name in group:
        obj = group.get(name)
        if not isinstance(obj, h5py.Dataset) or obj.dtype != np.uint8 or obj.ndim != 1:
            raise ConfigError(f"{label}: /{GROUP}/{name} is not a one-dimensional uint8 dataset")
        try:
            files[name] = obj[...].tobytes()
        except OSError as exc:
            raise ConfigError(f"{label}: cannot read /{GROUP}/{name} (corrupt: {exc})") from None
    if "tokenizer.json" not in files:
        raise ConfigError(f"{label}: /{GROUP} holds no tokenizer.json")
    return files
