"""Structured output through llguidance: a response_format becomes a grammar, a grammar a token mask per step.

Why llguidance (measured by ``bench/bench_grammar.py``, numbers in docs/serve.md): a JSON schema compiles in
milliseconds (xgrammar and outlines-core take most of a second, which the last stage would spend inside its
serving loop while every other sequence waits), its per-token mask costs tens of microseconds, it needs
neither torch nor a GPU (a NumPy bitmask), and it reads any tokenizer as a list of token bytes, hpcpipe's
bytes and chars tokenizers included.

Both sides use this module: the HTTP side turns a ``response_format`` into the grammar's JSON text and
checks it against the model's tokenizer (``compile_format``: a schema the library refuses is a 400); the
grammar text travels with the request's sampling parameters to the last stage, where each sequence gets
a ``Constraint`` that masks the logits before sampling and advances with the sampled token.

JSON is generated compactly, as ``json.dumps(obj, separators=(", ", ": "))`` writes it, without free
whitespace: a model cannot run into an endless run of blanks, so every document ends when its last
bracket closes (the sequence then finishes with "stop").
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

PACKAGE = "llguidance"
JSON_SCHEMA_KEYS = ("name", "schema", "strict", "description")     # OpenAI's json_schema object
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_lock = threading.Lock()
# id(tokenizer) -> (tokenizer, its LLTokenizer or the reason it has none, its _Tokens for bytes and chars or None)
_cache: dict[int, tuple[Any, Any, Any]] = {}
MATCHERS_KEPT = 16
_matchers: OrderedDict[tuple[int, str], Any] = OrderedDict()     # (id of its LLTokenizer, grammar) -> matcher


class GrammarError(ValueError):
    """A response_format or tokenizer the grammar library cannot serve; the message says why."""


def _library() -> Any:
    try:
        import llguidance
    except ImportError:
        raise GrammarError(f"structured output needs the {PACKAGE} package, which is not installed here: "
                           f"pip install {PACKAGE}") from None
    return llguidance


class _Tokens:
    """A bytes or chars tokenizer as llguidance's TokenizerWrapper reads one: each id's bytes, an end id after them.

    Neither kind has an end-of-sequence token: the id one past the vocabulary stands for it (the sampler never
    draws it), and a sequence ends when its grammar is complete.
    """

    def __init__(self, tokenizer: Any):
        if tokenizer.kind == "bytes":
            self.tokens = [bytes([b]) for b in range(256)]
        else:
            self.tokens = [c.encode("utf-8") for c in tokenizer.chars]
        self.eos_token_id = len(self.tokens)
        self.tokens.append(b"")
        self.bos_token_id = None
        self.special_token_ids = [self.eos_token_id]
        self._tokenizer = tokenizer
        self.refused = threading.local()      # .reason: why this thread's last encode failed (the library panics)

    def __call__(self, text: bytes | str) -> list[int]:
        text = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
        try:
            return [int(i) for i in self._tokenizer.encode(text)]
        except ValueError as exc:
            # llguidance turns this into a panic whose text is pages of state; keep the one line that says why
            self.refused.reason = f"{text!r}: {str(exc).removeprefix('tokenizer: ')}"
            raise


def lltokenizer(tokenizer: Any) -> Any:
    """Return llguidance's LLTokenizer of an hpcpipe tokenizer (built once, ~0.4 s for 32k tokens); GrammarError
    when the library cannot read it."""
    return _cached(tokenizer)[1]


def _cached(tokenizer: Any) -> tuple[Any, Any, Any]:
    """(tokenizer, LLTokenizer, _Tokens or None), built once; GrammarError when the library cannot read it."""
    with _lock:
        cached = _cache.get(id(tokenizer))
        if cached is None or cached[0] is not tokenizer:
            cached = _cache[id(tokenizer)] = (tokenizer, *_build(tokenizer))
    if isinstance(cached[1], str):
        raise GrammarError(cached[1])
    return cached


def _build(tokenizer: Any) -> tuple[Any, Any]:
    """(the LLTokenizer or the reason, a string, there is none; the _Tokens it reads, for bytes and chars)."""
    try:
        llg = _library()
    except GrammarError as exc:
        return str(exc), None
    try:
        if tokenizer.kind in ("bytes", "chars"):
            tokens = _Tokens(tokenizer)
            return llg.LLTokenizer(llg.TokenizerWrapper(tokens)), tokens
        eos = list(getattr(tokenizer, "eos_ids", ())) or None
        return llg.LLTokenizer(tokenizer.tokenizer_json(), n_vocab=tokenizer.vocab_size, eos_token=eos), None
    except Exception as exc:  # noqa: BLE001 - the library's own errors: the tokenizer is one it cannot read
        return f"{PACKAGE} cannot read this model's {tokenizer.kind} tokenizer ({exc})", None


def _known_keys(given: dict, known: tuple[str, ...], where: str, kind: str) -> None:
    """GrammarError naming the first key of ``given`` that is not in ``known``."""
    unknown = [key for key in given if key not in known]
    if unknown:
        hint = (": a schema goes in {\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}"
                if unknown[0] in ("schema", "json_schema") else "")
        raise GrammarError(f"{where} has an unknown key {unknown[0]!r} (with type {kind!r} it takes "
                           f"{', '.join(known)}){hint}")


def format_schema(response_format: Any) -> Any:
    """Return the JSON schema a response_format asks for (None for {"type": "text"}), its shape checked (cheap: no
    compiling); GrammarError names the problem."""
    if not isinstance(response_format, dict):
        raise GrammarError(f"response_format must be an object such as {{\"type\": \"json_object\"}}, got "
                           f"{type(response_format).__name__}")
    kind = response_format.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise GrammarError(f"response_format.type must be \"text\", \"json_object\" or \"json_schema\", got {kind!r}")
    # a key of another shape (a "schema" beside "json_object") was ignored: the client got no schema, silently
    _known_keys(response_format, ("type", "json_schema") if kind == "json_schema" else ("type",), "response_format",
                kind)
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict | bool):
        raise GrammarError("response_format.json_schema must be an object {\"name\": ..., \"schema\": "
                           "{...JSON Schema...}}")
    _known_keys(spec, JSON_SCHEMA_KEYS, "response_format.json_schema", kind)
    return spec.get("schema", {})


def compile_format(response_format: Any, tokenizer: Any) -> str:
    """Return the grammar (JSON text) of a response_format object, checked against tokenizer; GrammarError
    names the problem ("" for {"type": "text"}: no grammar). Compiling may take long for a large schema (3,000
    optional properties: about 2 s): the server runs it off its event loop, within a time limit."""
    schema = format_schema(response_format)
    if schema is None:
        return ""
    llg = _library()
    lltokenizer(tokenizer)
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"the JSON schema is refused by {PACKAGE}: {exc}") from None
    matcher = _base_matcher(grammar, tokenizer)     # compiled once: the check below and later sequences copy it
    if matcher.is_error():
        raise GrammarError(f"the JSON schema is refused by {PACKAGE}: "
                           f"{matcher.get_error().splitlines()[0][:300]}")
    _check_start(grammar, tokenizer)
    return grammar


def _base_matcher(grammar: str, tokenizer: Any) -> Any:
    """The library's matcher of grammar in its start state, compiled once per grammar (the last few kept): each
    sequence takes a copy (microseconds), so n choices or many requests with one schema compile it once."""
    _, lltok, _ = _cached(tokenizer)
    key = (id(lltok), grammar)
    with _lock:
        matcher = _matchers.pop(key, None)
    if matcher is None:
        matcher = _library().LLMatcher(lltok, grammar)
    with _lock:
        _matchers[key] = matcher
        while len(_matchers) > MATCHERS_KEPT:
            _matchers.popitem(last=False)
    return matcher


def _check_start(grammar: str, tokenizer: Any) -> None:
    """GrammarError when no token of the tokenizer may start the document (a chars tokenizer without '{' or '"'):
    such a request could only fail on the last stage, so it is refused before it is queued."""
    try:
        Constraint(grammar, tokenizer).allowed()
    except ValueError as exc:
        raise GrammarError(f"this model's {tokenizer.kind} tokenizer cannot write it: {exc}") from None


class Constraint:
    """One sequence's grammar on the last stage: which ids may come next, and the state after each sampled one."""

    def __init__(self, grammar: str, tokenizer: Any, vocab: int | None = None):
        _, lltok, self._tokens = _cached(tokenizer)
        self.vocab = tokenizer.vocab_size if vocab is None else vocab
        self.matcher = _base_matcher(grammar, tokenizer).deep_copy()
        # the masks cover the library's ids: the vocabulary, plus the stand-in end id of bytes and chars
        self._bits = np.zeros((lltok.vocab_size + 31) // 32, dtype=np.int32)
        self._check()

    def _check(self) -> None:
        if not self.matcher.is_error():
            return
        refused = getattr(self._tokens.refused, "reason", None) if self._tokens is not None else None
        if refused is not None:      # the text the grammar needs next has no tokens: say that, not the panic
            del self._tokens.refused.reason
            raise ValueError(f"the text the format needs next cannot be encoded: {refused}")
        first = self.matcher.get_error().splitlines()[0][:300]     # the rest is pages of the library's state
        if first == "NoExtensionBias":
            raise ValueError("no token of the tokenizer may come next (the text the format allows here has "
                             "characters the tokenizer lacks)")
        raise ValueError(f"grammar: {first}")

    @property
    def done(self) -> bool:
        """The grammar is complete: no token may follow (the sequence ends with "stop")."""
        return self.matcher.is_stopped()

    def allowed(self) -> np.ndarray:
        """Boolean (vocab,): the ids that may come next."""
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        self._check()
        return np.unpackbits(self._bits.view(np.uint8), bitorder="little")[:self.vocab].astype(bool)

    def accept(self, token: int) -> None:
        """Advance by the sampled token; ValueError if the grammar refuses it."""
        if not self.matcher.consume_token(int(token)):
            raise ValueError(f"grammar: token {token} is not allowed here ({self.matcher.get_error()})")
