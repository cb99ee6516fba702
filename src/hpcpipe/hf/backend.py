"""The ``tokenizers.Tokenizer`` that transformers 5's ``AutoTokenizer`` builds from a model's files, rebuilt here.

Many models load as ``TokenizersBackend``: tokenizer.json as written. Three classes rebuild the pipeline from
tokenizer.json's vocabulary and merges, keeping only its post-processor: ``LlamaTokenizer`` (Metaspace
pre-tokenizer, byte fallback; when tokenizer_config.json declares LlamaTokenizer[Fast] and tokenizer.json is
not byte-level, e.g. Llama 2), ``GPT2Tokenizer`` (byte-level; gpt2 models, or a declared GPT2Tokenizer) and
``Qwen2Tokenizer`` (NFC, Qwen's split regex, byte-level; every qwen2 model, whatever it declares). mistral
models load as ``TokenizersBackend`` (without mistral_common), and so does any class not named here.

Then, as transformers: tokenizer_config.json's ``add_bos_token`` / ``add_eos_token`` are dropped (tokenizer.json
exists, so its post-processor decides), the ``added_tokens_decoder`` tokens and every named special token (the
class's defaults where the config names none; special_tokens_map.json when the config has no
``added_tokens_decoder``) are added to the vocabulary, and the special tokens map (bos_token, eos_token, ...)
that chat templates see is returned.
"""

from __future__ import annotations

from typing import Any

from hpcpipe.nn.registry import KINDS

NAMED = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
BACKEND, LLAMA, GPT2, QWEN2 = "TokenizersBackend", "LlamaTokenizer", "GPT2Tokenizer", "Qwen2Tokenizer"
# transformers' model_type -> tokenizer class mapping (llama: none), as each kind's Hugging Face map states it
REGISTERED = {t: cls for k in KINDS.values() if k.hf is not None for t, cls in k.hf.tokenizer_classes.items()}
# MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS: the registered class, whatever is declared
FORCED = {t for k in KINDS.values() if k.hf is not None for t in k.hf.forced_tokenizer}
CLASS_DEFAULTS = {LLAMA: {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"},
                  GPT2: {"unk_token": "<|endoftext|>", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"},
                  QWEN2: {"unk_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}}
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"""
               r"""\s+(?!\S)|\s+""")
_TOKEN_FIELDS = ("single_word", "lstrip", "rstrip", "normalized", "special")


def tokenizer_class(tok_config: dict, model_config: dict, tokenizer_json: str) -> str:
    """Return the class AutoTokenizer loads: LlamaTokenizer, GPT2Tokenizer, Qwen2Tokenizer or TokenizersBackend
    (for anything else)."""
    if tok_config.get("auto_map"):   # remote code is never run: the file as written
        return BACKEND
    hub = tok_config.get("tokenizer_class") or model_config.get("tokenizer_class")
    hub = hub.removesuffix("Fast") if isinstance(hub, str) else None
    model_type = model_config.get("model_type")
    if hub == LLAMA and model_type not in FORCED and '"ByteLevel"' in tokenizer_json:   # Llama 3 style files
        return BACKEND
    registered = REGISTERED.get(model_type) if isinstance(model_type, str) else None
    if hub is not None and registered is not None and registered != hub:
        if registered == BACKEND:
            return BACKEND
        hub = registered if model_type in FORCED else hub
    name = hub if hub is not None else registered
    return name if name in CLASS_DEFAULTS else BACKEND


def _bpe_parts(doc: dict) -> tuple[dict[str, int], list[tuple[str, str]]] | None:
    """Return (vocab, merges) of a BPE tokenizer.json document, None for another model type."""
    model = doc.get("model") or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        return None
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model.get("merges") or []]
    return model["vocab"], merges


def build(cls: str, tokenizer_json: str, doc: dict, tok_config: dict):
    """Return the backend ``tokenizers.Tokenizer`` of class ``cls``: tokenizer.json as written, or the pipeline
    LlamaTokenizer, GPT2Tokenizer or Qwen2Tokenizer rebuild from its BPE vocabulary and merges."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    original = Tokenizer.from_str(tokenizer_json)
    parts = _bpe_parts(doc) if cls in CLASS_DEFAULTS else None
    if parts is None:
        return original
    vocab, merges = parts
    if cls == LLAMA:
        prefix = tok_config.get("add_prefix_space")
        prefix = True if prefix is None else bool(prefix)
        scheme = ("always" if tok_config.get("legacy", False) else "first") if prefix else "never"
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        tok.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1)] if prefix else []))
    else:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                                   end_of_word_suffix="", fuse_unk=False))
        prefix = bool(tok_config.get("add_prefix_space"))
        if cls == GPT2:
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=prefix)
        else:
            tok.normalizer = normalizers.NFC()
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=prefix, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
    tok.post_processor = original.post_processor
    if "added_tokens_decoder" not in tok_config:   # transformers then takes tokenizer.json's added tokens
        entries = sorted((t for t in doc.get("added_tokens") or [] if isinstance(t, dict)), key=lambda t: t["id"])
        if entries:
            tok.add_tokens([added_token(t) for t in entries])
    return tok


def content(value: Any) -> str | None:
    """Return the text of a special token given as a string or a serialized AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def added_token(value: Any, special: bool | None = None):
    """Return a tokenizers.AddedToken of a string or a serialized AddedToken dict."""
    from tokenizers import AddedToken
    if isinstance(value, str):
        return AddedToken(value, special=True, normalized=False) if special else AddedToken(value)
    props = {k: bool(value[k]) for k in _TOKEN_FIELDS if k in value}
    if special is not None:
        props["special"] = special
    return AddedToken(value["content"], **props)


def add_config_tokens(tok, cls: str, tok_config: dict, legacy_map: Any) -> dict[str, str]:
    """Add tokenizer_config.json's added and special tokens to ``tok`` as transformers does; return the special
    tokens map {attribute: token text} (named ones first, then model-specific ``*_token`` strings)."""
    decoder = tok_config.get("added_tokens_decoder")
    values = {k: v for k, v in CLASS_DEFAULTS.get(cls, {}).items() if k not in tok_config}
    values.update({k: v for k, v in tok_config.items()
                   if (k in NAMED and content(v) is not None) or (k.endswith("_token") and isinstance(v, str))})
    extra = tok_config.get("extra_special_tokens") or tok_config.get("additional_special_tokens") or []
    if not isinstance(decoder, dict):
        for key, value in (legacy_map.items() if isinstance(legacy_map, dict) else ()):
            if key in ("extra_special_tokens", "additional_special_tokens") and isinstance(value, list):
                extra = list(extra) + [t for t in value if t not in extra]
            elif key in NAMED and content(value) is not None:
                values[key] = value
        decoder = {}
    if isinstance(extra, dict):   # named model-specific tokens
        values.update({k: v for k, v in extra.items() if content(v) is not None})
        extra = []
    by_text = {}
    for _, entry in sorted(((int(i), e) for i, e in decoder.items() if content(e) is not None), key=lambda x: x[0]):
        by_text[entry["content"]] = entry
        tok.add_tokens([added_token(entry)])
    order = [k for k in NAMED if k in values] + [k for k in values if k not in NAMED]
    wanted = [values[k] for k in order] + [t for t in extra if content(t) is not None]
    if wanted:
        tok.add_special_tokens([added_token(by_text.get(content(v), v), special=True) for v in wanted])
    return {k: content(values[k]) for k in order}
