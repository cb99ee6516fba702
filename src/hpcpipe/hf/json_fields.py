"""Typed reads of a Hugging Face config.json's keys: one-line ConfigErrors naming the file, the key and the value."""

from __future__ import annotations

import math
from typing import Any

from hpcpipe.errors import ConfigError


def get(cfg: dict, key: str, label: str, default: Any = ...) -> Any:
    """Return cfg[key]; ConfigError 'missing key' when absent (or null) and no default is given."""
    value = cfg.get(key)
    if value is None:
        if default is ...:
            raise ConfigError(f"{label} lacks the key {key!r}")
        return default
    return value


def positive_int(cfg: dict, key: str, label: str, default: Any = ...) -> int:
    """Return a positive integer key of the config; ConfigError naming key and value otherwise."""
    value = get(cfg, key, label, default)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{label}: {key} must be a positive integer, got {value!r}")
    return value


def number(cfg: dict, key: str, label: str, default: Any = ...) -> float:
    """Return a finite positive number key of the config as float; ConfigError naming key and value otherwise."""
    value = get(cfg, key, label, default)
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{label}: {key} must be a positive number, got {value!r}")
    return float(value)


def flag(cfg: dict, key: str, label: str, default: bool) -> bool:
    """Return a boolean key of the config; ConfigError naming key and value otherwise."""
    value = get(cfg, key, label, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{label}: {key} must be true or false, got {value!r}")
    return value
