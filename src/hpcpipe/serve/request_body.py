"""One request's body at the HTTP boundary: its encoding, its arrival, its size, its JSON and the model it names.

Every way a body can be wrong is one ApiError with the status a client can act on (400, 404, 408, 413);
a client that resets its connection before its body has arrived raises ``ClientGone`` instead, which
the handler counts as 499 (nobody is left to answer) without a traceback.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from hpcpipe.hf.json_text import MAX_DEPTH, nesting_depth
from hpcpipe.serve.openai_schema import ApiError, check_model

# what aiohttp decodes before the handler reads the body (br and zstd when their packages are installed, else
# aiohttp answers 400 itself); any other Content-Encoding would reach the JSON parser as it is
ENCODINGS = ("identity", "gzip", "deflate", "br", "zstd")


class ClientGone(Exception):
    """The client reset its connection before its request body had arrived."""


def check_encoding(request: web.Request) -> None:
    """Raise ApiError(400) naming a Content-Encoding the server cannot decode."""
    given = request.headers.get("Content-Encoding")
    if given is not None and given.strip().lower() not in ENCODINGS:
        raise ApiError(400, f"Content-Encoding {given!r} is not supported: send the body as it is (identity) or "
                            f"as one of {', '.join(ENCODINGS[1:])}")


async def read_spec(request: web.Request, s: dict, parse, timeout_s: float):
    """Read the body (within timeout_s seconds), check the model it names, check its fields with ``parse``
    (its Draft: the prompts are tokenized after, off the event loop).

    Raises ApiError (400, 404, 408, 413) on any problem, ClientGone when the client reset the connection.
    """
    check_encoding(request)
    try:
        # a client that announces more body than it sends must not hold its connection (and a slot of the
        # file-descriptor limit) for ever
        raw = await asyncio.wait_for(request.read(), timeout_s)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s", code="timeout") from None
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, f"the request body is larger than {s['limits']['max_body_bytes']} bytes") from None
    except RequestPayloadError as exc:      # e.g. a Content-Encoding the body is not in
        raise ApiError(400, f"the request body cannot be read: {str(exc).strip()}") from None
    except ConnectionError:
        raise ClientGone() from None
    body = parse_json(raw)
    check_model(body, s["model"])
    return parse(body, s["tokenizer"], s["seq_len"], s["limits"], s["sampling"])


def parse_json(raw: bytes) -> Any:
    """Return the JSON of a request body; ApiError(400) of one line when it is not JSON hpcpipe reads.

    Its nesting is bounded (hpcpipe.hf.json_text, 128 levels) before it is parsed: a field nested 500 deep once
    parsed fine and then overflowed the recursion of the checks after it (a 500 and a traceback of 3000 lines).
    """
    depth = nesting_depth(raw)
    if depth > MAX_DEPTH:
        raise ApiError(400, f"the request body is not valid JSON: it is nested too deeply ({depth} levels of "
                            f"arrays and objects; at most {MAX_DEPTH})")
    try:
        return json.loads(raw)
    except UnicodeDecodeError as exc:
        byte = exc.object[exc.start]
        raise ApiError(400, f"the request body is not valid JSON: it is not UTF-8 text (byte 0x{byte:02X} at "
                            f"position {exc.start})") from None
    except ValueError as exc:
        if "int_max_str_digits" in str(exc):     # Python's hint is for the server's author, not the client
            raise ApiError(400, f"the request body holds an integer of more than {sys.get_int_max_str_digits()} "
                                f"digits") from None
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:                       # unreachable below MAX_DEPTH; kept as the last word
        raise ApiError(400, "the request body is not valid JSON: it is nested too deeply") from None
