"""The OpenAI chat completions API at the boundary: POST /v1/chat/completions bodies in, chat objects out.

The messages are rendered with the model's chat template (``chat_template`` in tokenizer_config.json
or ``chat_template.jinja``) in a jinja2 sandbox, as transformers' ``apply_chat_template(messages,
add_generation_prompt=True)`` does, and the text is encoded without adding special tokens again (the
template writes its own). The server does both in a prompt worker process within a time and size budget
(:mod:`hpcpipe.serve.prompt_pool`): :func:`check_chat` checks the fields and leaves the messages as the
worker's job. Sampling, stop strings and streaming are the completions endpoint's. A model without a
template (or with a bytes or chars tokenizer) answers 400 saying so.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hpcpipe.serve.chat_fields import check_message_fields
from hpcpipe.serve.openai_schema import (
    ApiError,
    CompletionSpec,
    Draft,
    check_limits,
    parse_sampling,
    refuse_unknown,
    refuse_unsupported,
    stop_strings,
    stream_options,
)
from hpcpipe.serve.prompt_jobs import chat_ids
from hpcpipe.serve.request_options import format_to_compile, parse_chat_logprobs, parse_n

# what a chat request may carry; anything else is refused by name (a misspelled field must not be ignored)
KNOWN_FIELDS = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
                "stop", "stream", "stream_options", "n", "user", "logprobs", "top_logprobs", "presence_penalty",
                "frequency_penalty", "logit_bias", "response_format", "tools", "tool_choice", "parallel_tool_calls"}
# accepted only at their neutral value: a client never silently gets something other than it asked for
_NEUTRAL = {"presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logit_bias": ({},), "tools": ([],)}


def _bad(message: str, param: str | None) -> ApiError:
    return ApiError(400, message, param)


def chat_prompt(tokenizer: Any, messages: Any, max_chars: int | None = None) -> list[int]:
    """Return the token ids of messages rendered with the model's chat template; ApiError(400) when impossible."""
    return chat_ids(tokenizer, messages, max_chars)


def parse_chat(body: Any, tokenizer: Any, seq_len: int, limits: dict | None = None) -> CompletionSpec:
    """Validate a POST /v1/chat/completions body and render its messages here; ApiError(400) naming what is wrong."""
    return check_chat(body, tokenizer, seq_len, limits).run_here(tokenizer, limits)


def check_chat(body: Any, tokenizer: Any, seq_len: int, limits: dict | None = None,
               defaults: dict | None = None) -> Draft:
    """Check a POST /v1/chat/completions body field by field (the HTTP event loop does it); ApiError(400) naming
    the field. The messages become a prompt worker's job (the template is the model's code: never run here); the
    lengths are checked once they are token ids."""
    limits = check_limits(limits)
    if not isinstance(body, dict):
        raise _bad(f"the request body must be a JSON object, got {type(body).__name__}", None)
    refuse_unknown(body, KNOWN_FIELDS)
    refuse_unsupported(body, _NEUTRAL)
    if body.get("tool_choice") not in (None, "none"):
        raise _bad(f"tool_choice is not supported by hpcpipe; got {body['tool_choice']!r}", "tool_choice")
    if "messages" not in body:
        raise _bad("messages is missing; send \"messages\": [{\"role\": \"user\", \"content\": \"...\"}]", "messages")
    if not hasattr(tokenizer, "files"):
        raise _bad(f"this model has a {tokenizer.kind} tokenizer and no chat template; use /v1/completions with "
                   f"plain text", "messages")
    check_message_fields(body["messages"], tokenizer)
    given = [k for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None]
    if len(given) == 2 and body["max_tokens"] != body["max_completion_tokens"]:
        raise _bad(f"max_tokens ({body['max_tokens']!r}) and max_completion_tokens "
                   f"({body['max_completion_tokens']!r}) differ; send one of them", "max_tokens")
    if given and (isinstance(body[given[0]], bool) or not isinstance(body[given[0]], int) or body[given[0]] <= 0):
        raise _bad(f"{given[0]} must be an integer >= 1, got {body[given[0]]!r}", given[0])
    n = parse_n(body, 1, limits["max_prompts"])
    params = dataclasses.replace(parse_sampling(body, tokenizer, defaults),
                                 logprobs=parse_chat_logprobs(body, tokenizer))
    response_format = format_to_compile(body)     # compiled off the event loop (http_api), or by run_here
    stream, include_usage = stream_options(body)
    stop = stop_strings(body.get("stop"))

    def finish(results: list) -> CompletionSpec:
        prompt = results[0]
        room = seq_len - len(prompt)
        if room < 1:
            raise _bad(f"the messages are {len(prompt)} tokens with the chat template, which leaves no room in the "
                       f"model's context of {seq_len} tokens", "messages")
        max_tokens = body[given[0]] if given else room      # default: the rest of the context
        if max_tokens > room:
            raise _bad(f"the messages are {len(prompt)} tokens and {given[0]} is {max_tokens}: {len(prompt)} + "
                       f"{max_tokens} = {len(prompt) + max_tokens} exceeds the model's context length of {seq_len} "
                       f"tokens; shorten the messages or lower {given[0]}", given[0])
        return CompletionSpec([prompt], max_tokens, params, stop, stream, include_usage, n)
    return Draft([{"chat": body["messages"]}], finish, response_format)


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
