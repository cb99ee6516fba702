"""The error every endpoint answers with: an HTTP status and OpenAI's JSON error body."""

from __future__ import annotations


class ApiError(Exception):
    """An error answered as an OpenAI-style JSON body with this HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict:
        """Return the JSON body {"error": {message, type, param, code}}."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
