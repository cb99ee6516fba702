"""JSON text parsed with its nesting bounded: text nested 100,000 levels deep is one clear error, not a RecursionError.

Python's ``json`` recurses once per level of nesting, so ``[`` x 100,000 in a model's config.json (or in a
request) raised RecursionError and printed thousands of traceback lines. :func:`loads` measures the
nesting first, without recursion and at C speed (bytes operations and NumPy: a running sum over the
brackets outside strings), and refuses text deeper than ``MAX_DEPTH``; it also turns every other reason the text is not
JSON (invalid UTF-8, a syntax error, an integer of more than 4,300 digits) into :class:`JSONTextError`,
one line. Every JSON file hpcpipe reads goes through it (config.json, generation_config.json,
tokenizer_config.json, tokenizer.json, special_tokens_map.json, the safetensors index and headers, the
stored tokenizer attribute, manifests); callers add the file's name. The HTTP side can parse request
bodies with it too and answer 400 with the message.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

# Hugging Face files nest fewer than 10 levels, JSON schemas of tools a few dozen; the tokenizers package
# (serde_json) stops at 128 levels too, so nothing it would read is refused here
MAX_DEPTH = 128
_STRUCTURE = b'"[]{}'
_OTHER_BYTES = bytes(c for c in range(256) if c not in _STRUCTURE)


class JSONTextError(ValueError):
    """The text is not JSON hpcpipe reads: not UTF-8, not valid JSON, or nested too deep (the message says which)."""


def nesting_depth(text: str | bytes) -> int:
    """Return the deepest nesting of arrays and objects in JSON text (brackets inside strings do not count).

    Roughly: drop escaped backslashes, then escaped quotes (what is left of a string is its two quotes and
    the brackets inside it), keep only quotes and brackets; a bracket with an even number of quotes before it
    is outside every string; the depth is the largest running sum of +1 per opening, -1 per closing one.
    Bytes operations and NumPy only: 10 MB of tokenizer.json in about a tenth of a second.
    """
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
    if b"\\" in data:
        data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    data = data.translate(None, _OTHER_BYTES)
    if not data:
        return 0
    codes = np.frombuffer(data, dtype=np.uint8)
    outside = (np.cumsum(codes == ord('"'), dtype=np.int64) & 1) == 0
    opening = ((codes == ord("[")) | (codes == ord("{"))) & outside
    closing = ((codes == ord("]")) | (codes == ord("}"))) & outside
    return int(np.cumsum(opening.astype(np.int64) - closing, dtype=np.int64).max(initial=0))


def check_depth(text: str | bytes, max_depth: int = MAX_DEPTH) -> None:
    """Raise JSONTextError when JSON text nests arrays and objects deeper than ``max_depth`` (text parsed elsewhere,
    e.g. tokenizer.json by the tokenizers package)."""
    depth = nesting_depth(text)
    if depth > max_depth:
        raise JSONTextError(f"nests arrays and objects {depth} levels deep, over hpcpipe's limit of {max_depth}")


def loads(text: str | bytes, max_depth: int = MAX_DEPTH) -> Any:
    """Return the parsed JSON of text (str, or bytes as UTF-8); JSONTextError of one line when it is not JSON
    or nests arrays and objects deeper than ``max_depth``."""
    check_depth(text, max_depth)
    if isinstance(text, bytes | bytearray | memoryview):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise JSONTextError(f"is not valid JSON (not UTF-8 text at byte {exc.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise JSONTextError(f"is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except (ValueError, RecursionError) as exc:   # e.g. an integer of more than 4,300 digits
        raise JSONTextError(f"is not JSON hpcpipe reads ({' '.join(str(exc).split())[:200]})") from None
