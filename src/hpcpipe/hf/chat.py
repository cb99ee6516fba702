"""Chat prompts: a model's Jinja chat template rendered in a sandbox, as transformers'
``apply_chat_template(messages, add_generation_prompt=True, tokenize=False)`` renders it.

The environment is transformers': ``ImmutableSandboxedEnvironment`` with trim_blocks and lstrip_blocks, the
loopcontrols extension and a no-op ``{% generation %}`` block, a ``tojson`` filter that does not escape HTML,
``raise_exception``, ``strftime_now``, and a ``dict`` and ``namespace`` that refuse underscore names. Templates
come from the model (untrusted): the sandbox refuses ``__class__`` and the like. The template sees the messages,
``add_generation_prompt`` and the tokenizer's named special tokens (``bos_token``, ``eos_token``, ...).
The rendered text is encoded with ``add_special_tokens=False`` (the template writes its own BOS).

Output is bounded while it is rendered, not after: with ``max_chars`` the template's output is counted as
jinja2 produces it, ``*`` and ``**`` are checked before they build a string, list or integer larger than that
(``'x' * 10**9`` never allocates), ``tojson`` stops at the limit whatever its ``indent``, and a MemoryError is
this render's ChatError. Time is bounded by the caller: the server renders in a worker process it kills at
its deadline (:mod:`hpcpipe.serve.prompt_pool`).
"""

from __future__ import annotations

import contextvars
import json
from datetime import datetime
from functools import lru_cache
from typing import Any

from hpcpipe.hf.json_text import JSONTextError, loads

MIN_JINJA = (3, 1, 6)   # older versions have known sandbox escapes
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# the output budget of the render in progress on this thread (None: unbounded), read by ``*``, ``**`` and tojson
_BUDGET: contextvars.ContextVar[int | None] = contextvars.ContextVar("chat_budget", default=None)
MAX_POWER_BITS = 1 << 16    # ``a ** b`` may build an integer of at most this many bits (about 20,000 digits)


class ChatError(ValueError):
    """The messages are malformed or the chat template refused them (a client error: HTTP 400)."""


class NoChatTemplate(ChatError):
    """The model has no chat template (or several and none named default), so it cannot take chat messages."""


class TemplateTooLarge(ChatError):
    """The chat template's output went over the render's budget of characters (or memory)."""


def chat_template(files: dict[str, bytes]) -> str | None:
    """Return the model's chat template: chat_template.jinja, else tokenizer_config.json's chat_template (a string,
    or a list of named templates: the one named default); None when there is none."""
    if files.get("chat_template.jinja") is not None:
        return files["chat_template.jinja"].decode("utf-8", errors="replace")
    raw = files.get("tokenizer_config.json")
    if raw is None:
        return None
    try:
        config = loads(raw)    # nesting bounded: a file of 100,000 brackets is not a RecursionError
    except JSONTextError:
        return None            # HFTokenizer refused such a file when it was loaded; nothing to render here
    template = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(template, list):
        named = {}
        for i, entry in enumerate(template):
            # a name that is no string (a list, an object) was a TypeError on every chat request
            name = entry.get("name") if isinstance(entry, dict) else None
            if not isinstance(entry, dict) or not isinstance(name, str):
                got = f"a {type(name).__name__} name" if isinstance(entry, dict) else type(entry).__name__
                raise ChatError(f"tokenizer_config.json: chat_template[{i}] must be an object with a string name "
                                f"and a template, got {got}")
            named[name] = entry.get("template")
        if "default" not in named:
            raise NoChatTemplate(f"the model has chat templates {sorted(named)} but none named 'default'")
        template = named["default"]
    return template if isinstance(template, str) and template else None


def _unicode(text: str, where: str) -> str:
    """Return text; ChatError naming where when it holds a lone surrogate (no tokenizer encodes it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ChatError(f"{where} holds a lone surrogate U+{ord(text[exc.start]):04X} at position {exc.start}: it is "
                        f"not valid Unicode text") from None
    return text


def _text(content: Any, where: str) -> str:
    """Return a message's content: a string, or the text parts of an OpenAI-style list joined by newlines."""
    if isinstance(content, str):
        return _unicode(content, f"{where}.content")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "text" and not isinstance(part.get("text"), str):
                got = "missing" if part.get("text") is None else f"a {type(part['text']).__name__}"
                raise ChatError(f"{where}.content[{j}] is a text part whose \"text\" is {got}: send "
                                f"{{\"type\": \"text\", \"text\": \"...\"}} with a string")
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ChatError(f"{where}.content[{j}] must be {{\"type\": \"text\", \"text\": \"...\"}} (only text "
                                f"is supported), got type {kind!r}")
            texts.append(_unicode(part["text"], f"{where}.content[{j}].text"))
        return "\n".join(texts)
    raise ChatError(f"{where}.content must be a string or a list of text parts, got {type(content).__name__}")


def _plain(value: Any, where: str) -> Any:
    """Return value rebuilt from plain JSON types (what the template may see); ChatError for anything else."""
    if type(value) is str:
        return _unicode(value, where)
    if value is None or type(value) in (int, float, bool):
        return value
    if isinstance(value, dict):
        return {_unicode(str(k), f"{where} key"): _plain(v, f"{where}.{k}") for k, v in value.items()}
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
            raise ChatError(f"{where}.role must be a non-empty string, got {_short(role)}")
        _unicode(role, f"{where}.role")
        if message.get("content") is None:
            raise ChatError(f"{where} has no content")
        plain = {_unicode(str(k), f"{where} key"): _plain(v, f"{where}.{k}") for k, v in message.items()
                 if v is not None and k != "content"}
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
        """JSON text of x, HTML characters not escaped (transformers' filter), stopped at the render's budget."""
        budget = _BUDGET.get()
        if budget is not None and isinstance(indent, int) and indent > budget:
            raise TemplateTooLarge(f"tojson(indent={indent})")
        encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                                   sort_keys=sort_keys)
        if budget is None:
            return encoder.encode(x)
        pieces, size = [], 0
        for piece in encoder.iterencode(x):      # counted as it is written: indent=10**8 stops at the budget
            size += len(piece)
            if size > budget:
                raise TemplateTooLarge(f"tojson(indent={indent}) of its {type(x).__name__}")
            pieces.append(piece)
        return "".join(pieces)

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

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        """transformers' sandbox, with ``*`` and ``**`` checked before they build something over the budget."""

        intercepted_binops = frozenset({"*", "**"})     # also keeps jinja2 from folding them at compile time

        def call_binop(self, context, operator, left, right):
            """Refuse a product or power whose result would exceed the render's budget; else compute it."""
            _check_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(),
                       namespace=TemplateNamespace)
    return env.from_string(template)


def _check_binop(operator: str, left: Any, right: Any) -> None:
    """Raise TemplateTooLarge when ``left * right`` or ``left ** right`` would build more than the budget allows."""
    budget = _BUDGET.get()
    if budget is None:
        return
    if operator == "*":
        seq, times = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(seq, str | list | tuple) and isinstance(times, int) and len(seq) * times > budget:
            raise TemplateTooLarge(f"a product of {len(seq)} x {times} items")
    elif isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and \
            right * abs(left).bit_length() > MAX_POWER_BITS:
        raise TemplateTooLarge(f"the power {left} ** {right}, over {MAX_POWER_BITS} bits")


def check_template(template: str) -> None:
    """Compile a chat template; ChatError (one line) when it is not valid Jinja (refused when the model is loaded)."""
    import jinja2
    try:
        _compiled(template)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ChatError(f"the model's chat template is invalid: {exc.message} (line {exc.lineno})") from None
    except (RecursionError, MemoryError):
        raise ChatError("the model's chat template is too deeply nested or too large to compile") from None


def render_chat(template: str | None, messages: Any, special_tokens: dict[str, str] | None = None,
                add_generation_prompt: bool = True, max_chars: int | None = None, **extra: Any) -> str:
    """Return the prompt text of messages rendered with a chat template (as apply_chat_template(...,
    tokenize=False)); NoChatTemplate when template is None, ChatError when the messages or the template fail.

    ``max_chars``: the budget of the output, enforced while it is written (TemplateTooLarge beyond it).
    """
    import jinja2
    if template is None:
        raise NoChatTemplate("the model has no chat template (no chat_template in tokenizer_config.json and no "
                             "chat_template.jinja); use the completions endpoint with plain text instead")
    chat = validate_messages(messages)
    variables = {**{k: v for k, v in (special_tokens or {}).items() if v is not None},
                 **{k: _plain(v, k) for k, v in extra.items()}}
    check_template(template)
    token = _BUDGET.set(max_chars)
    try:
        return _bounded(_compiled(template).generate(messages=chat, tools=None, documents=None,
                                                     add_generation_prompt=add_generation_prompt, **variables),
                        max_chars)
    except TemplateTooLarge as exc:
        raise TemplateTooLarge(f"the model's chat template renders more than {max_chars} characters for these "
                               f"messages ({exc})") from None
    except MemoryError:
        raise TemplateTooLarge("the model's chat template ran out of memory rendering these messages") from None
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
    finally:
        _BUDGET.reset(token)


def _bounded(pieces, max_chars: int | None) -> str:
    """Join the pieces of a render as jinja2 yields them, stopping as soon as they pass max_chars."""
    if max_chars is None:
        return "".join(pieces)
    out, size = [], 0
    for piece in pieces:
        size += len(piece)
        if size > max_chars:
            raise TemplateTooLarge("its output as written")
        out.append(piece)
    return "".join(out)


def _short(value: Any, limit: int = 80) -> str:
    """Return repr(value) cut to limit characters (a message names a value, it does not repeat a megabyte of it)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _line(exc: BaseException) -> str:
    """Return an exception's message as one line."""
    return " ".join(str(exc).split()) or type(exc).__name__


def apply_chat_template(tokenizer, messages: Any, add_generation_prompt: bool = True,
                        max_chars: int | None = None) -> str:
    """Return the prompt text of messages for an HFTokenizer's model (its template and special tokens)."""
    return render_chat(chat_template(tokenizer.files), messages, tokenizer.special_tokens_map,
                       add_generation_prompt=add_generation_prompt, max_chars=max_chars)
