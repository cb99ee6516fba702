"""A hostile or careless client against the real server (`python -m hpcpipe.serve`, one rank, a chars tokenizer):
each test failed before its fix, and every test checks that the server still answers others after it."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from support.serve import Server, make_weights

from hpcpipe.serve.grammar import Constraint, compile_format
from hpcpipe.state.tokenizer import Tokenizer

NAME = "tiny.h5"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("hostile") / NAME
    make_weights(path, seq_len=64)          # chars " a-z.,!?'": no '{', no '"', no digits
    with Server(1, path) as s:
        yield s


def post(server, body: dict, path: str = "/v1/completions") -> tuple[int, dict]:
    """POST body as JSON; return (status, parsed JSON answer)."""
    request = urllib.request.Request(server.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def still_serves(server) -> None:
    status, body = post(server, {"prompt": "hello", "max_tokens": 3, "temperature": 0})
    assert status == 200 and body["choices"][0]["finish_reason"] == "length", body


@pytest.mark.parametrize("fmt,needs", [
    ({"type": "json_object"}, "'{'"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": ["abc", 5]}}}, "no token"),
])
def test_a_format_the_chars_tokenizer_cannot_write_is_a_400_naming_why(server, fmt, needs):
    # was: 500 "the engine failed while generating", and a 90-line panic (llguidance's state) in the log
    status, body = post(server, {"prompt": "hello", "max_tokens": 5, "response_format": fmt})
    assert status == 400 and body["error"]["param"] == "response_format", body
    message = body["error"]["message"]
    assert message.startswith("response_format: this model's chars tokenizer cannot write") and needs in message
    assert "\n" not in message and len(message) < 400
    still_serves(server)
    assert "panic" not in server.output() and "<state>" not in server.output()


def test_a_grammar_that_runs_into_a_missing_character_fails_in_one_line():
    tok = Tokenizer("chars", ' {}"a')                    # an object can start, but ':' after a key cannot follow
    c = Constraint(compile_format({"type": "json_object"}, tok), tok)
    for ch in '{"a"':
        c.accept(int(tok.encode(ch)[0]))
    with pytest.raises(ValueError) as e:                  # was: the library's panic with pages of its state
        c.allowed()
    assert str(e.value).startswith("the text the format needs next cannot be encoded: ") and "\n" not in str(e.value)
    assert "character ':' (U+003A)" in str(e.value)


@pytest.mark.parametrize("prompt,words", [
    ([1, 2, True], "prompt[2] must be a token id in [0, 32) (the tokenizer's vocabulary), got True"),
    ([1, 2, 1.0], "prompt[2] must be a token id in [0, 32) (the tokenizer's vocabulary), got 1.0"),
    ([3, "a"], "prompt[1] must be a token id in [0, 32) (the tokenizer's vocabulary), got 'a'"),
])
def test_a_token_id_prompt_names_the_entry_that_is_no_token_id(server, prompt, words):
    # was: "prompt[0] must be a string, a token id or a list of token ids, got int" (prompt[0] is a token id)
    status, body = post(server, {"prompt": prompt, "max_tokens": 2})
    assert status == 400 and body["error"]["message"] == words, body
    still_serves(server)


@pytest.mark.parametrize("fmt,words", [
    ({"type": "json_object", "schema": {"type": "object", "required": ["a"]}},
     "response_format has an unknown key 'schema' (with type 'json_object' it takes type): a schema goes in "
     "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}"),
    ({"type": "text", "json_schema": {"name": "x", "schema": {}}}, "response_format has an unknown key 'json_schema'"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string"}, "strct": True}},
     "response_format.json_schema has an unknown key 'strct' (with type 'json_schema' it takes name, schema, strict, "
     "description)"),
])
def test_a_response_format_key_of_another_shape_is_a_400_naming_it(server, fmt, words):
    # was: 200 with the key ignored (a schema beside json_object: any object, or plain text, without a word)
    status, body = post(server, {"prompt": "hello", "max_tokens": 2, "response_format": fmt})
    assert status == 400 and body["error"]["message"].startswith(words), body
    still_serves(server)


def test_a_prompt_too_long_for_the_default_max_tokens_says_the_16_is_the_default(server):
    status, body = post(server, {"prompt": "a" * 50})
    # was: "max_tokens is 16: ..." to a client that sent no max_tokens
    assert status == 400 and body["error"]["message"].startswith(
        "prompt has 50 tokens and max_tokens is 16 (the default: the request sets none): 50 + 16 = 66 exceeds"), body
    status, body = post(server, {"prompt": "a" * 50, "max_tokens": 15})
    assert status == 400 and body["error"]["message"].startswith("prompt has 50 tokens and max_tokens is 15: "), body
    assert post(server, {"prompt": "a" * 48})[0] == 200
