"""Request fields both endpoints share beyond sampling: ``n`` choices, ``logprobs``, ``response_format``.

Each parser checks one field at the boundary and raises ApiError(400) naming it and the value at fault:

* ``n``: choices per prompt, 1..MAX_N; choice j of a prompt samples with its own seed (``choice_seed``), so
  seeded choices differ from each other and come out the same on every run; greedy choices are equal.
* ``logprobs``: how many top alternatives to report per token, 0..MAX_LOGPROBS (the sampled or prompt
  token's own log-probability always comes too); the tokenizer must give each token its own text, which
  hpcpipe's bytes tokenizer cannot (its tokens are UTF-8 bytes, most of them no text on their own).
* ``response_format``: ``{"type": "text" | "json_object" | "json_schema"}``, compiled to a grammar by
  hpcpipe.serve.grammar (a schema the library refuses is a 400 with its reason).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from hpcpipe.serve.api_error import ApiError
from hpcpipe.serve.grammar import GrammarError, compile_format, format_schema
from hpcpipe.serve.logprobs import MAX_LOGPROBS
from hpcpipe.serve.sampling import SamplingParams

MAX_N = 32                 # choices per prompt (and n x prompts <= the prompts limit)
MAX_SEED = 2**63 - 1


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_n(body: dict, prompts: int, max_prompts: int) -> int:
    """Return ``n``: choices per prompt, with n x prompts within the request limit."""
    n = body.get("n")
    if n is None:
        return 1
    if not _is_int(n) or not 1 <= n <= MAX_N:
        raise ApiError(400, f"n must be an integer in [1, {MAX_N}], got {n!r}", "n")
    if n * prompts > max_prompts:
        raise ApiError(400, f"n = {n} choices for each of {prompts} prompts makes {n * prompts} sequences; at most "
                            f"{max_prompts} per request", "n")
    return n


def choice_seed(seed: int, j: int) -> int:
    """The seed of choice j of a prompt: the request's own for choice 0, one drawn from (seed, j) for the others."""
    if j == 0:
        return seed
    return int(np.random.SeedSequence([seed, j]).generate_state(1, np.uint64)[0]) & MAX_SEED


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The sampling parameters of each of n choices (a seed each)."""
    return [params if j == 0 else dataclasses.replace(params, seed=choice_seed(params.seed, j)) for j in range(n)]


def check_token_texts(tokenizer: Any, field: str) -> None:
    """Raise ApiError(400) when the tokenizer cannot give each token its own text (log-probabilities name them)."""
    if getattr(tokenizer, "kind", None) == "bytes":
        raise ApiError(400, f"{field} cannot be served for this model: its bytes tokenizer has no text per token "
                            f"(a token is one UTF-8 byte, and 128 of the 256 are never text on their own), and the "
                            f"log-probabilities are reported by token text; serve a model with a chars or Hugging "
                            f"Face tokenizer", field)


def parse_top(value: Any, field: str, tokenizer: Any) -> int:
    """Return a number of top alternatives 0..MAX_LOGPROBS (``field`` names it in errors)."""
    if not _is_int(value) or not 0 <= value:
        raise ApiError(400, f"{field} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}", field)
    if value > MAX_LOGPROBS:
        raise ApiError(400, f"{field} is {value} but at most {MAX_LOGPROBS} alternatives per token are returned "
                            f"(the documented maximum)", field)
    check_token_texts(tokenizer, field)
    return value


def parse_completion_logprobs(body: dict, tokenizer: Any) -> int:
    """Return the completions endpoint's ``logprobs``: top alternatives per token, or -1 for none (null, false)."""
    value = body.get("logprobs")
    if value is None or value is False:
        return -1
    return parse_top(value, "logprobs", tokenizer)


def parse_chat_logprobs(body: dict, tokenizer: Any) -> int:
    """Return the chat endpoint's ``logprobs`` (bool) + ``top_logprobs`` (int) as alternatives per token, -1: none."""
    on, top = body.get("logprobs"), body.get("top_logprobs")
    if on is not None and not isinstance(on, bool):
        raise ApiError(400, f"logprobs must be true or false, got {on!r}", "logprobs")
    if not on:
        if top is not None:
            raise ApiError(400, f"top_logprobs ({top!r}) needs \"logprobs\": true", "top_logprobs")
        return -1
    if top is None:
        check_token_texts(tokenizer, "logprobs")
        return 0
    return parse_top(top, "top_logprobs", tokenizer)


def parse_format(body: dict, tokenizer: Any) -> str:
    """Return the grammar of ``response_format`` ("" for none or text); ApiError(400) with the library's reason."""
    return compile_checked(format_to_compile(body), tokenizer)


def format_to_compile(body: dict) -> Any:
    """Return the ``response_format`` a grammar must be compiled for (None: none or text), its shape checked here
    (cheap); ApiError(400) naming what is wrong. :func:`compile_checked` compiles it (the server: off its loop)."""
    value = body.get("response_format")
    if value is None:
        return None
    try:
        return None if format_schema(value) is None else value
    except GrammarError as exc:
        raise ApiError(400, _message(exc), "response_format") from None


def compile_checked(value: Any, tokenizer: Any) -> str:
    """Return the grammar of a response_format ("" for None); ApiError(400) with the library's reason."""
    if value is None:
        return ""
    try:
        return compile_format(value, tokenizer)
    except GrammarError as exc:
        raise ApiError(400, _message(exc), "response_format") from None


def _message(exc: GrammarError) -> str:
    return str(exc) if str(exc).startswith("response_format") else f"response_format: {exc}"
