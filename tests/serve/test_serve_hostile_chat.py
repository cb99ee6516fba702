"""A careless chat client against the real server on a tiny Hugging Face llama (`python -m hpcpipe.serve`, one
rank): each test failed before its fix, and the server goes on answering after each."""

from __future__ import annotations

import openai
import pytest
from support.hf import bytelevel_tokenizer, save_model, save_tokenizer, tiny_model
from support.serve import Server

pytest.importorskip("transformers")

NAME = "llama"
# a template with a role of its own (Llama 3.1's 'ipython') and a key of its own ('header')
CHAT = ("{% for m in messages %}<|start|>{% if m['role'] == 'ipython' %}tool {% endif %}"
        "{% if m.header %}{{ m.header }} {% endif %}{{ m['content'] }}<|end|>{% endfor %}<|start|>")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tok = bytelevel_tokenizer(["<|endoftext|>", "<|start|>", "<|end|>"], vocab_size=300)
    model = tiny_model("llama", vocab_size=tok.get_vocab_size(), bos_token_id=tok.token_to_id("<|start|>"),
                       eos_token_id=tok.token_to_id("<|end|>"), max_position_embeddings=128)
    directory = tmp_path_factory.mktemp("chat") / NAME
    save_model(model, directory)
    save_tokenizer(tok, directory, {"chat_template": CHAT}, bos_token="<|start|>", eos_token="<|end|>")
    with Server(1, directory) as s:
        yield s


def chat(server, messages, **kw):
    return server.client(timeout=60).chat.completions.create(model=NAME, messages=messages, max_tokens=3,
                                                             temperature=0, **kw)


@pytest.mark.parametrize("message,words", [
    ({"role": "usr", "content": "hi"}, "messages[0].role 'usr' is not a known role: did you mean 'user'?"),
    ({"role": "wizard", "content": "hi"}, "messages[0].role 'wizard' is not a known role (OpenAI's roles are"),
    ({"role": "user", "content": "hi", "nmae": "bob"}, "messages[0] has an unknown key 'nmae': did you mean 'name'?"),
    ({"role": "user", "content": "hi", "temperature": 0}, "messages[0] has an unknown key 'temperature' (a message"),
    ({"role": "user", "content": []}, "messages[0].content is an empty list: send a string, or at least one"),
])
def test_an_unknown_role_or_message_key_is_a_400_naming_it(server, message, words):
    # was: 200, the role or key silently rendered as something else (or dropped)
    with pytest.raises(openai.BadRequestError) as e:
        chat(server, [{"role": "system", "content": "be brief"}, message][1:])
    assert e.value.body["message"].startswith(words) and e.value.body["param"] == "messages", e.value.body
    assert chat(server, [{"role": "user", "content": "hi"}]).choices[0].finish_reason in ("length", "stop")


def test_openais_roles_and_keys_and_the_templates_own_are_taken(server):
    messages = [{"role": "developer", "content": "a"}, {"role": "system", "content": "b"},
                {"role": "user", "content": "c", "name": "bob"},
                {"role": "assistant", "content": "d", "reasoning_content": "e"},
                {"role": "ipython", "content": "f", "header": "g"}, {"role": "user", "content": "h"}]
    done = chat(server, messages)
    assert done.usage.prompt_tokens > 0 and done.choices[0].finish_reason in ("length", "stop")


def test_a_template_that_writes_whole_messages_takes_any_key():
    from hpcpipe.serve.chat_fields import reads_any_key
    for template in ("{{ messages | tojson }}", "{% for m in messages %}{{ m|tojson }}{% endfor %}",
                     "{% for message in messages %}{% for k, v in message.items() %}{{ k }}{% endfor %}{% endfor %}"):
        assert reads_any_key(template), template
    assert not reads_any_key(CHAT) and not reads_any_key("{{ tools | tojson }}{% for m in messages %}{{ m.content }}"
                                                         "{% endfor %}")
