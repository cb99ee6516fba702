"""A configuration as TOML text: what ``--print-config`` prints and what the planner writes.

The text reads back with :func:`hpcpipe.config.load_config` to the same
configuration: every value a Config holds (booleans, integers, finite floats,
strings, lists, the plain tables of ``model.rope_scaling``) has a TOML form.
"""

from __future__ import annotations

import json
from typing import Any


def toml_value(value: Any) -> str:
    """One value in TOML syntax (a table inline)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no TOML form for {value!r}")


def to_toml(config: dict[str, dict[str, Any]], header: str) -> str:
    """A config (sections of keys) as TOML text, with a comment header."""
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    for section, values in config.items():
        lines.append("")
        lines.append(f"[{section}]")
        lines.extend(f"{key} = {toml_value(value)}" for key, value in values.items())
    return "\n".join(lines) + "\n"
