"""What a new user of the serving docs ran into (HTTP front end, no MPI): each test failed before its fix."""

from __future__ import annotations

import pytest
from http_harness import MODEL


def _stream(s, options: dict):
    return s.post({"prompt": "ab", "max_tokens": 2, "stream": True, "stream_options": options})


def test_a_misspelt_stream_option_is_a_400_naming_it(served):
    s = served()
    status, _, body = _stream(s, {"include_usag": True})   # was: 200, and the usage chunk silently left out
    assert status == 400 and body["error"]["param"] == "stream_options", body
    assert body["error"]["message"].startswith(
        "unknown field stream_options.include_usag: did you mean 'include_usage'?"), body
    status, _, body = _stream(s, {"include_usage": True, "include_obfuscation": "no"})
    assert status == 400 and "include_obfuscation must be true or false, got 'no'" in body["error"]["message"]
    assert s.engine.taken == {} and s.broker.outstanding == 0


def test_openais_stream_options_are_accepted(served):
    s = served()
    chunks = list(s.client.completions.create(model=MODEL, prompt="ab", max_tokens=2, stream=True,
                                              stream_options={"include_usage": True, "include_obfuscation": False}))
    assert chunks[-1].usage.total_tokens == 4
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "ba"


def test_a_text_part_without_its_text_says_so():
    from hpcpipe.hf.chat import ChatError, validate_messages
    for part, got in (({"type": "text"}, "missing"), ({"type": "text", "text": 5}, "a int")):
        with pytest.raises(ChatError) as e:     # was: 'must be {"type": "text", ...}, got type 'text''
            validate_messages([{"role": "user", "content": [part]}])
        assert str(e.value) == (f'messages[0].content[0] is a text part whose "text" is {got}: send '
                                '{"type": "text", "text": "..."} with a string')
    with pytest.raises(ChatError, match=r"only text is supported\), got type 'image_url'"):
        validate_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    assert validate_messages([{"role": "user", "content": [{"type": "text", "text": "a"}]}])[0]["content"] == "a"


def test_the_openai_clients_models_retrieve_finds_the_served_model(served):
    import openai
    s = served()
    model = s.client.models.retrieve(MODEL)            # was: 404 "no such endpoint: GET /v1/models/tiny-gpt"
    assert (model.id, model.object, model.owned_by) == (MODEL, "model", "hpcpipe")
    assert model.created == s.client.models.list().data[0].created
    with pytest.raises(openai.NotFoundError, match="The model `gpt-4o` does not exist"):
        s.client.models.retrieve("gpt-4o")
    status, _, body = s.request("GET", "/v1/models/org/name")
    assert status == 404 and body["error"]["code"] == "model_not_found", body


def test_an_authorization_header_without_bearer_is_named_not_called_missing(served):
    s = served(api_key="sekrit")
    for header, start in (({"Authorization": "sekrit"}, "the Authorization header is not 'Bearer <key>'"),
                          ({"Authorization": "Basic c2Vrcml0"}, "the Authorization header is not 'Bearer <key>'"),
                          ({}, "no API key given")):       # was: "no API key given" for all three
        status, _, body = s.request("GET", "/v1/models", headers=header)
        assert status == 401 and body["error"]["message"].startswith(start), body
        assert "sekrit" not in body["error"]["message"] and body["error"]["code"] == "invalid_api_key"
    assert s.client.models.list().data[0].id == MODEL


def test_a_bad_response_format_names_the_field_once(served):
    s = served()
    for fmt, start in (({"type": "bogus"}, "response_format.type must be"),
                       ("json", "response_format must be an object"),
                       ({"type": "json_schema"}, "response_format.json_schema must be an object")):
        status, _, body = s.post({"prompt": "ab", "max_tokens": 2, "response_format": fmt})
        # was: "response_format: response_format.type must be ..."
        assert status == 400 and body["error"]["message"].startswith(start), body
        assert body["error"]["param"] == "response_format"


def test_a_one_token_prompt_too_long_with_max_tokens_is_one_token(served):
    s = served(seq_len=64)
    status, _, body = s.post({"prompt": "a", "max_tokens": 64})
    assert status == 400 and body["error"]["message"].startswith(        # was: "prompt has 1 tokens"
        "prompt has 1 token and max_tokens is 64: 1 + 64 = 65 exceeds the model's context length of 64 tokens"), body
    status, _, body = s.post({"prompt": "ab", "max_tokens": 63})
    assert status == 400 and body["error"]["message"].startswith("prompt has 2 tokens and max_tokens is 63"), body


def test_top_k_minus_one_is_off_as_in_vllm(served):
    s = served()
    unlimited = s.client.completions.create(model=MODEL, prompt="abc", max_tokens=3, seed=5,
                                            extra_body={"top_k": -1})      # was: 400 "top_k must be ... got -1"
    assert unlimited.choices[0].text == "cba"
    assert [r.params.top_k for r in s.engine.taken.values()] == [0]
    for bad in (-2, 257, 1.5):
        status, _, body = s.post({"prompt": "ab", "max_tokens": 2, "top_k": bad})
        assert status == 400 and body["error"]["message"].startswith(
            "top_k must be an integer in [0, 256] (0 or -1 = off"), body


def test_a_chat_chunk_bringing_only_logprob_rows_has_empty_content():
    from hpcpipe.serve.responses import ChatShape
    from hpcpipe.serve.token_text import TokenTexts
    from hpcpipe.state.tokenizer import Tokenizer
    head = {"cid": "chatcmpl-1", "created": 0, "model": MODEL, "texts": TokenTexts(Tokenizer("chars", "abc"))}
    held = ChatShape().chunk(head, 0, "", None, rows=[(1, -0.5, [(1, -0.5)])])   # the token's text is held back
    choice = held["choices"][0]
    assert choice["delta"] == {"content": ""}, choice        # was: {} (delta.content None for the openai client)
    assert choice["logprobs"]["content"][0]["token"] == "b"
    assert ChatShape().chunk(head, 0, "", "length")["choices"][0]["delta"] == {}     # the finishing chunk: none
    assert ChatShape().chunk(head, 0, "ab", None)["choices"][0]["delta"] == {"content": "ab"}


def test_a_prompt_longer_than_the_context_is_not_told_to_lower_max_tokens(served):
    s = served(seq_len=64)
    status, _, body = s.post({"prompt": "x" * 100, "max_tokens": 3})
    # was: "prompt has 100 tokens and max_tokens is 3: ... shorten the prompt or lower max_tokens"
    assert status == 400 and body["error"]["param"] == "prompt", body
    assert body["error"]["message"] == ("prompt has 100 tokens, which leaves no room in the model's context of 64 "
                                        "tokens (at most 63 prompt tokens with max_tokens >= 1); shorten the prompt")
    status, _, body = s.post({"prompt": ["ab", "x" * 64], "max_tokens": 1})
    assert status == 400 and body["error"]["message"].startswith("prompt[1] has 64 tokens, which leaves no room")
    from hpcpipe.serve.openai_schema import parse_completion
    from hpcpipe.state.tokenizer import Tokenizer
    spec = parse_completion({"prompt": "x" * 64, "max_tokens": 0, "echo": True}, Tokenizer("bytes"), 64)
    assert spec.prompts == [[ord("x")] * 64] and spec.max_tokens == 0     # the prompt alone fits, echoed
