"""What turns one request's prompts into token ids: run by a prompt worker (:mod:`hpcpipe.serve.prompt_pool`), or in
place where nothing waits on it (tests, tools).

A job is a small JSON object:

* ``{"text": str, "where": "prompt[1]"}``: a completions prompt, encoded as the tokenizer does by default;
* ``{"chat": messages}``: messages rendered with the model's chat template (at most ``max_chars`` characters,
  counted while it renders), the text encoded without adding special tokens (the template writes its own);
* ``{"decode": ids}``: the text of a token-id prompt (``echo`` puts it before the choice's text).

Every way a job can fail because of what the request holds is an ApiError(400) naming the field: text that is not
valid Unicode (a lone surrogate), a tokenizer that fails on the text (the Rust side of ``tokenizers`` panics, e.g.
on a regex that backtracks catastrophically: pyo3 raises that as a BaseException), a template that refuses the
messages or renders too much, and a prompt that encodes to no tokens: such a request could never start, and once
held a queue slot until the watchdog aborted the whole server.
"""

from __future__ import annotations

from typing import Any

from hpcpipe.serve.api_error import ApiError


def unicode_problem(text: str) -> tuple[int, int] | None:
    """Return (position, code point) of the first lone surrogate in text (not valid Unicode); None if none."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start, ord(text[exc.start])
    return None


def check_text(text: str, where: str, param: str) -> None:
    """Raise ApiError(400) when text holds a lone surrogate, which no tokenizer can encode."""
    problem = unicode_problem(text)
    if problem is not None:
        raise ApiError(400, f"{where} holds a lone surrogate U+{problem[1]:04X} at position {problem[0]}: it is not "
                            f"valid Unicode text (send UTF-8 text, or \\u escapes that pair up)", param)


def _line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300] or type(exc).__name__


def encode(tokenizer: Any, text: str, where: str, param: str, special: bool | None = None) -> list[int]:
    """Return the token ids of text (``special``: add_special_tokens, None = the tokenizer's default); ApiError(400)
    naming ``where`` when it is not valid Unicode, the tokenizer fails on it, or it encodes to no tokens."""
    check_text(text, where, param)
    try:
        ids = tokenizer.encode(text) if special is None else tokenizer.encode(text, add_special_tokens=special)
    except (KeyboardInterrupt, SystemExit):
        raise
    except ValueError as exc:        # a chars tokenizer lacks a character: its message names it
        raise ApiError(400, f"{where} cannot be encoded: {str(exc).removeprefix('tokenizer: ')}", param) from None
    except MemoryError:
        raise ApiError(400, f"{where} cannot be encoded: the tokenizer ran out of memory on it", param) from None
    except BaseException as exc:     # noqa: BLE001 - a Rust panic (pyo3's PanicException is a BaseException)
        raise ApiError(400, f"{where} cannot be encoded: the tokenizer failed on it ({type(exc).__name__}: "
                            f"{_line(exc)})", param) from None
    if len(ids) == 0:                # it would never start: no token to prefill, nothing to sample after
        raise ApiError(400, f"no tokens in {where} ({len(text)} characters of text encode to none): a request "
                            f"needs at least one prompt token", param)
    return ids.tolist() if hasattr(ids, "tolist") else [int(i) for i in ids]


def chat_ids(tokenizer: Any, messages: Any, max_chars: int | None = None) -> list[int]:
    """Return the token ids of messages rendered with the model's chat template; ApiError(400) when impossible."""
    from hpcpipe.hf.chat import ChatError, apply_chat_template

    if not hasattr(tokenizer, "files"):
        raise ApiError(400, f"this model has a {tokenizer.kind} tokenizer and no chat template; use /v1/completions "
                            f"with plain text", "messages")
    try:
        text = apply_chat_template(tokenizer, messages, max_chars=max_chars)
    except ChatError as exc:
        raise ApiError(400, str(exc), "messages") from None
    try:
        return encode(tokenizer, text, "the messages rendered with the model's chat template", "messages", False)
    except ApiError as exc:
        if exc.message.startswith("no tokens"):
            exc.message += "; the template writes nothing for these messages (send messages with content)"
        raise


def run_jobs(tokenizer: Any, jobs: list[dict], max_chars: int | None = None) -> list[list[int] | str]:
    """Return each job's result in order (token ids, or the text of a decode job); ApiError at the first failure."""
    out: list[list[int] | str] = []
    for job in jobs:
        if "text" in job:
            out.append(encode(tokenizer, job["text"], job.get("where", "prompt"), "prompt"))
        elif "chat" in job:
            out.append(chat_ids(tokenizer, job["chat"], max_chars))
        elif "decode" in job:
            out.append(tokenizer.decode(job["decode"]))
        else:
            raise ValueError(f"prompt job: unknown kind {sorted(job)}")
    return out
