"""The roles and keys of chat messages at the boundary: OpenAI's, and those the model's chat template names.

OpenAI's API refuses a message whose role or key it does not know (400); vLLM accepts any role and drops keys it
does not know, so a typo such as ``"role": "usr"`` or ``"nmae"`` silently renders another prompt. hpcpipe refuses
them by name, as it refuses unknown request fields, except what the model's template itself names as a quoted
string or an attribute (``message['role'] == 'ipython'``, ``message.tool_calls``): a template written for roles or
keys of its own keeps them.
"""

from __future__ import annotations

import difflib
import re
from functools import lru_cache
from typing import Any

from hpcpipe.serve.api_error import ApiError
from hpcpipe.serve.prompt_jobs import unicode_problem

ROLES = ("system", "developer", "user", "assistant", "tool", "function")      # OpenAI's chat roles
KEYS = ("role", "content", "name", "tool_calls", "tool_call_id", "function_call", "refusal", "audio",
        "reasoning_content", "thinking", "reasoning")       # OpenAI's message keys and the reasoning ones
_TEMPLATES: dict[int, tuple[Any, str | None]] = {}     # id(tokenizer) -> (tokenizer, its chat template)
_QUOTED = re.compile(r"""'([A-Za-z_][\w-]{0,63})'|"([A-Za-z_][\w-]{0,63})"|\.([A-Za-z_]\w{0,63})""")


# a template that writes whole messages (``message | tojson``, ``message.items()``) reads every key they have
_WHOLE = re.compile(r"\.items\(\)|\b(?:\w*message\w*|\w*msg\w*|m)(?:\[[^\]]*\])?\s*\|\s*tojson", re.IGNORECASE)


@lru_cache(maxsize=8)
def template_names(template: str | None) -> frozenset[str]:
    """The names a chat template quotes or reads as attributes (the roles and keys it may give a meaning to)."""
    if not template:
        return frozenset()
    return frozenset(next(g for g in m.groups() if g) for m in _QUOTED.finditer(template))


@lru_cache(maxsize=8)
def reads_any_key(template: str | None) -> bool:
    """Whether the template writes whole messages (every key of a message may matter to it)."""
    return bool(template) and _WHOLE.search(template) is not None


def _closest(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    return f": did you mean {close[0]!r}?" if close else ""


def model_template(tokenizer: Any) -> str | None:
    """The chat template of a Hugging Face tokenizer (read once per tokenizer); None when it has none."""
    from hpcpipe.hf.chat import ChatError, chat_template

    cached = _TEMPLATES.get(id(tokenizer))
    if cached is None or cached[0] is not tokenizer:
        try:
            template = chat_template(getattr(tokenizer, "files", {}))
        except ChatError:            # a malformed template list: rendering names it, with the request's 400
            template = None
        cached = _TEMPLATES[id(tokenizer)] = (tokenizer, template)
    return cached[1]


def check_message_fields(messages: Any, tokenizer: Any) -> None:
    """Raise ApiError(400) naming the first message whose role or key is neither OpenAI's nor named by the
    model's chat template; anything else wrong with the messages is the renderer's to name (hpcpipe.hf.chat)."""
    if not isinstance(messages, list):
        return
    template = model_template(tokenizer)
    names, any_key = template_names(template), reads_any_key(template)
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            continue
        if any(unicode_problem(str(text)) for text in (*message, message.get("role", ""))):
            continue                 # a lone surrogate: the renderer names it and where it is
        if message.get("content") == []:      # OpenAI 400s it; rendered, it was a turn of no text, silently
            raise ApiError(400, f"messages[{i}].content is an empty list: send a string, or at least one "
                                f"{{\"type\": \"text\", \"text\": \"...\"}} part", "messages")
        role = message.get("role")
        if isinstance(role, str) and role and role not in ROLES and role not in names:
            raise ApiError(400, f"messages[{i}].role {role!r} is not a known role{_closest(role, list(ROLES))} "
                                f"(OpenAI's roles are {', '.join(ROLES)}; another role is taken only when the "
                                f"model's chat template names it)", "messages")
        for key in message:
            if key not in KEYS and key not in names and not any_key:
                raise ApiError(400, f"messages[{i}] has an unknown key {key!r}{_closest(key, list(KEYS))} (a "
                                    f"message takes {', '.join(KEYS)}; another key is taken only when the model's "
                                    f"chat template reads it)", "messages")
