"""Chat prompts: a model's Jinja chat template rendered in a sandbox, as transformers'
``apply_chat_template(messages, add_generation_prompt=True, tokenize=False)`` renders it.

The environment is transformers': ``ImmutableSandboxedEnvironment`` with trim_blocks and lstrip_blocks, the
loopcontrols extension and a no-op ``{% generation %}`` block, a ``tojson`` filter that does not escape HTML,
``raise_exception``, ``strftime_now``, and a ``dict`` and ``namespace`` that refuse underscore names. Templates
come from the model (untrusted): the sandbox refuses ``__class__`` and the like. The template sees the messages,
``add_generation_prompt`` and the tokenizer's named special tokens (``bos_token``, ``eos_token``, ...).
The rendered text is encoded with ``add_special_tokens=False`` (the template writes its own BOS).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

MIN_JINJA = (3, 1, 6)   # older versions have known sandbox escapes
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatError(ValueError):
    """The messages are malformed or the chat template refused them (a client error: HTTP 400)."""


class NoChatTemplate(ChatError):
    """The model has no chat template (or several and none named default), so it cannot take chat messages."""


def chat_template(files: dict[str, bytes]) -> str | None:
    """Return the model's chat template: chat_template.jinja, else tokenizer_config.json's chat_template (a string,
    or a list of named templates: the one named default); None when there is none."""
    if files.get("chat_template.jinja") is not None:
        return files["chat_template.jinja"].decode("utf-8", errors="replace")
    raw = files.get("tokenizer_config.json")
    if raw is None:
        return None
    try:
        config = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    template = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise NoChatTemplate(f"the model has chat templates {sorted(map(str, named))} but none named 'default'")
        template = named["default"]
    return template if isinstance(template, str) and template else None


def _text(content: Any, where: str) -> str:
    """Return a message's content: a string, or the text parts of an OpenAI-style list joined by newlines."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ChatError(f"{where}.content[{j}] must be {{\"type\": \"text\", \"text\": \"...\"}} (only text "
                                f"is supported), got type {kind!r}")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ChatError(f"{where}.content must be a string or a list of text parts, got {type(content).__name__}")


def _plain(value: Any, where: str) -> Any:
    """Return value rebuilt from plain JSON types (what the template may see); ChatError for anything else."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise ChatError(f"{where} must be JSON data, got {type(value).__name__}")


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Return messages as the template sees them: a non-empty list of {role: str, content: str, ...} (content
    parts joined, keys whose value is null dropped); ChatError naming the first problem."""
    if not isinstance(messages, list) or not messages:
        raise ChatError("messages must be a non-empty list of {\"role\": ..., \"content\": ...} objects")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ChatError(f"{where} must be an object with role and content, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ChatError(f"{where}.role must be a non-empty string, got {role!r}")
        if message.get("content") is None:
            raise ChatError(f"{where} has no content")
        plain = {k: _plain(v, f"{where}.{k}") for k, v in message.items() if v is not None and k != "content"}
        plain["content"] = _text(message["content"], where)
        reasoning = next((plain[k] for k in REASONING_FIELDS if plain.get(k) is not None), None)
        if reasoning is not None:   # as transformers: templates read reasoning_content, gpt-oss ones thinking
            plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
        out.append(plain)
    return out


@lru_cache(maxsize=16)
def _compiled(template: str):
    """Compile a template in transformers' sandboxed environment (cached by its text)."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    version = tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit())
    if version < MIN_JINJA:
        raise RuntimeError(f"chat templates need jinja2 >= {'.'.join(map(str, MIN_JINJA))} (sandbox fixes), "
                           f"found {jinja2.__version__}")

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks: rendered as is."""

        tags = {"generation"}

        def parse(self, parser):
            """Parse the block up to endgeneration into a call that renders its body."""
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        """Stop rendering with the template's own message."""
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        """JSON text of x, HTML characters not escaped (transformers' filter)."""
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        """The local date and time formatted with strftime."""
        return datetime.now().strftime(fmt)

    class TemplateDict:
        """``dict(...)`` without the class itself (no attribute access to its internals)."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            """dict.fromkeys."""
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        """A jinja2 namespace that refuses underscore-prefixed names."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a namespace cannot hold the underscore name {name!r}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(),
                       namespace=TemplateNamespace)
    return env.from_string(template)


def render_chat(template: str | None, messages: Any, special_tokens: dict[str, str] | None = None,
                add_generation_prompt: bool = True, **extra: Any) -> str:
    """Return the prompt text of messages rendered with a chat template (as apply_chat_template(...,
    tokenize=False)); NoChatTemplate when template is None, ChatError when the messages or the template fail."""
    import jinja2
    if template is None:
        raise NoChatTemplate("the model has no chat template (no chat_template in tokenizer_config.json and no "
                             "chat_template.jinja); use the completions endpoint with plain text instead")
    chat = validate_messages(messages)
    variables = {**{k: v for k, v in (special_tokens or {}).items() if v is not None},
                 **{k: _plain(v, k) for k, v in extra.items()}}
    try:
        return _compiled(template).render(messages=chat, tools=None, documents=None,
                                          add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ChatError(f"the model's chat template is invalid: {exc.message} (line {exc.lineno})") from None
    except jinja2.exceptions.SecurityError as exc:
        raise ChatError(f"the model's chat template was stopped by the sandbox: {_line(exc)}") from None
    except jinja2.exceptions.TemplateError as exc:   # raise_exception raises the base class itself
        what = "refused the messages" if type(exc) is jinja2.exceptions.TemplateError else "failed"
        raise ChatError(f"the model's chat template {what}: {_line(exc)}") from None
    except RecursionError:
        raise ChatError("the model's chat template recursed too deeply") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError, OverflowError) as exc:
        raise ChatError(f"the model's chat template failed on these messages: {type(exc).__name__}: "
                        f"{_line(exc)}") from None


def _line(exc: BaseException) -> str:
    """Return an exception's message as one line."""
    return " ".join(str(exc).split()) or type(exc).__name__


def apply_chat_template(tokenizer, messages: Any, add_generation_prompt: bool = True) -> str:
    """Return the prompt text of messages for an HFTokenizer's model (its template and special tokens)."""
    return render_chat(chat_template(tokenizer.files), messages, tokenizer.special_tokens_map,
                       add_generation_prompt=add_generation_prompt)
