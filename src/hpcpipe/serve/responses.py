"""What each endpoint answers: a text_completion (POST /v1/completions) or a chat.completion (POST
/v1/chat/completions), whole or as server-sent chunks. The HTTP handler is the same for both; only these
shapes differ."""

from __future__ import annotations

from hpcpipe.serve.chat_schema import chat_body, chat_chunk
from hpcpipe.serve.openai_schema import choice, completion_body


class TextShape:
    """text_completion objects: one choice per prompt, text deltas."""

    prefix = "cmpl"

    def whole(self, head: dict, texts: list[str], reasons: list[str | None], usage: dict) -> dict:
        """The whole response."""
        choices = [choice(i, texts[i], reasons[i]) for i in range(len(texts))]
        return completion_body(head["cid"], head["created"], head["model"], choices, usage)

    def opening(self, head: dict) -> list[dict]:
        """Chunks sent before the first token (none)."""
        return []

    def chunk(self, head: dict, index: int, text: str, finish: str | None) -> dict:
        """One delta of choice ``index``."""
        return completion_body(head["cid"], head["created"], head["model"], [choice(index, text, finish)], None)

    def usage_chunk(self, head: dict, usage: dict) -> dict:
        """The last chunk when stream_options.include_usage: usage and no choices."""
        return completion_body(head["cid"], head["created"], head["model"], [], usage)


class ChatShape:
    """chat.completion objects: one assistant message; a stream opens with the role, then content deltas."""

    prefix = "chatcmpl"

    def whole(self, head: dict, texts: list[str], reasons: list[str | None], usage: dict) -> dict:
        """The whole response."""
        return chat_body(head["cid"], head["created"], head["model"], texts[0], reasons[0], usage)

    def opening(self, head: dict) -> list[dict]:
        """The first chunk: the assistant's role with empty content, as OpenAI's stream begins."""
        return [chat_chunk(head["cid"], head["created"], head["model"], {"role": "assistant", "content": ""}, None)]

    def chunk(self, head: dict, index: int, text: str, finish: str | None) -> dict:
        """One content delta (the finishing chunk carries the finish reason and no more content)."""
        return chat_chunk(head["cid"], head["created"], head["model"], {"content": text} if text else {}, finish)

    def usage_chunk(self, head: dict, usage: dict) -> dict:
        """The last chunk when stream_options.include_usage: usage and no choices."""
        return chat_chunk(head["cid"], head["created"], head["model"], {}, None, usage)
