"""Structured output through llguidance without a server: response_format compiled and checked (a schema the
library refuses names its reason), a grammar's token mask on hpcpipe's bytes and chars tokenizers and on a Hugging
Face byte-level BPE, seeded sampling under a schema always giving valid JSON; the request fields of both endpoints
(logprobs, top_logprobs, n, response_format) refused with one message naming the field."""

import json

import numpy as np
import pytest
from support.hf import bytelevel_tokenizer

from hpcpipe.hf.tokenizer import from_files
from hpcpipe.nn.core.decode import Segment
from hpcpipe.serve.api_error import ApiError
from hpcpipe.serve.chat_schema import parse_chat
from hpcpipe.serve.grammar import Constraint, GrammarError, compile_format
from hpcpipe.serve.last_stage import SamplerTable
from hpcpipe.serve.openai_schema import parse_completion
from hpcpipe.serve.request_options import choice_seed
from hpcpipe.serve.sampling import SamplingParams
from hpcpipe.serve.token_text import Offsets, TokenTexts
from hpcpipe.state.tokenizer import Tokenizer

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "kind": {"enum": ["a", "bb"]}, "ok": {"type": "boolean"}},
          "required": ["name", "n", "kind", "ok"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}
CHAT = "{% for m in messages %}<|start|>{{ m['content'] }}<|end|>{% endfor %}"


@pytest.fixture(scope="module")
def hf():
    tok = bytelevel_tokenizer(["<|endoftext|>", "<|start|>", "<|end|>"], vocab_size=300)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT, "eos_token": "<|end|>"}
    return from_files({"tokenizer.json": tok.to_str().encode(), "tokenizer_config.json": json.dumps(config).encode()})


def test_response_formats_compile_and_a_refused_schema_names_the_reason():
    tok = Tokenizer("bytes")
    assert compile_format({"type": "text"}, tok) == ""
    assert "json_schema" in compile_format({"type": "json_object"}, tok)
    assert compile_format(FORMAT, tok)
    for bad, words in [({"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}}, "Invalid type: strin"),
                       ({"type": "json_schema", "json_schema": {"schema": {"$ref": "#/no"}}}, "'/no' does not exist"),
                       ({"type": "json_schema", "json_schema": 3}, "must be an object"),
                       ({"type": "xml"}, "must be \"text\", \"json_object\" or \"json_schema\""),
                       ("json", "an object")]:
        with pytest.raises(GrammarError, match=words.replace("(", r"\(").replace("$", r"\$")):
            compile_format(bad, tok)


@pytest.mark.parametrize("kind", ["bytes", "chars", "hf"])
def test_the_mask_allows_a_valid_document_and_refuses_anything_else(kind, hf):
    chars = Tokenizer("chars", '{}[]":, 0123456789abdiknmeortuflsx')
    tok = {"bytes": Tokenizer("bytes"), "chars": chars, "hf": hf}[kind]
    grammar = compile_format(FORMAT, tok)
    text = '{"name": "ab", "n": 42, "kind": "bb", "ok": true}'
    c = Constraint(grammar, tok)
    assert not c.allowed()[int(tok.encode("[")[0])]                       # not an object
    for i, token in enumerate(tok.encode(text) if kind != "hf" else tok.encode(text, add_special_tokens=False)):
        assert c.allowed()[token], (kind, i)
        assert not c.done
        c.accept(int(token))
    assert c.done                                                         # the last bracket closed it
    c = Constraint(grammar, tok)
    for token in tok.encode('{"name": "ab", "n": '):
        c.accept(int(token))
    with pytest.raises(ValueError, match="not allowed"):
        c.accept(int(tok.encode("x")[0]))                                  # a letter where a number goes


def test_seeded_sampling_under_a_schema_gives_valid_json_every_time():
    tok = Tokenizer("bytes")
    grammar = compile_format(FORMAT, tok)
    rng = np.random.default_rng(0)
    texts = []
    for seed in range(20):
        table = SamplerTable(lambda x: x, 256, tok)
        table.start([(0, SamplingParams(temperature=1.0, seed=seed, grammar=grammar))])
        out = []
        for _ in range(200):
            tokens, details, _ = table.pick(rng.standard_normal((1, 256)) * 3, [Segment(0, len(out), 1)], [True])
            out.append(tokens[0])
            if details[0][2]:
                break
        text = bytes(out).decode("utf-8")
        jsonschema.validate(json.loads(text), SCHEMA)
        texts.append(text)
    assert len(set(texts)) > 15


def test_token_texts_and_offsets_name_partial_characters_as_openai_does(hf):
    texts = TokenTexts(hf)
    ids = [int(i) for i in hf.encode("café 😀", add_special_tokens=False)]
    assert b"".join(texts.bytes_of(i) for i in ids).decode() == "café 😀"
    assert any(texts.text(i).startswith("bytes:\\x") for i in ids)      # the emoji is split over byte tokens
    assert Offsets(texts).of([(i, None, None) for i in ids])[0] == 0
    chars = TokenTexts(Tokenizer("chars", "abc"))
    assert [chars.text(i) for i in range(3)] == ["a", "b", "c"]


def _bad(parse, body, tok, words, param):
    with pytest.raises(ApiError) as err:
        parse(body, tok, 64)
    assert err.value.status == 400 and words in err.value.message and err.value.param == param, err.value.message


def test_chat_and_completion_fields_are_checked_at_the_boundary(hf):
    msgs = [{"role": "user", "content": "hi"}]
    _bad(parse_chat, {"messages": msgs, "top_logprobs": 2}, hf, "needs \"logprobs\": true", "top_logprobs")
    _bad(parse_chat, {"messages": msgs, "logprobs": True, "top_logprobs": 21}, hf,
         "top_logprobs is 21 but at most 20", "top_logprobs")
    _bad(parse_chat, {"messages": msgs, "logprobs": 1}, hf, "logprobs must be true or false", "logprobs")
    _bad(parse_chat, {"messages": msgs, "n": 0}, hf, "n must be an integer in [1, 32]", "n")
    _bad(parse_chat, {"messages": msgs, "response_format": {"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "required": 3}}}}, hf, "refused by llguidance", "response_format")
    spec = parse_chat({"messages": msgs, "logprobs": True, "n": 3, "response_format": FORMAT}, hf, 64)
    assert spec.n == 3 and spec.params.logprobs == 0 and spec.params.grammar and not spec.params.prompt_logprobs
    spec = parse_completion({"prompt": [[5, 6], [7]], "echo": True, "logprobs": 2, "max_tokens": 0, "n": 2,
                             "seed": 9}, hf, 64)
    assert spec.prompts == [[5, 6], [7]] and spec.echo == [hf.decode([5, 6]), hf.decode([7])] and spec.n == 2
    assert spec.params.logprobs == 2 and spec.params.prompt_logprobs and spec.max_tokens == 0
    assert choice_seed(9, 0) == 9 and choice_seed(9, 1) != choice_seed(9, 2) and choice_seed(9, 1) == choice_seed(9, 1)
