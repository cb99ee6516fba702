"""The engine's own numbers for /metrics: KV blocks, prefix caching and speculation, summed over the replicas.

Each replica's head sends its numbers with every ``Events`` message (hpcpipe.serve.protocol) as one tuple of
ints in the order of ``STATS``; the dispatcher keeps each replica's latest, and /metrics shows their sums and
two rates derived from them.
"""

from __future__ import annotations

# (name, Prometheus type, help); the order is the order of the tuples the replicas send
STATS = (
    ("hpcpipe_kv_blocks", "gauge", "KV blocks in the replicas' pools (each stage holds every block of its replica)."),
    ("hpcpipe_kv_blocks_in_use", "gauge", "KV blocks held by at least one running sequence."),
    ("hpcpipe_kv_blocks_shared", "gauge", "KV blocks held by more than one running sequence (a shared prefix)."),
    ("hpcpipe_kv_blocks_cached", "gauge", "KV blocks keyed by their token prefix, reusable by later requests."),
    ("hpcpipe_kv_evictions_total", "counter", "Cached KV blocks evicted (least recently used) to make room."),
    ("hpcpipe_prefix_cache_queries_total", "counter", "Requests whose prompt was looked up in the prefix cache."),
    ("hpcpipe_prefix_cache_hits_total", "counter", "Requests that reused at least one cached KV block."),
    ("hpcpipe_prefix_cache_queried_tokens_total", "counter", "Prompt tokens looked up in the prefix cache."),
    ("hpcpipe_prefix_cache_cached_tokens_total", "counter", "Prompt tokens found cached (not computed again)."),
    ("hpcpipe_spec_steps_total", "counter", "Speculative verification passes (one per sequence and step)."),
    ("hpcpipe_spec_proposed_tokens_total", "counter", "Tokens proposed by speculation (n-gram or draft model)."),
    ("hpcpipe_spec_accepted_tokens_total", "counter", "Proposed tokens the target model accepted."),
)
NAMES = tuple(name for name, _, _ in STATS)


def total(per_replica: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The sums over the replicas that reported (zeros where none did)."""
    sums = [0] * len(STATS)
    for stats in per_replica:
        for i, value in enumerate(stats[:len(STATS)]):
            sums[i] += int(value)
    return tuple(sums)


def render(values: tuple[int, ...]) -> list[str]:
    """The Prometheus lines of the engine's numbers and of the hit and acceptance rates."""
    out = []
    for (name, kind, text), value in zip(STATS, values, strict=True):
        out += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name} {value}"]
    named = dict(zip(NAMES, values, strict=True))
    for name, num, den, text in (
        ("hpcpipe_prefix_cache_hit_rate", "hpcpipe_prefix_cache_cached_tokens_total",
         "hpcpipe_prefix_cache_queried_tokens_total", "Share of looked-up prompt tokens found cached."),
        ("hpcpipe_spec_acceptance_rate", "hpcpipe_spec_accepted_tokens_total", "hpcpipe_spec_proposed_tokens_total",
         "Share of speculated tokens the target model accepted."),
    ):
        rate = named[num] / named[den] if named[den] else 0.0
        out += [f"# HELP {name} {text}", f"# TYPE {name} gauge", f"{name} {rate!r}"]
    return out
