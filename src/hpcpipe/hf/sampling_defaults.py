"""A model's own sampling defaults: the temperature, top_p and top_k of its generation_config.json.

Model makers ship the settings their model is meant to be sampled with (Qwen3: temperature 0.6, top_p
0.95, top_k 20; Llama 3: 0.6 and 0.9). vLLM applies them to every request that leaves a field out, and
transformers' ``generate`` does too; a server that sampled such a model at OpenAI's defaults (temperature
1, no top_p or top_k) would answer worse than the same model elsewhere. Only the keys the file sets are
taken (transformers' own class defaults, such as top_k 50, are not the model maker's choice); ``do_sample``
is not read, as vLLM does not. A value a request could not carry is refused naming the file and the key:
``serve.generation_config = "none"`` serves without them.
"""

from __future__ import annotations

import math
from typing import Any

from hpcpipe.errors import ConfigError

KEYS = ("temperature", "top_p", "top_k")


def sampling_defaults(gen: Any, where: str, vocab_size: int) -> dict[str, float | int]:
    """Return {key: value} of the sampling keys generation_config.json (parsed as ``gen``) sets; ConfigError naming
    ``where`` and the key for a value outside what a request may give (temperature in [0, 2], top_p in (0, 1],
    top_k an integer in [0, vocab_size], where 0 is off)."""
    if not isinstance(gen, dict):
        return {}
    out: dict[str, float | int] = {}
    for key in KEYS:
        value = gen.get(key)
        if value is None:
            continue
        number = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        if key == "temperature" and number and 0 <= value <= 2:
            out[key] = float(value)
        elif key == "top_p" and number and 0 < value <= 1:
            out[key] = float(value)
        elif key == "top_k" and isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= vocab_size:
            out[key] = int(value)
        else:
            allowed = {"temperature": "a number in [0, 2]", "top_p": "a number in (0, 1]",
                       "top_k": f"an integer in [0, {vocab_size}] (0 = off)"}[key]
            raise ConfigError(f"{where}: {key} = {value!r} is not {allowed}, as a request's {key} must be; mend the "
                              f"file, or serve without the model's sampling defaults (serve.generation_config = "
                              f"\"none\")")
    return out


def describe(defaults: dict[str, float | int]) -> str:
    """Return "temperature 0.6, top_p 0.95, top_k 20" (the keys set), or "" when none is."""
    return ", ".join(f"{key} {defaults[key]:g}" for key in KEYS if key in defaults)
