"""What each endpoint answers: a text_completion (POST /v1/completions) or a chat.completion (POST
/v1/chat/completions), whole or as server-sent chunks, with log-probabilities when asked. The HTTP handler is
the same for both; only these shapes differ. ``head`` holds the response's id, creation time, model name and
the token texts (hpcpipe.serve.token_text.TokenTexts) that name the log-probabilities' tokens."""

from __future__ import annotations

from hpcpipe.serve.chat_schema import chat_body, chat_chunk
from hpcpipe.serve.openai_schema import choice, completion_body
from hpcpipe.serve.token_text import chat_logprobs, completion_logprobs


class TextShape:
    """text_completion objects: n choices per prompt, text deltas."""

    prefix = "cmpl"

    def whole(self, head: dict, texts: list[str], reasons: list[str | None], logprobs: list[tuple | None],
              usage: dict) -> dict:
        """The whole response (``logprobs``: per choice, its rows and their text offsets, or None)."""
        choices = [choice(i, texts[i], reasons[i], None if got is None else completion_logprobs(*got, head["texts"]))
                   for i, got in enumerate(logprobs)]
        return completion_body(head["cid"], head["created"], head["model"], choices, usage)

    def opening(self, head: dict, choices: int) -> list[dict]:
        """Chunks sent before the first token (none)."""
        return []

    def chunk(self, head: dict, index: int, text: str, finish: str | None, rows: list | None = None,
              offsets: list[int] | None = None) -> dict:
        """One delta of choice ``index`` (with its tokens' log-probabilities when asked)."""
        logprobs = None if rows is None else completion_logprobs(rows, offsets, head["texts"])
        return completion_body(head["cid"], head["created"], head["model"], [choice(index, text, finish, logprobs)],
                               None)

    def usage_chunk(self, head: dict, usage: dict) -> dict:
        """The last chunk when stream_options.include_usage: usage and no choices."""
        return completion_body(head["cid"], head["created"], head["model"], [], usage)


class ChatShape:
    """chat.completion objects: an assistant message per choice; a stream opens with the role, then content deltas."""

    prefix = "chatcmpl"

    def whole(self, head: dict, texts: list[str], reasons: list[str | None], logprobs: list[tuple | None],
              usage: dict) -> dict:
        """The whole response (``logprobs``: per choice, its rows and their text offsets, or None)."""
        return chat_body(head["cid"], head["created"], head["model"], texts, reasons,
                         [None if got is None else chat_logprobs(got[0], head["texts"]) for got in logprobs], usage)

    def opening(self, head: dict, choices: int) -> list[dict]:
        """The first chunk of each choice: the assistant's role with empty content, as OpenAI's stream begins."""
        return [chat_chunk(head["cid"], head["created"], head["model"], {"role": "assistant", "content": ""}, None,
                           index=i) for i in range(choices)]

    def chunk(self, head: dict, index: int, text: str, finish: str | None, rows: list | None = None,
              offsets: list[int] | None = None) -> dict:
        """One content delta (the finishing chunk carries the finish reason and no more content); a chunk that
        brings log-probability rows has content, "" when the tokens' text is held back (as completions' text)."""
        delta = {"content": text} if text or rows else {}
        return chat_chunk(head["cid"], head["created"], head["model"], delta, finish,
                          index=index, logprobs=None if rows is None else chat_logprobs(rows, head["texts"]))

    def usage_chunk(self, head: dict, usage: dict) -> dict:
        """The last chunk when stream_options.include_usage: usage and no choices."""
        return chat_chunk(head["cid"], head["created"], head["model"], {}, None, usage)
