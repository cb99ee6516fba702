"""Log-probabilities in OpenAI's response shapes: each token named by its own text, as both APIs report them.

A row is ``(token id, log-probability or None, [(id, log-probability), ...] or None)``: the engine's entries
(hpcpipe.serve.logprobs), and for an echoed prompt its first token, which has no log-probability (nothing
comes before it), with None.

* completions: ``{"tokens": [text], "token_logprobs": [lp], "top_logprobs": [{text: lp}], "text_offset": [int]}``;
  a top_logprobs dict holds the k most likely tokens and the token itself (up to k + 1 keys, as OpenAI's);
  text_offset is where each token starts in the choice's text: the characters its tokens' bytes before it
  decode to (``Offsets``; a character split over tokens counts once, when its last byte comes).
* chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}],
  "refusal": null}``, top_logprobs the k most likely.

A token's text is its bytes as UTF-8; a token that is part of a character (a byte-level BPE splits some)
is written as OpenAI writes it, ``bytes:\\xe2\\x80``. Its bytes come from llguidance's reading of the
tokenizer (exact for byte-level, byte-fallback and metaspace tokens), else from decoding the id alone.
"""

from __future__ import annotations

import codecs
from typing import Any

from hpcpipe.serve.grammar import GrammarError, lltokenizer

Row = tuple[int, float | None, list[tuple[int, float]] | None]


class TokenTexts:
    """Each token id's bytes and text (cached), for a chars or Hugging Face tokenizer."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._bytes: dict[int, bytes] = {}
        self._ll: Any = None

    def bytes_of(self, token: int) -> bytes:
        """The token's own bytes."""
        got = self._bytes.get(token)
        if got is None:
            got = self._bytes[token] = self._read(token)
        return got

    def _read(self, token: int) -> bytes:
        tok = self.tokenizer
        if tok.kind == "chars":
            return tok.chars[token].encode("utf-8")
        if tok.kind == "bytes":
            return bytes([token])
        if self._ll is None:
            try:
                self._ll = lltokenizer(tok)
            except GrammarError:
                self._ll = False          # the library cannot read it: decode each id alone
        if self._ll:
            return self._ll.decode_bytes([token])
        return tok.decode_raw([token]).encode("utf-8")

    def text(self, token: int) -> str:
        """The token's text; ``bytes:\\xNN...`` when its bytes are not whole UTF-8 characters (OpenAI's form)."""
        raw = self.bytes_of(token)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def rows_of(entries: list | None, prompt: list[int] | None = None) -> list[Row]:
    """Rows of an event's entries; with ``prompt`` (echo), the prompt's rows first (its first token without a value)."""
    rows: list[Row] = []
    if prompt is not None:
        rows.append((int(prompt[0]), None, None))
    rows.extend((int(t), lp, top) for t, lp, top in entries or ())
    return rows


class Offsets:
    """Where each of a choice's tokens starts in its text: its tokens' bytes decoded as they come."""

    def __init__(self, texts: TokenTexts):
        self.texts, self.chars = texts, 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def of(self, rows: list[Row]) -> list[int]:
        """The offsets of the next rows' tokens."""
        out = []
        for token, _, _ in rows:
            out.append(self.chars)
            self.chars += len(self._utf8.decode(self.texts.bytes_of(token)))
        return out


def completion_logprobs(rows: list[Row], offsets: list[int], texts: TokenTexts) -> dict:
    """The completions API's logprobs object of rows, their text offsets given."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": list(offsets)}
    for token, lp, top in rows:
        text = texts.text(token)
        out["tokens"].append(text)
        out["token_logprobs"].append(lp)
        if top is None:
            out["top_logprobs"].append(None)
        else:
            alternatives = {texts.text(t): v for t, v in top}
            alternatives.setdefault(text, lp)        # the token itself, as OpenAI's "up to logprobs + 1"
            out["top_logprobs"].append(alternatives)
    return out


def chat_logprobs(rows: list[Row], texts: TokenTexts) -> dict:
    """The chat API's logprobs object of rows (generated tokens only)."""
    def one(token: int, lp: float | None) -> dict:
        return {"token": texts.text(token), "logprob": lp, "bytes": list(texts.bytes_of(token))}
    return {"content": [{**one(token, lp), "top_logprobs": [one(t, v) for t, v in top or ()]}
                        for token, lp, top in rows], "refusal": None}

