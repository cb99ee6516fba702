"""A strict little parser of the Prometheus text exposition format, for the serving tests."""

from __future__ import annotations

import math
import re

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-zA-Z_][a-zA-Z0-9_]*="[^"\\]*"'
                     r'(,[a-zA-Z_][a-zA-Z0-9_]*="[^"\\]*")*)?\})? (\S+)$')


def parse_prometheus(text: str) -> dict:
    """Parse the text exposition format strictly enough to catch a malformed line; return {(name, labels): v}."""
    assert text.endswith("\n")
    types, samples = {}, {}
    for line in text.rstrip("\n").split("\n"):
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge", "histogram") and name not in types
            types[name] = kind
            continue
        if line.startswith("# HELP "):
            continue
        m = _SAMPLE.match(line)
        assert m, f"malformed sample line: {line!r}"
        name, labels, value = m.group(1), m.group(3) or "", m.group(5)
        base = re.sub(r"_(bucket|sum|count)$", "", name) if name not in types else name
        assert base in types, f"sample {name} before its # TYPE"
        v = float(value)
        assert not math.isnan(v)
        samples[(name, labels)] = v
    for name, kind in types.items():
        if kind == "histogram":
            buckets = [(k[1], v) for k, v in samples.items() if k[0] == f"{name}_bucket"]
            bounds = [float(re.match(r'le="(.+)"', lab).group(1)) for lab, _ in buckets]
            counts = [v for _, v in buckets]
            assert bounds == sorted(bounds) and bounds[-1] == math.inf
            assert counts == sorted(counts), f"{name} buckets are not cumulative"
            assert counts[-1] == samples[(f"{name}_count", "")]
    return samples
