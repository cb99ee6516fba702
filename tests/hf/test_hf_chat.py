"""hf/chat.py: chat templates written in the test (Llama 3, ChatML as Qwen2, Mistral style) render exactly as
transformers' apply_chat_template(messages, add_generation_prompt=True, tokenize=False); the sandbox holds; every
problem is a one-line ChatError, and a model without a template is NoChatTemplate."""

import json

import pytest

T = pytest.importorskip("transformers")

from support.hf import bytelevel_tokenizer, save_tokenizer  # noqa: E402

from hpcpipe.hf.chat import ChatError, NoChatTemplate, apply_chat_template, chat_template, render_chat  # noqa: E402
from hpcpipe.hf.tokenizer import load_tokenizer, tokenizer_files  # noqa: E402

LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
          "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
          "{% endif %}")
LLAMA31_STYLE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{%- set ns = namespace(count=0) %}
<|start_header_id|>system<|end_header_id|>

Year: {{ strftime_now("%Y") }}
{{ system_message }}<|eot_id|>
{% for message in messages %}
    {% set ns.count = ns.count + 1 %}
    {% if message.role == 'assistant' %}
<|start_header_id|>assistant<|end_header_id|>

{% generation %}{{ message['content'] | trim }}{% endgeneration %}<|eot_id|>
    {% else %}
<|start_header_id|>{{ message['role'] }}<|end_header_id|>

{{ message['content'] | trim }}<|eot_id|>
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|start_header_id|>assistant<|end_header_id|>

{% endif %}
{{- ns.count }} {{ messages | tojson }} {{ dict(a=1) | tojson(indent=1) }}"""
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
MISTRAL = ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
           "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
           "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
           "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
           "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
CHATS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "Grüße 😀 日本語?"}],
    [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"},
     {"role": "user", "content": "three <|eot_id|> four\n\n  five  "}],
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    def make(template, name, jinja=None, **special):
        d = tmp_path_factory.mktemp(name)
        save_tokenizer(bytelevel_tokenizer(SPECIALS), d, config_extra={"chat_template": template} if template else None,
                       **special)
        if jinja is not None:
            (d / "chat_template.jinja").write_text(jinja)
        return d
    return make


@pytest.mark.parametrize("template, special", [
    (LLAMA3, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    (LLAMA31_STYLE, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    (CHATML, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
])
def test_rendering_equals_transformers(tok_dir, template, special):
    d = tok_dir(template, "t", **special)
    auto, ours = T.AutoTokenizer.from_pretrained(str(d)), load_tokenizer(d)
    for messages in CHATS:
        want = auto.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert apply_chat_template(ours, messages) == want
        assert render_chat(chat_template(ours.files), messages, ours.special_tokens_map) == want
        ids = auto.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        assert ours.encode(want, add_special_tokens=False).tolist() == list(ids)
        no_prompt = auto.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
        assert apply_chat_template(ours, messages, add_generation_prompt=False) == no_prompt


def test_mistral_template_and_raise_exception(tok_dir):
    d = tok_dir(MISTRAL, "m", bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>")
    auto, ours = T.AutoTokenizer.from_pretrained(str(d)), load_tokenizer(d)
    messages = CHATS[2]
    assert apply_chat_template(ours, messages) == auto.apply_chat_template(messages, add_generation_prompt=True,
                                                                           tokenize=False)
    with pytest.raises(ChatError) as info:
        apply_chat_template(ours, [{"role": "assistant", "content": "hi"}])
    assert str(info.value) == ("the model's chat template refused the messages: Conversation roles must alternate "
                               "user/assistant/user/assistant/...")
    with pytest.raises(ChatError, match="Only user and assistant roles"):
        apply_chat_template(ours, [{"role": "user", "content": "x"}, {"role": "system", "content": "y"}])


def test_template_sources(tok_dir):
    files = tokenizer_files(tok_dir(CHATML, "j", jinja="{{ 'from the jinja file' }}"))
    assert chat_template(files) == "{{ 'from the jinja file' }}"
    named = [{"name": "default", "template": CHATML}, {"name": "tool_use", "template": "{{ 'tools' }}"}]
    d = tok_dir(named, "n", eos_token="<|im_end|>")
    auto, ours = T.AutoTokenizer.from_pretrained(str(d)), load_tokenizer(d)
    assert apply_chat_template(ours, CHATS[0]) == auto.apply_chat_template(CHATS[0], add_generation_prompt=True,
                                                                           tokenize=False)
    files = tokenizer_files(tok_dir([{"name": "tool_use", "template": "x"}], "nd"))
    with pytest.raises(NoChatTemplate, match="'tool_use'.*none named 'default'"):
        chat_template(files)


def test_no_template(tok_dir):
    ours = load_tokenizer(tok_dir(None, "none"))
    assert chat_template(ours.files) is None
    with pytest.raises(NoChatTemplate) as info:
        apply_chat_template(ours, CHATS[0])
    assert isinstance(info.value, ChatError) and "\n" not in str(info.value)
    with pytest.raises(NoChatTemplate):
        render_chat(None, CHATS[0])


@pytest.mark.parametrize("template", [
    "{{ messages.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os }}",
    "{{ raise_exception.__globals__.keys() }}",
    "{% set ns = namespace(_secret=1) %}{{ ns }}",
    "{% set ns = namespace() %}{% set ns._x = 1 %}{{ ns }}",
    "{{ messages.append(1) }}",
])
def test_the_sandbox_refuses_internals(template):
    with pytest.raises(ChatError) as info:
        render_chat(template, CHATS[0])
    message = str(info.value)
    assert "\n" not in message and "chat template" in message


def test_an_unsafe_attribute_alone_prints_nothing():
    assert render_chat("{{ raise_exception.__globals__ }}{{ messages.__class__ }}", CHATS[0]) == ""


def test_content_parts_and_message_checks():
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    template = "{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}"
    assert render_chat(template, parts) == "[user:a\nb]"
    assert render_chat(template, [{"role": "user", "content": "x", "name": None}]) == "[user:x]"
    for messages, words in [
        ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}]}],
         "messages[0].content[1]"),
        ("hi", "non-empty list"), ([], "non-empty list"), (["hi"], "messages[0] must be an object"),
        ([{"content": "x"}], "messages[0].role"), ([{"role": "user"}], "messages[0] has no content"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"role": "user", "content": "x", "extra": object()}], "messages[0].extra"),
    ]:
        with pytest.raises(ChatError, match=words.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
            render_chat(template, messages)


def test_broken_templates():
    with pytest.raises(ChatError, match=r"invalid: .*line 1"):
        render_chat("{% for m in messages %}", CHATS[0])
    with pytest.raises(ChatError, match="failed"):
        render_chat("{{ messages[0].content + 1 }}", CHATS[0])
    with pytest.raises(ChatError, match="failed"):
        render_chat("{{ messages[5].content.x }}", CHATS[0])


def test_reasoning_fields_and_special_tokens_as_transformers(tok_dir):
    template = ("{% for m in messages %}{{ m.thinking }}|{{ m.reasoning_content }}|{{ m.content }}{% endfor %}"
                "{{ bos_token }}{{ eos_token }}{{ pad_token }}")
    d = tok_dir(template, "r", bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", pad_token="<|endoftext|>")
    auto, ours = T.AutoTokenizer.from_pretrained(str(d)), load_tokenizer(d)
    messages = [{"role": "assistant", "content": "answer", "reasoning": "because"}]
    assert apply_chat_template(ours, messages) == auto.apply_chat_template(messages, add_generation_prompt=True,
                                                                           tokenize=False)
    assert json.loads(render_chat("{{ messages | tojson }}", [{"role": "u", "content": "é😀<b>"}])) == \
        [{"role": "u", "content": "é😀<b>"}]
    assert "é😀<b>" in render_chat("{{ messages | tojson }}", [{"role": "u", "content": "é😀<b>"}])


# ---- issue 40: templates and messages from hostile authors and clients --------------------------------------

@pytest.mark.parametrize("template, words", [
    ("{{ 'x' * 10**9 }}", "a product of 1 x 1000000000 items"),
    ("{{ [1, 2] * 10**9 }}", "a product of 2 x 1000000000 items"),
    ("{{ messages | tojson(indent=100000000) }}", "tojson(indent=100000000)"),
    ("{{ messages | tojson(indent=1000) }}", "tojson(indent=1000) of its list"),
    ("{% for i in range(100000) %}{{ 'abcdefghij' * 10 }}{% endfor %}", "its output as written"),
    ("{{ 7 ** 100000 }}", "the power 7 ** 100000"),
])
def test_output_is_bounded_while_it_renders_not_after(template, words):
    """'x' * 10**9 rendered 1 GB and tokenizers aborted the server (exit 6); now refused before it is built."""
    with pytest.raises(ChatError) as info:
        render_chat(template, CHATS[0], max_chars=4096)
    message = str(info.value)
    assert message.startswith("the model's chat template renders more than 4096 characters for these messages")
    assert words in message and "\n" not in message


def test_a_budget_does_not_change_what_a_template_renders(tok_dir):
    d = tok_dir(LLAMA31_STYLE, "b", bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    ours = load_tokenizer(d)
    for messages in CHATS:
        assert apply_chat_template(ours, messages, max_chars=1 << 20) == apply_chat_template(ours, messages)
    assert render_chat("{{ 'ab' * 3 }}{{ 2 ** 10 }}{{ [0] * 2 }}", CHATS[0], max_chars=100) == "ababab1024[0, 0]"


def test_running_out_of_memory_while_rendering_is_this_render_s_error(monkeypatch):
    from hpcpipe.hf import chat

    def greedy(pieces, max_chars):
        raise MemoryError
    monkeypatch.setattr(chat, "_bounded", greedy)
    with pytest.raises(ChatError, match="ran out of memory rendering these messages"):
        render_chat("{{ messages[0].content }}", CHATS[0], max_chars=100)


@pytest.mark.parametrize("name", [["default"], {"a": 1}, 5, None])
def test_a_template_list_entry_whose_name_is_not_a_string_is_named(tok_dir, name):
    """A list or object as name was a TypeError (unhashable) and a 500 on every chat request."""
    d = tok_dir([{"name": name, "template": "x"}, {"name": "default", "template": CHATML}], f"n{type(name).__name__}")
    with pytest.raises(ChatError) as info:
        chat_template(tokenizer_files(d))
    assert str(info.value) == (f"tokenizer_config.json: chat_template[0] must be an object with a string name and a "
                               f"template, got a {type(name).__name__} name")
    assert not isinstance(info.value, NoChatTemplate)


def test_a_template_list_entry_that_is_not_an_object_is_named():
    files = {"tokenizer_config.json": json.dumps({"chat_template": [{"name": "default", "template": "x"}, 3]}).encode()}
    with pytest.raises(ChatError, match=r"chat_template\[1\] must be an object with a string name and a template, "
                                        r"got int"):
        chat_template(files)


def test_a_deeply_nested_tokenizer_config_is_no_recursion_error():
    assert chat_template({"tokenizer_config.json": b"[" * 100_000}) is None


@pytest.mark.parametrize("messages, words", [
    ([{"role": "user", "content": "a\ud800b"}], "messages[0].content holds a lone surrogate U+D800 at position 1"),
    ([{"role": "us\udc00er", "content": "ab"}], "messages[0].role holds a lone surrogate U+DC00 at position 2"),
    ([{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}],
     "messages[0].content[0].text holds a lone surrogate U+DFFF at position 0"),
    ([{"role": "user", "content": "x", "name": "\ud83d"}], "messages[0].name holds a lone surrogate U+D83D"),
])
def test_a_lone_surrogate_in_a_message_is_named(messages, words):
    """A lone surrogate reached the tokenizer: TypeError 'TextInputSequence must be str', a 500."""
    with pytest.raises(ChatError) as info:
        render_chat("{% for m in messages %}{{ m.role }}{{ m.content }}{{ m.name }}{% endfor %}", messages)
    assert words in str(info.value) and "not valid Unicode text" in str(info.value)


def test_a_syntax_error_is_found_without_rendering():
    from hpcpipe.hf.chat import check_template
    with pytest.raises(ChatError, match=r"invalid: .*line 1"):
        check_template("{% for m in messages %}")
    check_template(CHATML)
