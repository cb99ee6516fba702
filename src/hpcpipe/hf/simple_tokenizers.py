"""hpcpipe's bytes and chars tokenizers written as Hugging Face tokenizer files, for `export --format hf`.

A model trained here on bytes or chars goes back to the ecosystem with a tokenizer.json that the
``tokenizers`` package (and ``AutoTokenizer``) encodes to the same ids:

* bytes: a byte-level BPE with the 256 single bytes as its vocabulary (id = byte value, GPT-2's byte
  to unicode mapping) and no merges, so every byte is one token and decoding joins the bytes;
* chars: a BPE whose vocabulary is the characters (id = position) and no merges, joined by a Fuse
  decoder. Characters outside the vocabulary are dropped by the tokenizers package (hpcpipe refuses them).
"""

from __future__ import annotations

import json
from typing import Any


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of the 256 byte values to printable unicode characters (byte-level BPE)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def tokenizer_json_for(tokenizer: Any) -> str:
    """Return the tokenizer.json text of an hpcpipe bytes or chars tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if tokenizer.kind == "bytes":
        vocab = {char: b for b, char in bytes_to_unicode().items()}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
    elif tokenizer.kind == "chars":
        tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(tokenizer.chars)}, merges=[]))
        tok.decoder = decoders.Fuse()
    else:
        raise ValueError(f"tokenizer: no Hugging Face form for kind {tokenizer.kind!r}")
    return tok.to_str()


def tokenizer_files_for(tokenizer: Any) -> dict[str, bytes]:
    """Return {tokenizer.json, tokenizer_config.json} of an hpcpipe bytes or chars tokenizer."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    return {"tokenizer.json": tokenizer_json_for(tokenizer).encode(),
            "tokenizer_config.json": (json.dumps(config, indent=2) + "\n").encode()}
