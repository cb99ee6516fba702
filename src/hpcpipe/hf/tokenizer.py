"""A Hugging Face model's tokenizer (tokenizer.json through the ``tokenizers`` package), encoding and decoding as
transformers 5's ``AutoTokenizer`` does, its files carried inside hpcpipe HDF5 files, and streaming decode.

What transformers' ``TokenizersBackend`` (``PreTrainedTokenizerFast``) does on top of tokenizer.json, and so do we:
truncation and padding stored in tokenizer.json are off for a plain call; ``add_bos_token`` / ``add_eos_token`` of
tokenizer_config.json are dropped whenever tokenizer.json exists (its post-processor alone decides whether BOS/EOS
are added); the ``added_tokens_decoder`` of tokenizer_config.json and every named special token (bos, eos, unk,
sep, pad, cls, mask, the extra and model-specific ones; special_tokens_map.json when the config has no
``added_tokens_decoder``) are added to the vocabulary as transformers adds them; ``decode`` skips special tokens
and applies ``clean_up_tokenization_spaces`` only to non-BPE models, as transformers 5 does.

Inside an hpcpipe weights file or checkpoint the files are stored by :mod:`hpcpipe.state.tokenizer` (the root
attribute ``tokenizer`` is ``{"kind": "hf"}``); here they are read from and written to model directories.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from hpcpipe.errors import ConfigError
from hpcpipe.hf import backend
from hpcpipe.hf.config import token_ids
from hpcpipe.hf.json_text import JSONTextError, check_depth, loads
from hpcpipe.hf.model_files import model_file

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "config.json")
KIND_JSON = json.dumps({"kind": "hf"})
_CLEANUPS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
             (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


class HFTokenizer:
    """A Hugging Face tokenizer from its files ({file name: bytes}); the interface of hpcpipe's Tokenizer where it
    makes sense (``kind``, ``vocab_size``, ``encode``, ``decode``, ``to_json``) plus streaming and special tokens."""

    kind = "hf"

    def __init__(self, files: dict[str, bytes], source: str = "tokenizer files"):
        self.files = {name: bytes(data) for name, data in files.items()}
        self.source = source
        raw = self.files.get("tokenizer.json")
        if raw is None:
            raise ConfigError(f"{source}: no tokenizer.json (hpcpipe reads fast tokenizers' tokenizer.json only)")
        config = self._json("tokenizer_config.json") or {}
        model_config = self._json("config.json") or {}
        if not isinstance(config, dict) or not isinstance(model_config, dict):
            raise ConfigError(f"{source}: tokenizer_config.json and config.json must hold JSON objects")
        try:
            text = raw.decode("utf-8")
            check_depth(text)     # the tokenizers package parses it: refused here in one line
        except UnicodeDecodeError:
            raise ConfigError(f"{source}: tokenizer.json is not UTF-8 text") from None
        except JSONTextError as exc:
            raise ConfigError(f"{source}: tokenizer.json {exc}") from None
        self.config = config
        self.backend_class = backend.tokenizer_class(config, model_config, text)
        doc = self._json("tokenizer.json") if self.backend_class in backend.CLASS_DEFAULTS else {}
        try:
            self._tok = backend.build(self.backend_class, text, doc if isinstance(doc, dict) else {}, config)
        except Exception as exc:   # the Rust side raises its own Exception type
            reason = " ".join(str(exc).split()) or type(exc).__name__
            raise ConfigError(f"{source}: tokenizer.json is not a tokenizer the tokenizers package reads "
                              f"({reason})") from None
        self._tok.no_truncation()
        self._tok.no_padding()
        self.special_tokens_map = backend.add_config_tokens(self._tok, self.backend_class, config,
                                                            self._json("special_tokens_map.json"))
        self._tok.encode_special_tokens = bool(config.get("split_special_tokens", False))
        self._cleanup = bool(config.get("clean_up_tokenization_spaces", False)) and (
            type(self._tok.model).__name__ != "BPE"
            or bool(config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")))
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self._vocab_size = max(vocab.values(), default=-1) + 1
        fallback = getattr(self._tok.model, "byte_fallback", False)   # <0xNN> tokens: a run decodes as a whole
        self._byte_ids = frozenset(vocab[t] for t in (f"<0x{b:02X}>" for b in range(256)) if t in vocab) \
            if fallback else frozenset()
        self.bos_token = self.special_tokens_map.get("bos_token")
        self.eos_token = self.special_tokens_map.get("eos_token")
        self.bos_id = self._tok.token_to_id(self.bos_token) if self.bos_token is not None else None
        self.eos_id = self._tok.token_to_id(self.eos_token) if self.eos_token is not None else None
        gen = self._json("generation_config.json") or {}
        where, value = ("generation_config.json", gen.get("eos_token_id")) if isinstance(gen, dict) else ("", None)
        if value is None:
            where, value = "config.json", model_config.get("eos_token_id")
        ids = token_ids(value, f"{source}: {where} eos_token_id")
        self.eos_ids: tuple[int, ...] = ids or ((self.eos_id,) if self.eos_id is not None else ())

    def _json(self, name: str) -> Any:
        """Return the parsed JSON of one of the files, None when absent; ConfigError naming it when invalid."""
        data = self.files.get(name)
        if data is None:
            return None
        try:
            return loads(data)
        except JSONTextError as exc:
            raise ConfigError(f"{self.source}: {name} {exc}") from None

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows (largest id + 1, added tokens included)."""
        return self._vocab_size

    def id_to_token(self, token_id: int) -> str | None:
        """Return the text of a token id (added and special tokens included), or None."""
        return self._tok.id_to_token(int(token_id))

    def token_to_id(self, token: str) -> int | None:
        """Return the id of a token's text, or None."""
        return self._tok.token_to_id(token)

    def tokenizer_json(self) -> str:
        """Return the tokenizer.json text of the tokenizer as built here (added and special tokens included)."""
        return self._tok.to_str()

    def encode(self, text: str, add_special_tokens: bool = True) -> np.ndarray:
        """Return the int64 token ids of text, as ``AutoTokenizer(text)["input_ids"]`` (a rendered chat prompt is
        encoded with add_special_tokens=False, as ``apply_chat_template`` does)."""
        if not isinstance(text, str):
            raise ValueError(f"tokenizer: encode needs a str, got {type(text).__name__}")
        return np.asarray(self._tok.encode(text, add_special_tokens=add_special_tokens).ids, dtype=np.int64)

    def _ids(self, ids) -> list[int]:
        """Return ids as a list of ints; ValueError unless they are non-negative integers."""
        a = np.asarray(ids)
        if a.size == 0:
            return []
        if a.dtype == bool or not np.issubdtype(a.dtype, np.integer):
            raise ValueError(f"tokenizer: decode needs integer ids, got dtype {a.dtype}")
        a = a.reshape(-1)
        bad = (a < 0) | (a > 0xFFFFFFFF)
        if bad.any():
            raise ValueError(f"tokenizer: token id {int(a[bad][0])} is negative or too large")
        return a.tolist()

    def decode_raw(self, ids) -> str:
        """Return the text of ids with special tokens skipped, before transformers' clean-up of spaces."""
        return self._tok.decode(self._ids(ids), skip_special_tokens=True)

    def decode(self, ids) -> str:
        """Return the text of ids as ``decode(ids, skip_special_tokens=True)`` (ids it does not know are skipped)."""
        text = self.decode_raw(ids)
        return clean_up(text) if self._cleanup else text

    def incremental_decoder(self, context=()) -> IncrementalDecoder:
        """Return a streaming decoder for one generation (see :class:`IncrementalDecoder`)."""
        return IncrementalDecoder(self, context)

    def to_json(self) -> str:
        """Return the JSON text stored as the ``tokenizer`` root attribute: ``{"kind": "hf"}``."""
        return KIND_JSON

    def __eq__(self, other) -> bool:
        return isinstance(other, HFTokenizer) and self.files == other.files

    def __hash__(self) -> int:
        return hash(self.files.get("tokenizer.json"))

    def __repr__(self) -> str:
        return f"HFTokenizer({self.source!r}, vocab_size={self.vocab_size})"


def clean_up(text: str) -> str:
    """Return text with transformers' clean_up_tokenization applied (spaces before punctuation and contractions)."""
    for old, new in _CLEANUPS:
        text = text.replace(old, new)
    return text


class IncrementalDecoder:
    """Token ids in, text out, for streaming: whole characters only, nothing emitted twice.

    ``decode(ids)`` returns the new text certain after these ids. A byte-level token may hold part of a UTF-8
    character: text ending in U+FFFD (an incomplete character) is held back until a later token completes it,
    or until ``decode(..., final=True)`` / :meth:`finish`; with byte fallback (``<0xNN>`` tokens, Llama 2 style)
    a run of byte tokens is held until it ends, as the decoder reads it as a whole. Each step decodes a short
    window of recent ids
    (from the last point where emitted text ended), so a long generation costs no more per token than a short
    one; the concatenation of all pieces is ``tokenizer.decode(all ids)``. ``context`` (the last prompt ids)
    makes the first generated token decode as it does after the prompt (e.g. keep its leading space) instead.
    """

    def __init__(self, tokenizer: HFTokenizer, context=()):
        self._tok = tokenizer
        self._ids = [int(i) for i in np.asarray(context, dtype=np.int64).reshape(-1)[-6:]]
        self._prefix, self._read = 0, len(self._ids)
        self._full = tokenizer._cleanup   # the clean-up rewrites across pieces: decode all ids, hold the last word
        self._start = len(self._ids)
        self.text = ""

    def decode(self, ids, final: bool = False) -> str:
        """Return the text that is certain after these ids ('' while a character is incomplete)."""
        self._ids.extend(self._tok._ids(ids))
        if self._full:
            return self._decode_full(final)
        if not final and self._ids and self._ids[-1] in self._tok._byte_ids:
            return ""   # byte fallback decodes a run of byte tokens as a whole (U+FFFD each if invalid): wait
        before = self._tok.decode_raw(self._ids[self._prefix:self._read])
        after = self._tok.decode_raw(self._ids[self._prefix:])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")) and after.startswith(before):
            piece = after[len(before):]
            self._prefix, self._read = self._read, len(self._ids)
        elif final and len(after) > len(before):   # a decoder that rewrote earlier text: emit what is new
            piece = after[len(before):]
        else:
            return ""
        self.text += piece
        return piece

    def _decode_full(self, final: bool) -> str:
        """Decode every id with clean-up; emit only up to the last space unless final (clean-up may change it)."""
        text = self._tok.decode(self._ids[self._start:])
        if not final:
            text = text[:max(text.rfind(" "), 0)]
        if len(text) <= len(self.text) or not text.startswith(self.text):
            return ""
        piece = text[len(self.text):]
        self.text = text
        return piece

    def finish(self) -> str:
        """Return the rest of the text at the end of generation (an incomplete character is then U+FFFD)."""
        return self.decode([], final=True)


def from_files(files: dict[str, bytes], source: str = "tokenizer files") -> HFTokenizer:
    """Return the HFTokenizer of a {file name: bytes} set (as :func:`tokenizer_files` or the HDF5 group give)."""
    return HFTokenizer(files, source)


def tokenizer_files(directory: str | Path) -> dict[str, bytes]:
    """Return the tokenizer files of a model directory ({name: bytes}, tokenizer.json required).

    config.json travels too (it is small): its model_type decides which class AutoTokenizer would use, and its
    eos_token_id is the stop ids' fallback when there is no generation_config.json.
    """
    d = Path(directory)
    if not d.is_dir():
        raise ConfigError(f"Hugging Face model directory {str(d)!r} " + ("is not a directory" if d.exists()
                                                                          else "does not exist"))
    found = {name: model_file(d, name, "tokenizer file") for name in TOKENIZER_FILES}   # links out are refused
    if found["tokenizer.json"] is None:
        raise ConfigError(f"{str(d)!r} has no tokenizer.json (hpcpipe reads fast tokenizers' tokenizer.json; "
                          f"a tokenizer.model or vocab.json alone is not enough)")
    files = {}
    for name, path in found.items():
        if path is not None:
            try:
                files[name] = path.read_bytes()
            except OSError as exc:
                raise ConfigError(f"{str(path)!r} cannot be read: {exc.strerror or exc}") from None
    return files


def load_tokenizer(directory: str | Path) -> HFTokenizer:
    """Return the HFTokenizer of a Hugging Face model directory."""
    return from_files(tokenizer_files(directory), f"Hugging Face model directory {str(directory)!r}")


def plain_name(name: str) -> bool:
    """Whether a file name is safe as a dataset name and as a file in a directory."""
    return bool(name) and "/" not in name and "\\" not in name and name not in (".", "..")


def write_tokenizer_dir(directory: str | Path, files: dict[str, bytes]) -> None:
    """Write tokenizer files into a directory (each via a temporary name and a rename), for export."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        if not plain_name(name):
            raise ValueError(f"tokenizer: {name!r} is not a plain file name")
        tmp = d / f".{name}.tmp-{os.getpid()}"
        try:
            tmp.write_bytes(data)
            os.replace(tmp, d / name)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
