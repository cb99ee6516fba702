"""Generated token ids -> text deltas, one request at a time: whole characters only, cut at stop strings.

A bytes tokenizer (and a Hugging Face byte-level BPE) may split one UTF-8 character over several tokens,
so its bytes are held back until they decode; a Hugging Face tokenizer's own incremental decoder does that
for it, and the text of a whole generation is ``tokenizer.decode(ids)`` (special tokens skipped).
Stop strings are matched on the decoded text, also across token boundaries: text that could
be the start of a stop string is held back until the next tokens show whether it is.
"""

from __future__ import annotations

import codecs


class TextStream:
    """Incremental detokenizer with stop strings: feed() token ids, get the text that is safe to show."""

    def __init__(self, tokenizer, stop: list[str] | tuple[str, ...] = ()):
        self._tokenizer = tokenizer
        self._bytes = getattr(tokenizer, "kind", None) == "bytes"
        # errors="replace" as Tokenizer.decode: an invalid byte becomes U+FFFD, an incomplete tail waits.
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace") if self._bytes else None
        self._incremental = tokenizer.incremental_decoder() if hasattr(tokenizer, "incremental_decoder") else None
        self._stop = [s for s in stop if s]
        self._held = ""
        self.stopped = False           # a stop string was seen: the text ends before it
        self.text = ""                 # all text emitted so far

    def feed(self, ids) -> str:
        """Return the new text that is certain after these token ids ('' while bytes or a stop prefix wait)."""
        if self.stopped:
            return ""
        ids = [int(i) for i in ids]
        if not ids:
            return ""
        if self._bytes:
            if any(i < 0 or i > 255 for i in ids):
                raise ValueError(f"textstream: byte token ids must be in [0, 256), got {ids}")
            piece = self._utf8.decode(bytes(ids))
        elif self._incremental is not None:
            piece = self._incremental.decode(ids)
        else:
            piece = self._tokenizer.decode(ids)
        return self._advance(piece, final=False)

    def finish(self) -> str:
        """Return the rest of the text at the end of generation (an incomplete UTF-8 tail becomes U+FFFD)."""
        if self.stopped:
            return ""
        piece = self._utf8.decode(b"", final=True) if self._bytes else \
            self._incremental.finish() if self._incremental is not None else ""
        return self._advance(piece, final=True)

    def _advance(self, piece: str, final: bool) -> str:
        """Add decoded text; emit what cannot belong to a stop string, cut at the first stop string."""
        held = self._held + piece
        cut = _first_stop(held, self._stop)
        if cut is not None:
            self.stopped = True
            out, self._held = held[:cut], ""
        else:
            keep = 0 if final else _stop_prefix_len(held, self._stop)
            out, self._held = held[:len(held) - keep], held[len(held) - keep:]
        self.text += out
        return out


def _first_stop(text: str, stops: list[str]) -> int | None:
    """Return where the earliest stop string starts in text, or None."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """Return the length of the longest suffix of text that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
