"""The OpenAI chat completions API at the boundary: POST /v1/chat/completions bodies in, chat objects out.

The messages are rendered with the model's chat template (``chat_template`` in tokenizer_config.json
or ``chat_template.jinja``) in a jinja2 sandbox, as transformers' ``apply_chat_template(messages,
add_generation_prompt=True)`` does, and the text is encoded without adding special tokens again (the
template writes its own). Sampling, stop strings and streaming are the completions endpoint's. A model
without a template (or with a bytes or chars tokenizer) answers 400 saying so.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hpcpipe.serve.openai_schema import (
    ApiError,
    CompletionSpec,
    check_limits,
    parse_sampling,
    refuse_unknown,
    refuse_unsupported,
    stop_strings,
    stream_options,
)
from hpcpipe.serve.request_options import parse_chat_logprobs, parse_format, parse_n

# what a chat request may carry; anything else is refused by name (a misspelled field must not be ignored)
KNOWN_FIELDS = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
                "stop", "stream", "stream_options", "n", "user", "logprobs", "top_logprobs", "presence_penalty",
                "frequency_penalty", "logit_bias", "response_format", "tools", "tool_choice", "parallel_tool_calls"}
# accepted only at their neutral value: a client never silently gets something other than it asked for
_NEUTRAL = {"presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logit_bias": ({},), "tools": ([],)}


def _bad(message: str, param: str | None) -> ApiError:
    return ApiError(400, message, param)


def chat_prompt(tokenizer: Any, messages: Any) -> list[int]:
    """Return the token ids of messages rendered with the model's chat template; ApiError(400) when impossible."""
    from hpcpipe.hf.chat import ChatError, apply_chat_template

    if not hasattr(tokenizer, "files"):
        raise _bad(f"this model has a {tokenizer.kind} tokenizer and no chat template; use /v1/completions with "
                   f"plain text", "messages")
    try:
        text = apply_chat_template(tokenizer, messages)
    except ChatError as exc:
        raise _bad(str(exc), "messages") from None
    try:
        return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]
    except ValueError as exc:
        raise _bad(f"messages cannot be encoded: {exc}", "messages") from None


def parse_chat(body: Any, tokenizer: Any, seq_len: int, limits: dict | None = None) -> CompletionSpec:
    """Validate a POST /v1/chat/completions body; raise ApiError(400) naming the field and values at fault."""
    check_limits(limits)
    if not isinstance(body, dict):
        raise _bad(f"the request body must be a JSON object, got {type(body).__name__}", None)
    refuse_unknown(body, KNOWN_FIELDS)
    refuse_unsupported(body, _NEUTRAL)
    if body.get("tool_choice") not in (None, "none"):
        raise _bad(f"tool_choice is not supported by hpcpipe; got {body['tool_choice']!r}", "tool_choice")
    if "messages" not in body:
        raise _bad("messages is missing; send \"messages\": [{\"role\": \"user\", \"content\": \"...\"}]", "messages")
    prompt = chat_prompt(tokenizer, body["messages"])
    given = [k for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None]
    if len(given) == 2 and body["max_tokens"] != body["max_completion_tokens"]:
        raise _bad(f"max_tokens ({body['max_tokens']!r}) and max_completion_tokens "
                   f"({body['max_completion_tokens']!r}) differ; send one of them", "max_tokens")
    room = seq_len - len(prompt)
    if room < 1:
        raise _bad(f"the messages are {len(prompt)} tokens with the chat template, which leaves no room in the "
                   f"model's context of {seq_len} tokens", "messages")
    max_tokens = body[given[0]] if given else room      # default: the rest of the context
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0:
        raise _bad(f"{given[0]} must be an integer >= 1, got {max_tokens!r}", given[0])
    if max_tokens > room:
        raise _bad(f"the messages are {len(prompt)} tokens and {given[0]} is {max_tokens}: {len(prompt)} + "
                   f"{max_tokens} = {len(prompt) + max_tokens} exceeds the model's context length of {seq_len} "
                   f"tokens; shorten the messages or lower {given[0]}", given[0])
    n = parse_n(body, 1, check_limits(limits)["max_prompts"])
    params = dataclasses.replace(parse_sampling(body, tokenizer), logprobs=parse_chat_logprobs(body, tokenizer),
                                 grammar=parse_format(body, tokenizer))
    stream, include_usage = stream_options(body)
    return CompletionSpec([prompt], max_tokens, params, stop_strings(body.get("stop")), stream, include_usage, n)


def chat_body(cid: str, created: int, model: str, texts: list[str], reasons: list[str | None],
              logprobs: list[dict | None], usage: dict) -> dict:
    """Return a whole chat.completion object: one assistant message per choice."""
    return {"id": cid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": i, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                         "finish_reason": finish} for i, (text, finish, lp) in enumerate(zip(texts, reasons, logprobs,
                                                                                             strict=True))],
            "usage": usage}


def chat_chunk(cid: str, created: int, model: str, delta: dict, finish: str | None,
               usage: dict | None = None, index: int = 0, logprobs: dict | None = None) -> dict:
    """Return one chat.completion.chunk of a stream (``usage``: the last chunk's, with no choices)."""
    body = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [] if usage is not None else [{"index": index, "delta": delta, "logprobs": logprobs,
                                                      "finish_reason": finish}]}
    if usage is not None:
        body["usage"] = usage
    return body
