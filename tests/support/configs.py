"""Config sections as the tests write them: merged key by key, and as --set arguments of the commands."""

from __future__ import annotations

import json


def sets(**sections) -> list[str]:
    """Turn {'train': {'steps': 4}} into ['--set', 'train.steps=4', ...] (values as TOML)."""
    out = []
    for section, values in sections.items():
        for key, value in values.items():
            out += ["--set", f"{section}.{key}={json.dumps(value)}"]
    return out


def merged(*layers: dict) -> dict:
    """Merge config sections key by key ({section: {key: value}}); a later layer's key wins. Copies, never aliases."""
    out: dict = {}
    for layer in layers:
        for section, values in layer.items():
            out.setdefault(section, {}).update(values)
    return out
