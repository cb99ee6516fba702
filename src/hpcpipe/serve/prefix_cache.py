"""Automatic prefix caching: full KV blocks keyed by the hash of their whole token prefix, reused by later requests.

Block i of a sequence holds positions [i * page, (i + 1) * page). Its key chains the key of block i - 1
with block i's own tokens::

    key[0] = H(b"" , tokens[0:page]);   key[i] = H(key[i - 1], tokens[i * page:(i + 1) * page])

so one key names the whole prefix up to the block's end, and equal keys mean equal keys and values on every
stage (the cache of a position depends only on the tokens up to it). A new request looks its prompt's full
blocks up in order and stops at the first miss; it reuses the hits and prefills from the first position
after them. At least the prompt's last token is always computed, since sampling needs its logits, so a hit
never covers a block that holds the last prompt token. H is BLAKE2b (16 bytes): a collision would hand a
request another prefix's cache, so the key is a cryptographic hash, not Python's ``hash``.

Only the scheduler rank computes keys and decides hits (hpcpipe.serve.scheduler); the other stages learn
the block tables from the work items.
"""

from __future__ import annotations

import hashlib

import numpy as np


def block_key(previous: bytes, tokens: list[int]) -> bytes:
    """The key of a block holding ``tokens``, after the block keyed ``previous`` (b"" for the first)."""
    digest = hashlib.blake2b(previous, digest_size=16)
    digest.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return digest.digest()


def prefix_keys(tokens: list[int], page: int, count: int, previous: bytes = b"", start: int = 0) -> list[bytes]:
    """Keys of blocks ``start``, ..., ``count - 1`` of ``tokens`` (``previous``: the key of block start - 1)."""
    keys = []
    for i in range(start, count):
        previous = block_key(previous, tokens[i * page:(i + 1) * page])
        keys.append(previous)
    return keys


class PrefixStats:
    """Counts for /metrics: prompt tokens looked up and found cached, requests with a hit."""

    def __init__(self):
        self.queried_tokens = 0
        self.cached_tokens = 0
        self.queries = 0
        self.hits = 0

    def count(self, prompt_tokens: int, cached_tokens: int) -> None:
        """Count one admitted request's prompt and the part of it found cached."""
        self.queries += 1
        self.queried_tokens += prompt_tokens
        self.cached_tokens += cached_tokens
        self.hits += cached_tokens > 0
