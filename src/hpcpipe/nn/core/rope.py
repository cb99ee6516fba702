"""Rotary position embedding (RoPE) as Hugging Face's Llama applies it, forward and transpose.

Inverse frequencies of a head of width hd, i = 0 .. hd/2 - 1::

    inv[i] = 1 / theta ** (2 i / hd)                                  ("default", or no scaling)
    inv[i] = inv[i] / factor                                          ("linear": positions / factor)
    "llama3", with L = original_max_position_embeddings, w = 2 pi / inv[i]:
        w < L / high_freq_factor:  inv[i]                             (high frequencies kept)
        w > L / low_freq_factor:   inv[i] / factor                    (low frequencies scaled)
        otherwise:                 (1 - s) inv[i] / factor + s inv[i],  s = (L / w - low) / (high - low)

A token at position p has angles a[i] = p inv[i]. With the two halves x1 = x[..., :hd/2] and
x2 = x[..., hd/2:] of each head (transformers' ``rotate_half``)::

    y1 = x1 cos a - x2 sin a,   y2 = x2 cos a + x1 sin a

and the backward is the transpose rotation: g1 cos a + g2 sin a, g2 cos a - g1 sin a.
Angles are computed in float64 and the cos/sin tables stored in the model's dtype, so a
float32 model multiplies float32 by float32 (no upcast through the tables).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

SUPPORTED = ("default", "linear", "llama3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _positive(kind: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"rope_scaling {kind!r} needs a positive number {name}, got {value!r}")
    return value


def check_scaling(scaling: Mapping | None) -> dict | None:
    """Return a checked copy of a Hugging Face ``rope_scaling`` dict, or None for no scaling ("default").

    The type is ``rope_type`` (or ``type``, as older configs say); keys other types do not
    use are kept and ignored. Raises ValueError for an unsupported type or a missing or bad value.
    """
    if scaling is None:
        return None
    if not isinstance(scaling, Mapping):
        raise ValueError(f"rope_scaling must be a dict or None, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in SUPPORTED:
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: {', '.join(SUPPORTED)})")
    partial = scaling.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise ValueError(f"rope_scaling partial_rotary_factor {partial!r} is not supported (only 1.0)")
    if kind == "default":
        return None
    out = dict(scaling)
    out["rope_type"] = kind
    out.pop("type", None)
    if kind == "linear":
        _positive(kind, "factor", scaling.get("factor"))
        return out
    for name in _LLAMA3_KEYS:
        _positive(kind, name, scaling.get(name))
    if not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
        raise ValueError(f"rope_scaling 'llama3' high_freq_factor {scaling['high_freq_factor']!r} must exceed "
                         f"low_freq_factor {scaling['low_freq_factor']!r}")
    return out


def inverse_frequencies(head_dim: int, theta: float, scaling: Mapping | None = None) -> list[float]:
    """Return the hd/2 inverse frequencies (Python floats, float64) of RoPE with this scaling."""
    if head_dim < 2 or head_dim % 2:
        raise ValueError(f"RoPE head_dim must be a positive even integer, got {head_dim!r}")
    scaling = check_scaling(scaling)
    inv = [1.0 / theta ** (i / head_dim) for i in range(0, head_dim, 2)]
    kind = scaling["rope_type"] if scaling else "default"
    if kind == "linear":
        return [f / scaling["factor"] for f in inv]
    if kind == "default":
        return inv
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < context / high:
            out.append(f)
        elif wavelen > context / low:
            out.append(f / factor)
        else:
            smooth = (context / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return out


def rotate(xp: Any, x: Any, cos: Any, sin: Any, out: Any = None, inverse: bool = False) -> Any:
    """Return RoPE applied to x over its last axis (the transpose rotation when ``inverse``: the backward).

    ``cos`` and ``sin`` hold hd/2 columns and broadcast against ``x[..., :hd/2]``. ``out`` may be
    x itself (the same object: in place), an array of x's shape sharing no memory with it (e.g. a
    transposed view of a fresh buffer: the rotation then also changes the layout), or None (fresh).
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    in_place = out is x
    if out is None:
        out = xp.empty(x.shape, dtype=x.dtype)
    o1, o2 = out[..., :half], out[..., half:]
    # in place, each half is overwritten while the other still needs its old value: save both products first
    t2 = x2 * sin
    t1 = x1 * sin if in_place else None
    xp.multiply(x1, cos, out=o1)
    if inverse:
        o1 += t2
    else:
        o1 -= t2
    if t1 is None:
        t1 = xp.multiply(x1, sin, out=t2)   # x1 is intact (out of place): reuse the first temporary
    xp.multiply(x2, cos, out=o2)
    if inverse:
        o2 -= t1
    else:
        o2 += t1
    return out


class Rope:
    """RoPE tables of one model (head_dim, theta, scaling) in one dtype, on xp, up to ``max_len`` positions."""

    def __init__(self, head_dim: int, theta: float, scaling: Mapping | None, xp: Any, dtype: Any, max_len: int):
        self.xp, self.dtype, self.max_len = xp, dtype, max_len
        self.head_dim = head_dim
        self.inv_freq = xp.asarray(inverse_frequencies(head_dim, theta, scaling), dtype="float64")
        self._cos = self._sin = None

    def _build(self) -> None:
        xp = self.xp
        angles = xp.arange(self.max_len, dtype="float64")[:, None] * self.inv_freq
        self._cos = xp.cos(angles).astype(self.dtype)
        self._sin = xp.sin(angles).astype(self.dtype)

    def tables(self, t: int) -> tuple[Any, Any]:
        """Return (cos, sin) of positions 0..t-1, each (t, hd/2) in the model's dtype (views of one table)."""
        if t > self.max_len:
            raise ValueError(f"RoPE: {t} positions exceed the {self.max_len} of the model's seq_len")
        if self._cos is None:
            self._build()
        return self._cos[:t], self._sin[:t]

    def at(self, positions: Any) -> tuple[Any, Any]:
        """Return (cos, sin) of an xp integer array of positions, each (*positions.shape, hd/2)."""
        if self._cos is None:
            self._build()
        return self._cos[positions], self._sin[positions]


_SHARED: dict[tuple, Rope] = {}


def shared_rope(head_dim: int, theta: float, scaling: Mapping | None, xp: Any, dtype: Any, max_len: int) -> Rope:
    """Return the Rope of these settings, one per process: every block of a model reads the same tables."""
    key = (head_dim, float(theta), repr(sorted((scaling or {}).items())), xp.__name__, str(dtype), max_len)
    rope = _SHARED.get(key)
    if rope is None:
        rope = _SHARED[key] = Rope(head_dim, theta, scaling, xp, dtype, max_len)
    return rope
