"""The logger of the HTTP server's connections: a request its parser refuses is one rate-limited line, no traceback.

aiohttp answers a request it cannot parse (a bad Content-Length, a control byte in a header, a header line
over 8 KiB, too many headers, a byte a URL may not hold, a chunked body that does not decode as its
Content-Encoding says) with a 400 and logs it as an exception: eleven to forty lines of traceback into the
job's log per request, which any client (or a port scanner) can send at will.
Those become one line, the first and then one per ``every``, as the other client-caused events do
(:mod:`hpcpipe.serve.quiet_log`); anything else the connection handler logs (a failure that is a bug)
keeps its traceback.
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web import RequestPayloadError

from hpcpipe.serve.quiet_log import RateLimitedLog

REASON_CHARS = 160    # the parser's reason may quote the client's bytes: enough to recognise them, no more


class MalformedRequests(logging.Filter):
    """Drop the parser's refusals from the log, printing one line for the first and one per ``every`` after."""

    def __init__(self, every: int = 100, stream: Any = None):
        super().__init__()
        self.log = RateLimitedLog(every, stream)

    def filter(self, record: logging.LogRecord) -> bool:
        """True (log as usual) unless the record is an HTTP parse error, which is counted and summarised."""
        exc = _client_error(record.exc_info[1] if record.exc_info else None)
        if exc is None:
            return True
        remote = record.args[0] if isinstance(record.args, tuple) and record.args else "a client"
        reason = (exc.message or type(exc).__name__).strip().splitlines()[0].rstrip(":")
        if len(reason) > REASON_CHARS:
            reason = reason[:REASON_CHARS] + "..."
        self.log(f"hpcpipe: [http] a malformed HTTP request from {remote} was refused with {exc.code or 400} "
                 f"({reason})")
        return False


def _client_error(exc: BaseException | None) -> HttpProcessingError | None:
    """The parser's refusal behind exc: itself, or what a body that failed to decode (RequestPayloadError, logged
    as "Unhandled exception" when aiohttp drains the rest of it after the 400) was caused by; else None."""
    seen = 0
    while exc is not None and seen < 8:        # a short chain: never walk a cycle of causes
        if isinstance(exc, HttpProcessingError):
            return exc
        if not isinstance(exc, RequestPayloadError):
            return None
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def connection_logger(port: int, every: int = 100, stream: Any = None) -> logging.Logger:
    """Return the logger for one server's connection handlers (below aiohttp.server, so its configuration
    applies), with a fresh MalformedRequests filter."""
    logger = logging.getLogger(f"aiohttp.server.hpcpipe-{int(port)}")
    for old in [f for f in logger.filters if isinstance(f, MalformedRequests)]:
        logger.removeFilter(old)
    logger.addFilter(MalformedRequests(every, stream))
    return logger
