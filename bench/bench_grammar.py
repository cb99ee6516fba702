"""Per-token cost of structured output's token mask: xgrammar, llguidance and outlines-core on one real tokenizer.

    python bench/bench_grammar.py [--vocab 32000] [--docs 40] [--out FILE.json]

The tokenizer is a byte-level BPE (GPT-2 / Llama 3 / Qwen2 style) trained here on the Python standard library's
sources (nothing is downloaded) and saved with a tiny transformers Llama, as a model directory would hold it.
For each library: the time to prepare the tokenizer once, to compile one JSON schema, and per token of a valid
document (teacher-forced: the canonical tokens of seeded random instances of the schema, compact separators)
the time to compute the next-token mask (a bitmask of the vocabulary) and to advance the matcher by the token,
as the last stage of `serve` does once per sampled token. Also ``{"type": "json_object"}`` (any JSON object)
where the library has it. Prints a table and writes the numbers as JSON with --out.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "role", "tags", "address", "score"],
    "additionalProperties": False,
}
WORDS = "alpha beta gamma delta pipeline stage rank tensor Zürich São Paulo 東京 data model token".split()


def instance(rng: random.Random) -> dict:
    """A random valid instance of SCHEMA (its properties in schema order)."""
    def words(k: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(k))
    return {"name": words(rng.randint(1, 3))[:40], "age": rng.randint(0, 150), "role": rng.choice(["admin", "user",
            "guest"]), "tags": [words(1) for _ in range(rng.randint(0, 4))],
            "address": {"city": words(rng.randint(1, 2)), "zip": f"{rng.randint(0, 99999):05d}"},
            "score": round(rng.uniform(-100, 100), rng.randint(0, 4))}


def train_tokenizer(vocab: int, directory: Path):
    """Train a byte-level BPE on the standard library's sources; save it with a tiny Llama in directory."""
    import torch
    import transformers as T
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    texts, size = [], 0
    for f in files:
        if size > 24_000_000:
            break
        t = f.read_text(errors="replace")
        texts.append(t)
        size += len(t)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    fast = T.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(str(directory))
    torch.manual_seed(0)
    config = T.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, eos_token_id=0)
    T.AutoModelForCausalLM.from_config(config).save_pretrained(str(directory))
    return T.AutoTokenizer.from_pretrained(str(directory))


class LLGuidance:
    """llguidance: LLTokenizer from tokenizer.json, LLMatcher, a NumPy int32 bitmask."""

    name = "llguidance"

    def __init__(self, fast, vocab: int):
        import llguidance
        self.L = llguidance
        self.tok = llguidance.LLTokenizer(fast.backend_tokenizer.to_str(), n_vocab=vocab,
                                          eos_token=fast.eos_token_id)
        self.mask = np.full((1, (vocab + 31) // 32), -1, dtype=np.int32)

    def compile(self, schema: dict | None):
        grammar = self.L.LLMatcher.grammar_from_json_schema(schema or {"type": "object"})
        self.L.LLMatcher(self.tok, grammar).is_error()
        return grammar

    def matcher(self, grammar):
        return self.L.LLMatcher(self.tok, grammar)

    def step(self, m, token: int) -> None:
        m.unsafe_compute_mask_ptr(self.mask.ctypes.data, self.mask.nbytes)
        if not (self.mask[0, token >> 5] >> (token & 31)) & 1 or not m.consume_token(token):
            raise AssertionError(f"llguidance refused token {token}: {m.get_error()}")


class XGrammar:
    """xgrammar: TokenizerInfo from the transformers tokenizer, GrammarCompiler, GrammarMatcher, a torch bitmask."""

    name = "xgrammar"

    def __init__(self, fast, vocab: int):
        import xgrammar
        self.X = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(fast, vocab_size=vocab)
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.mask = xgrammar.allocate_token_bitmask(1, vocab)

    def compile(self, schema: dict | None):
        if schema is None:
            return self.compiler.compile_builtin_json_grammar()
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))

    def matcher(self, grammar):
        return self.X.GrammarMatcher(grammar)

    def step(self, m, token: int) -> None:
        m.fill_next_token_bitmask(self.mask)
        if not m.accept_token(token):
            raise AssertionError(f"xgrammar refused token {token}")


class OutlinesCore:
    """outlines-core: a Vocabulary of the tokens' bytes, an Index per schema (its regex), a Guide, a bitmask."""

    name = "outlines-core"

    def __init__(self, fast, vocab: int):
        import outlines_core

        from hpcpipe.hf.simple_tokenizers import bytes_to_unicode
        self.O = outlines_core
        unbyte = {c: b for b, c in bytes_to_unicode().items()}
        tokens: dict[bytes, list[int]] = {}
        special = set(fast.all_special_ids)
        for text, i in fast.get_vocab().items():
            if i not in special:
                tokens.setdefault(bytes(unbyte[c] for c in text), []).append(i)
        self.vocabulary = outlines_core.Vocabulary(fast.eos_token_id, tokens)
        self.mask = np.zeros((vocab + 31) // 32, dtype=np.int32)

    def compile(self, schema: dict | None):
        from outlines_core.json_schema import build_regex_from_schema
        regex = build_regex_from_schema(json.dumps(schema or {"type": "object"}))
        return self.O.Index(regex, self.vocabulary)

    def matcher(self, grammar):
        return self.O.Guide(grammar)

    def step(self, m, token: int) -> None:
        m.write_mask_into(self.mask.ctypes.data, self.mask.size, 4)
        if not (self.mask[token >> 5] >> (token & 31)) & 1:
            raise AssertionError(f"outlines-core refused token {token}")
        m.advance(token)


def run(lib_class, fast, vocab: int, docs: list[list[int]], any_docs: list[list[int]]) -> dict:
    """Time one library: tokenizer set-up, compiles, per-token mask + advance over the documents."""
    t0 = time.perf_counter()
    lib = lib_class(fast, vocab)
    setup = time.perf_counter() - t0
    out = {"setup_s": setup}
    for label, schema, documents in (("schema", SCHEMA, docs), ("json_object", None, any_docs)):
        t0 = time.perf_counter()
        try:
            grammar = lib.compile(schema)
        except Exception as exc:  # noqa: BLE001 - reported in the table
            out[label] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
            continue
        compiled = time.perf_counter() - t0
        per = []
        for ids in documents:
            m = lib.matcher(grammar)
            for t in ids:
                t0 = time.perf_counter()
                lib.step(m, t)
                per.append(time.perf_counter() - t0)
        per.sort()
        out[label] = {"compile_s": compiled, "tokens": len(per), "median_us": 1e6 * statistics.median(per),
                      "mean_us": 1e6 * statistics.fmean(per), "p99_us": 1e6 * per[int(0.99 * (len(per) - 1))],
                      "max_us": 1e6 * per[-1]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--docs", type=int, default=40)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        fast = train_tokenizer(args.vocab, Path(tmp))
        print(f"tokenizer: byte-level BPE, {len(fast)} tokens, trained in {time.perf_counter() - t0:.1f} s")
    rng = random.Random(0)
    texts = [json.dumps(instance(rng), ensure_ascii=False, separators=(",", ":")) for _ in range(args.docs)]
    docs = [fast(t)["input_ids"] for t in texts]
    any_docs = [fast(json.dumps({"k": instance(rng), "list": [1, 2.5, None, True]}, ensure_ascii=False,
                                separators=(",", ":")))["input_ids"] for _ in range(args.docs // 4)]
    vocab = len(fast)
    results = {"vocab": vocab, "docs": args.docs, "libraries": {}}
    for lib_class in (LLGuidance, XGrammar, OutlinesCore):
        results["libraries"][lib_class.name] = r = run(lib_class, fast, vocab, docs, any_docs)
        print(f"{lib_class.name:14s} setup {r['setup_s']:.2f} s")
        for label in ("schema", "json_object"):
            s = r[label]
            if "error" in s:
                print(f"  {label:12s} {s['error']}")
            else:
                print(f"  {label:12s} compile {1e3 * s['compile_s']:9.1f} ms  per token median {s['median_us']:7.1f} us"
                      f"  mean {s['mean_us']:7.1f} us  p99 {s['p99_us']:8.1f} us  max {s['max_us']:8.1f} us"
                      f"  ({s['tokens']} tokens)")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
