"""The OpenAI completions API at the boundary: request validation (one clear message per mistake),
error bodies and response shapes.

Nothing a client sends is silently ignored or misread: a field this endpoint does not know is a 400 naming
it (with the closest known name: ``max_token`` -> ``max_tokens``), a field hpcpipe does not implement is
accepted only at its neutral value, and a ``model`` other than the one served is OpenAI's 404
``model_not_found`` (``check_model``; no ``model`` at all is fine, as curl users send none).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hpcpipe.serve.api_error import ApiError
from hpcpipe.serve.request_options import compile_checked, format_to_compile, parse_completion_logprobs, parse_n
from hpcpipe.serve.sampling import SamplingParams

DEFAULT_LIMITS = {
    "max_prompts": 32,          # prompts in one request's list
    "max_body_bytes": 1 << 20,  # request body size
    "prompt_seconds": 10,       # rendering and tokenizing one request's prompts (the worker is killed past it)
    "max_chat_chars": 4 << 20,  # characters a chat template may write for one request (counted as it renders)
    "prompt_workers": 2,        # worker processes for large requests (plus one for small ones)
    "grammar_ms": 1000,         # compiling one response_format's grammar (off the event loop; past it: 400)
}
MAX_STOP = 4
MAX_SEED = 2**63 - 1
# what a completions request may carry: the fields of OpenAI's API (the openai client sends only those it is
# given) and hpcpipe's top_k (the client's extra_body)
COMPLETION_FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
                     "stream_options", "n", "user", "logprobs", "echo", "best_of", "suffix", "presence_penalty",
                     "frequency_penalty", "logit_bias", "response_format"}


@dataclass
class CompletionSpec:
    """A validated completion request: one entry per prompt, shared sampling settings, n choices per prompt.

    ``params`` carries the logprobs, echo (prompt_logprobs) and grammar settings to the last stage too.
    """

    prompts: list[list[int]]
    max_tokens: int
    params: SamplingParams
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    n: int = 1
    echo: list[str] | None = None     # with echo: each prompt's text, put before its choices' text


def check_limits(limits: dict | None) -> dict:
    """Return DEFAULT_LIMITS updated by limits; ValueError names an unknown key or a value that is not an int >= 1."""
    limits = dict(limits or {})
    unknown = sorted(set(limits) - set(DEFAULT_LIMITS))
    if unknown:
        raise ValueError(f"serve: unknown limit(s) {unknown}; known: {sorted(DEFAULT_LIMITS)}")
    for key, value in limits.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"serve: limit {key} must be an integer >= 1, got {value!r}")
    return {**DEFAULT_LIMITS, **limits}


def _bad(message: str, param: str | None) -> ApiError:
    return ApiError(400, message, param)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _get(body: dict, key: str, default):
    """Return body[key], with JSON null meaning 'not given' as the openai client sends it."""
    value = body.get(key)
    return default if value is None else value


@dataclass
class Draft:
    """A request whose fields are checked, its prompts not yet token ids: the ``jobs`` a prompt worker runs
    (:mod:`hpcpipe.serve.prompt_jobs`), then ``finish(results)`` for the checks that need the ids."""

    jobs: list[dict]
    finish: Callable[[list], CompletionSpec]
    response_format: Any = None     # to compile into the params' grammar (request_options.compile_checked)

    def run_here(self, tokenizer, limits: dict | None = None) -> CompletionSpec:
        """Return the spec with the jobs run and its grammar compiled in this thread (tests and tools)."""
        from hpcpipe.serve.prompt_jobs import run_jobs
        spec = self.finish(run_jobs(tokenizer, self.jobs, check_limits(limits)["max_chat_chars"]))
        return constrained(spec, compile_checked(self.response_format, tokenizer))


def constrained(spec: CompletionSpec, grammar: str) -> CompletionSpec:
    """Return spec with its sampling params following grammar ("" = none)."""
    return dataclasses.replace(spec, params=dataclasses.replace(spec.params, grammar=grammar)) if grammar else spec


def parse_completion(body, tokenizer, seq_len: int, limits: dict | None = None) -> CompletionSpec:
    """Validate a POST /v1/completions body and tokenize its prompts here; ApiError(400) naming what is wrong."""
    return check_completion(body, tokenizer, seq_len, limits).run_here(tokenizer, limits)


def check_completion(body, tokenizer, seq_len: int, limits: dict | None = None,
                     defaults: dict | None = None) -> Draft:
    """Check a POST /v1/completions body field by field (cheap: the HTTP event loop does it); ApiError(400) naming
    the field; its text prompts become jobs, the lengths are checked once they are token ids. ``defaults``: the
    sampling settings a field left out takes (the model's, :func:`parse_sampling`)."""
    limits = check_limits(limits)
    if not isinstance(body, dict):
        raise _bad(f"the request body must be a JSON object, got {type(body).__name__}", None)
    refuse_unknown(body, COMPLETION_FIELDS)
    refuse_unsupported(body, _NEUTRAL)
    entries = _prompts(body, limits["max_prompts"], tokenizer)     # text (to encode) or checked token ids
    echo = _get(body, "echo", False)
    if not isinstance(echo, bool):
        raise _bad(f"echo must be true or false, got {echo!r}", "echo")
    max_tokens = _get(body, "max_tokens", 16)
    if not _is_int(max_tokens) or max_tokens < (0 if echo else 1):
        raise _bad(f"max_tokens must be an integer >= 1, got {max_tokens!r} (0 only with echo: the prompt "
                   f"alone)", "max_tokens")
    n = parse_n(body, len(entries), limits["max_prompts"])
    logprobs = parse_completion_logprobs(body, tokenizer)
    params = dataclasses.replace(parse_sampling(body, tokenizer, defaults), logprobs=logprobs,
                                 prompt_logprobs=echo and logprobs >= 0)
    response_format = format_to_compile(body)
    stop = stop_strings(body.get("stop"))
    stream, include_usage = stream_options(body)
    single = isinstance(body["prompt"], str) or _is_int(body["prompt"][0])       # one prompt, not a list of them
    names = ["prompt" if single else f"prompt[{i}]" for i in range(len(entries))]
    jobs = [{"text": e, "where": w} for e, w in zip(entries, names, strict=True) if isinstance(e, str)]
    if echo:       # a text prompt is echoed as sent, a token-id prompt as its ids decode
        jobs += [{"decode": e} for e in entries if not isinstance(e, str)]

    def finish(results: list) -> CompletionSpec:
        texts = sum(isinstance(e, str) for e in entries)       # the text jobs come first, then the decode jobs
        encoded, decoded = iter(results[:texts]), iter(results[texts:])
        prompts = [next(encoded) if isinstance(e, str) else e for e in entries]
        # a client that sent no max_tokens must learn where the 16 came from
        default = " (the default: the request sets none)" if _get(body, "max_tokens", None) is None else ""
        for where, ids in zip(names, prompts, strict=True):
            if len(ids) + min(max_tokens, 1) > seq_len:     # no max_tokens fits: lowering it cannot help
                raise _bad(f"{where} has {len(ids)} tokens, which leaves no room in the model's context of {seq_len} "
                           f"tokens (at most {seq_len - 1} prompt tokens with max_tokens >= 1); shorten the prompt",
                           "prompt")
            if len(ids) + max_tokens > seq_len:
                raise _bad(f"{where} has {len(ids)} token{'s' if len(ids) != 1 else ''} and max_tokens is "
                           f"{max_tokens}{default}: {len(ids)} + "
                           f"{max_tokens} = {len(ids) + max_tokens} exceeds the model's context length of {seq_len} "
                           f"tokens; shorten the prompt or lower max_tokens", "max_tokens")
        echoed = [e if isinstance(e, str) else next(decoded) for e in entries] if echo else None
        return CompletionSpec(prompts, max_tokens, params, stop, stream, include_usage, n, echoed)
    return Draft(jobs, finish, response_format)


def parse_sampling(body: dict, tokenizer, defaults: dict | None = None) -> SamplingParams:
    """Return the sampling settings of a request (temperature, top_p, top_k, seed); ApiError(400) naming a bad one.

    A field the request leaves out (or sends as null) takes ``defaults``' value (the model's generation_config.json,
    :mod:`hpcpipe.hf.sampling_defaults`), else OpenAI's (temperature 1, top_p 1, no top_k).
    """
    defaults = defaults or {}
    temperature = _get(body, "temperature", defaults.get("temperature", 1.0))
    if not _is_number(temperature) or not 0.0 <= temperature <= 2.0:
        raise _bad(f"temperature must be a number in [0, 2], got {temperature!r}", "temperature")
    top_p = _get(body, "top_p", defaults.get("top_p", 1.0))
    if not _is_number(top_p) or not 0.0 < top_p <= 1.0:
        raise _bad(f"top_p must be a number in (0, 1], got {top_p!r}", "top_p")
    # the model's top_k is bounded by its vocabulary, which may pass the tokenizer's: as large, it is off
    top_k = _get(body, "top_k", defaults.get("top_k", 0) if defaults.get("top_k", 0) <= tokenizer.vocab_size else 0)
    if top_k == -1 and _is_int(top_k):    # vLLM's "off", which clients written for vLLM send
        top_k = 0
    if not _is_int(top_k) or not 0 <= top_k <= tokenizer.vocab_size:
        raise _bad(f"top_k must be an integer in [0, {tokenizer.vocab_size}] (0 or -1 = off; the vocabulary has "
                   f"{tokenizer.vocab_size} tokens), got {top_k!r}", "top_k")
    seed = body.get("seed")
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little") & MAX_SEED     # unseeded requests differ run to run
    elif not _is_int(seed) or not 0 <= seed <= MAX_SEED:
        raise _bad(f"seed must be an integer in [0, 2**63 - 1], got {seed!r}", "seed")
    return SamplingParams(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p), seed=int(seed))


def stream_options(body: dict) -> tuple[bool, bool]:
    """Return (stream, include_usage) of a request; ApiError(400) when either is malformed."""
    stream = _get(body, "stream", False)
    if not isinstance(stream, bool):
        raise _bad(f"stream must be true or false, got {stream!r}", "stream")
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
            raise _bad(f"stream_options must be an object like {{\"include_usage\": true}}, got {options!r}",
                       "stream_options")
        _refuse_unknown_stream_option(options)
        if not stream:         # OpenAI's API and vLLM refuse it too; ignoring it hid a client's mistake
            raise _bad("stream_options is only allowed when stream is true", "stream_options")
        include_usage = options.get("include_usage", False)
    return stream, include_usage


# stream_options keys: include_usage, and OpenAI's include_obfuscation (padding of the chunks against
# side channels; hpcpipe's chunks carry none, so either value streams the same text)
STREAM_OPTIONS = {"include_usage", "include_obfuscation"}


def _refuse_unknown_stream_option(options: dict) -> None:
    """Raise ApiError(400) naming a stream_options key this server does not know (a misspelt include_usage
    would silently drop the usage chunk)."""
    unknown = sorted(set(options) - STREAM_OPTIONS)
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(STREAM_OPTIONS), n=1)
        hint = f": did you mean {close[0]!r}?" if close else ""
        raise _bad(f"unknown field stream_options.{unknown[0]}{hint} (stream_options takes "
                   f"{', '.join(sorted(STREAM_OPTIONS))})", "stream_options")
    if not isinstance(options.get("include_obfuscation", False), bool):
        raise _bad(f"stream_options.include_obfuscation must be true or false, got "
                   f"{options['include_obfuscation']!r}", "stream_options")


def _prompts(body: dict, max_prompts: int, tokenizer) -> list[str | list[int]]:
    """Return the prompts: texts (a string or a list of them, encoded later) or checked token ids (a list of ids or
    a list of such lists)."""
    if "prompt" not in body or body["prompt"] is None:
        raise _bad("prompt is missing; send \"prompt\": a string or a list of strings", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        return [_text(prompt, "prompt")]
    if not isinstance(prompt, list):
        raise _bad(f"prompt must be a string or a list of strings (or token ids), got {type(prompt).__name__}",
                   "prompt")
    if not prompt:
        raise _bad("prompt is an empty list; send at least one string", "prompt")
    if _is_int(prompt[0]):                       # one prompt as token ids (the first that is none is named)
        return [_token_ids(prompt, "prompt", tokenizer)]
    kind = str if isinstance(prompt[0], str) else list if isinstance(prompt[0], list) else None
    if kind is None:
        raise _bad(f"prompt[0] must be a string, a token id or a list of token ids, got {type(prompt[0]).__name__}",
                   "prompt")
    bad = [i for i, x in enumerate(prompt) if not isinstance(x, kind)]
    if bad:
        what = "a string" if kind is str else "a list of token ids"
        raise _bad(f"prompt[{bad[0]}] must be {what} like prompt[0], got {type(prompt[bad[0]]).__name__}", "prompt")
    if len(prompt) > max_prompts:
        raise _bad(f"prompt has {len(prompt)} {'strings' if kind is str else 'token-id lists'}; at most "
                   f"{max_prompts} per request", "prompt")
    if kind is str:
        return [_text(text, f"prompt[{i}]") for i, text in enumerate(prompt)]
    return [_token_ids(ids, f"prompt[{i}]", tokenizer) for i, ids in enumerate(prompt)]


def _text(text: str, where: str) -> str:
    """One text prompt, to be encoded by a prompt worker (empty text is refused here already)."""
    if text == "":
        raise _bad(f"{where} is empty; a prompt needs at least one token", "prompt")
    return text


def _token_ids(ids: list, where: str, tokenizer) -> list[int]:
    """One token-id prompt, checked against the vocabulary."""
    if not ids:
        raise _bad(f"{where} is empty; a prompt needs at least one token", "prompt")
    vocab = tokenizer.vocab_size
    bad = next((i for i, t in enumerate(ids) if not _is_int(t) or not 0 <= t < vocab), None)
    if bad is not None:
        raise _bad(f"{where}[{bad}] must be a token id in [0, {vocab}) (the tokenizer's vocabulary), got "
                   f"{ids[bad]!r}", "prompt")
    return [int(t) for t in ids]


def stop_strings(stop) -> list[str]:
    """Return the stop strings: none, one string, or a list of up to 4 non-empty strings."""
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _bad(f"stop must be a string or a list of strings, got {stop!r}", "stop")
    if len(stops) > MAX_STOP:
        raise _bad(f"stop has {len(stops)} strings; at most {MAX_STOP}", "stop")
    if any(s == "" for s in stops):
        raise _bad("stop strings must not be empty", "stop")
    return stops


# Fields of the OpenAI API that hpcpipe does not implement: accepted only at their neutral value, so that
# a client never silently gets something other than what it asked for.
_NEUTRAL = {
    "best_of": (1,), "suffix": ("",), "presence_penalty": (0,), "frequency_penalty": (0,), "logit_bias": ({},),
}


def refuse_unknown(body: dict, known: set[str]) -> None:
    """Raise ApiError(400) naming the first field of body that is not in known (and the closest known name)."""
    unknown = sorted(set(body) - known)
    if not unknown:
        return
    key = unknown[0]
    close = difflib.get_close_matches(key, sorted(known), n=1)
    hint = f": did you mean {close[0]!r}?" if close else ""
    raise _bad(f"unknown field {key!r}{hint} (this endpoint takes {', '.join(sorted(known))})", key)


def refuse_unsupported(body: dict, neutral_values: dict[str, tuple]) -> None:
    """Raise ApiError(400) when an unsupported OpenAI field asks for anything but its neutral value."""
    for key, neutral in neutral_values.items():
        value = body.get(key)
        if value is None or any(_same(value, n) for n in neutral):
            continue
        raise _bad(f"{key} is not supported by hpcpipe; got {key} = {value!r}", key)


def check_model(body, served: str) -> None:
    """Raise OpenAI's 404 model_not_found when body names a model other than the served one (none is fine)."""
    model = body.get("model") if isinstance(body, dict) else None
    if model is None:
        return
    if not isinstance(model, str):
        raise _bad(f"model must be a string (the served model is {served!r}), got {type(model).__name__}", "model")
    if model != served:
        raise ApiError(404, f"The model `{model}` does not exist or you do not have access to it; this server "
                            f"serves `{served}` (GET /v1/models)", code="model_not_found")


def _same(a, b) -> bool:
    """JSON equality that keeps true/false apart from 1/0."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if _is_number(a) and _is_number(b):
        return a == b
    return type(a) is type(b) and a == b


def completion_body(cid: str, created: int, model: str, choices: list[dict], usage: dict | None) -> dict:
    """Return a text_completion object (a whole response, or one chunk of a stream when usage is None)."""
    body = {"id": cid, "object": "text_completion", "created": created, "model": model, "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return body


def choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    """Return one entry of "choices"."""
    return {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish_reason}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """Return the "usage" object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
