"""Structured output of a served tiny Hugging Face llama (random weights: left alone it writes no JSON at all):
50 seeded sampled requests with a JSON schema all parse and validate against it (jsonschema), through both
endpoints, and come out the same when repeated; a schema the grammar library refuses is one 400."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from support.hf import bytelevel_tokenizer, save_model, save_tokenizer, tiny_model
from support.serve import Server

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("transformers")

CHAT = "{% for m in messages %}<|start|>{{ m['content'] }}<|end|>{% endfor %}<|start|>"
NAME = "llama"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "active"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    tok = bytelevel_tokenizer(["<|endoftext|>", "<|start|>", "<|end|>"], vocab_size=300)
    model = tiny_model("llama", vocab_size=tok.get_vocab_size(), bos_token_id=tok.token_to_id("<|start|>"),
                       eos_token_id=tok.token_to_id("<|end|>"), max_position_embeddings=256)
    directory = tmp_path_factory.mktemp("json") / NAME
    save_model(model, directory)
    save_tokenizer(tok, directory, {"chat_template": CHAT}, bos_token="<|start|>", eos_token="<|end|>")
    return directory


@pytest.mark.slow
def test_fifty_seeded_sampled_requests_with_a_schema_all_parse_and_validate(llama):
    with Server(2, llama, "--set", "parallel.pp=2") as server:
        client = server.client(timeout=120)

        def one(seed: int):
            if seed % 5 == 4:       # a fifth through chat
                r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "a person"}],
                                                   max_tokens=200, temperature=1.0, seed=seed, response_format=FORMAT)
                return r.choices[0].message.content, r.choices[0].finish_reason
            r = client.completions.create(model=NAME, prompt="A person as JSON:", max_tokens=200, temperature=1.0,
                                          seed=seed, extra_body={"response_format": FORMAT})
            return r.choices[0].text, r.choices[0].finish_reason

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(one, range(50)))
        for seed, (text, finish) in enumerate(answers):
            assert finish == "stop", (seed, text)          # ended by the grammar, not by max_tokens
            jsonschema.validate(json.loads(text), SCHEMA)
        assert len({text for text, _ in answers}) > 40     # sampled: they differ
        assert [one(seed) for seed in (3, 4)] == answers[3:5]     # seeded: the same again
        with pytest.raises(openai.BadRequestError, match="refused by llguidance"):
            client.completions.create(model=NAME, prompt="x", max_tokens=5, extra_body={"response_format": {
                "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "object", "required": 3}}}})
