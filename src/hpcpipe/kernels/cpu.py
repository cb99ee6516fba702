"""The compiled CPU kernels (``hpcpipe/kernels/csrc``, built by pip as ``hpcpipe.kernels._cpu``) through ctypes.

:func:`library` loads them once per process (None when the package was installed without a C compiler or
``HPCPIPE_KERNELS=numpy`` asks for the NumPy path); the functions here check shapes and dtypes, then hand
raw pointers to C. Each call is one ctypes crossing (about a microsecond), so callers batch work: a
decode stage is one :meth:`StagePlan.forward` per step, not one call per layer.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any

import numpy as np

from hpcpipe.kernels.formats import RowWeight

_KIND_CODES = {"float32": 0, "bfloat16": 1, "float16": 2, "q8_0": 3}
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


# hp_stage.reduce: int reduce(void *ctx, float *x, int64_t n), the tp ranks' in-place sum (0: done)
REDUCE = ctypes.CFUNCTYPE(ctypes.c_int, _ptr, _ptr, _i64)


class Weight(ctypes.Structure):
    """hp_weight: one (out, in) matrix as the kernels read it."""

    _fields_ = [("fmt", ctypes.c_int32), ("pad", ctypes.c_int32), ("rows", _i64), ("cols", _i64),
                ("data", _ptr), ("scales", _ptr)]


class Block(ctypes.Structure):
    """hp_block: one decoder block's parameters and KV cache."""

    _fields_ = [("norm1_w", _ptr), ("norm1_b", _ptr), ("qkv", Weight), ("qkv_b", _ptr), ("q_norm_w", _ptr),
                ("k_norm_w", _ptr), ("o", Weight), ("o_b", _ptr), ("norm2_w", _ptr), ("norm2_b", _ptr),
                ("up", Weight), ("up_b", _ptr), ("down", Weight), ("down_b", _ptr), ("cache", _ptr),
                ("window", _i64), ("tables", _ptr), ("pages", _i64)]


class Stage(ctypes.Structure):
    """hp_stage: a decode stage's sizes, kind flags, RoPE tables, blocks and KV block tables."""

    _fields_ = [("n_blocks", _i64), ("d", _i64), ("n_heads", _i64), ("n_kv", _i64), ("hd", _i64), ("ff", _i64),
                ("slots", _i64), ("seq_len", _i64), ("norm", ctypes.c_int32), ("act", ctypes.c_int32),
                ("rope", ctypes.c_int32), ("pad", ctypes.c_int32), ("eps", ctypes.c_float),
                ("qk_eps", ctypes.c_float), ("scale", ctypes.c_float), ("pad2", ctypes.c_float),
                ("cos", _ptr), ("sin", _ptr), ("blocks", ctypes.POINTER(Block)), ("page", _i64), ("pages", _i64),
                ("max_pages", _i64), ("tables", _ptr), ("reduce", REDUCE), ("reduce_ctx", _ptr)]


_LIB: list = []


def library() -> Any:
    """The loaded kernels (ctypes.CDLL), or None: not built, or HPCPIPE_KERNELS=numpy."""
    if not _LIB:
        _LIB.append(_load())
    return _LIB[0]


def _load() -> Any:
    if os.environ.get("HPCPIPE_KERNELS", "").lower() == "numpy":
        return None
    here = Path(__file__).parent
    found = sorted(here.glob("_cpu*.so"))
    if not found:
        return None
    lib = ctypes.CDLL(str(found[0]))
    signatures = {
        "hp_init": ([], ctypes.c_int), "hp_use_portable": ([ctypes.c_int], None),
        "hp_set_gemm_rows": ([_i64], None), "hp_swiglu": ([_ptr, _ptr, _i64, _i64], None),
        "hp_gelu": ([_ptr, _i64], None),
        "hp_q8_int8_activations": ([ctypes.c_int], ctypes.c_int),
        "hp_matmul": ([ctypes.POINTER(Weight), _ptr, _i64, _i64, _ptr, _i64, ctypes.c_int], None),
        "hp_rmsnorm": ([_ptr, _ptr, _ptr, _i64, _i64, ctypes.c_float], None),
        "hp_layernorm": ([_ptr, _ptr, _ptr, _ptr, _i64, _i64, ctypes.c_float], None),
        "hp_stage_forward": ([ctypes.POINTER(Stage), _ptr, _i64, _ptr, _ptr, _ptr], ctypes.c_int),
        "hp_scratch_floats": ([ctypes.POINTER(Stage), _i64], _i64),
    }
    for name, (args, res) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    lib.hp_init()
    lib.hp_q8_int8_activations(int(_int8_activations_wanted()))
    return lib


def _int8_activations_wanted() -> bool:
    value = os.environ.get("HPCPIPE_Q8_ACTIVATIONS", "int8").lower()
    if value not in ("int8", "float"):
        raise ValueError(f"HPCPIPE_Q8_ACTIVATIONS must be 'int8' or 'float', got {value!r}")
    return value == "int8"


def vector_paths() -> str:
    """'avx512' when the AVX-512 paths run, 'portable' otherwise (or when no kernels are loaded)."""
    lib = library()
    return "avx512" if lib is not None and lib.hp_init() else "portable"


def use_portable(on: bool) -> None:
    """Force the portable C paths (tests compare them with the AVX-512 ones)."""
    lib = library()
    if lib is not None:
        lib.hp_use_portable(int(on))


def gemm_rows(rows: int) -> None:
    """Multiply through the widened-panel product (csrc/gemm.c) from ``rows`` rows of x (default 64, q8_0 half
    that; tests: 1)."""
    lib = library()
    if lib is not None:
        lib.hp_set_gemm_rows(int(rows))


def int8_activations(on: bool | None = None) -> bool:
    """Whether q8_0 products quantize the activations to q8 and multiply int8 by int8 (AVX512-VNNI; ``on`` sets it).

    On by default (``HPCPIPE_Q8_ACTIVATIONS=float`` turns it off for a process): llama.cpp's computation, faster
    than widening the weights to multiply float32 activations, and not bit-exact with it. False where the CPU has
    no VNNI or the portable paths are forced: those multiply float activations.
    """
    lib = library()
    if lib is None:
        return False
    return bool(lib.hp_q8_int8_activations(-1 if on is None else int(on)))


def _address(array: np.ndarray | None) -> int | None:
    return None if array is None else array.ctypes.data


def weight_struct(w: RowWeight) -> Weight:
    """The hp_weight of a row weight (its arrays must outlive the struct: the caller keeps ``w``)."""
    rows, cols = w.shape
    return Weight(_KIND_CODES[w.kind], 0, rows, cols, _address(w.data), _address(w.scales))


def _f32_rows(x: np.ndarray, cols: int, what: str) -> np.ndarray:
    if x.dtype != np.float32 or x.ndim != 2 or x.shape[1] != cols or x.strides[1] != 4:
        raise ValueError(f"{what}: expected float32 rows of {cols} contiguous values, got {x.dtype} {x.shape}")
    return x


def matmul(w: RowWeight, x: np.ndarray, out: np.ndarray | None = None, accumulate: bool = False) -> np.ndarray:
    """Return x @ W.T (x: (m, in) float32 rows; ``out``: (m, out) float32, added to when ``accumulate``)."""
    lib = library()
    rows, cols = w.shape
    x = _f32_rows(x, cols, "matmul input")
    if out is None:
        out = np.empty((x.shape[0], rows), dtype=np.float32)
    out = _f32_rows(out, rows, "matmul output")
    if out.shape[0] != x.shape[0]:
        raise ValueError(f"matmul: {x.shape[0]} input rows but {out.shape[0]} output rows")
    ws = weight_struct(w)
    lib.hp_matmul(ctypes.byref(ws), x.ctypes.data, x.shape[0], x.strides[0] // 4, out.ctypes.data,
                  out.strides[0] // 4, int(accumulate))
    return out


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, out: np.ndarray | None = None) -> np.ndarray:
    """Return the RMSNorm of each contiguous float32 row of x."""
    lib = library()
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty_like(x) if out is None else out
    lib.hp_rmsnorm(x.ctypes.data, weight.ctypes.data, out.ctypes.data, x.shape[0], x.shape[1], float(eps))
    return out


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float,
               out: np.ndarray | None = None) -> np.ndarray:
    """Return the LayerNorm of each contiguous float32 row of x."""
    lib = library()
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty_like(x) if out is None else out
    lib.hp_layernorm(x.ctypes.data, weight.ctypes.data, bias.ctypes.data, out.ctypes.data, x.shape[0],
                     x.shape[1], float(eps))
    return out


def swiglu(gate_up: np.ndarray) -> np.ndarray:
    """Return silu(gate) * up of float32 rows laid out gate | up (m, 2 ff) -> (m, ff)."""
    lib = library()
    gate_up = np.ascontiguousarray(gate_up, dtype=np.float32)
    m, two_ff = gate_up.shape
    out = np.empty((m, two_ff // 2), dtype=np.float32)
    lib.hp_swiglu(gate_up.ctypes.data, out.ctypes.data, m, two_ff // 2)
    return out


def gelu(x: np.ndarray) -> np.ndarray:
    """Return the tanh-approximated GELU of float32 values (a fresh array)."""
    lib = library()
    out = np.array(x, dtype=np.float32, order="C")
    lib.hp_gelu(out.ctypes.data, out.size)
    return out
