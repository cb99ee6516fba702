"""The tokenizer stored with GPT weights as the root attribute ``tokenizer``: text <-> integer token ids.

Two kinds, exactly as the JSON contract:

- ``{"kind": "bytes"}``: the UTF-8 bytes of the text, vocabulary 256. Any id
  sequence decodes (bytes that are not valid UTF-8 become U+FFFD).
- ``{"kind": "chars", "chars": "..."}``: one id per character, id = the
  character's position in ``chars`` (distinct characters, fixed order).
  Text with a character outside ``chars`` cannot be encoded.
"""

from __future__ import annotations

import json

import numpy as np

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
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"tokenizer: the attribute is not valid JSON ({exc})") from None
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
