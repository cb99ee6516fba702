"""The weight products of :mod:`hpcpipe.kernels.cpu` on a GPU: the same interface over CuPy arrays, compiled by
NVRTC at first use (CuPy's RawKernel), for float32, bfloat16, float16 and q8_0 row weights.

One warp computes one weight row's outputs for up to eight rows of x at a time, its lanes striding along the
row (coalesced reads), the partial sums reduced across the warp: a weight is read once per eight rows of x,
widened in registers (a bfloat16 is the high half of a float32; a float16 converted from its bits; q8_0 times
its block's scale), and the sums are float32 as on the CPU. CuPy has no bfloat16 dtype, which is why these are
RawKernels rather than cuBLAS calls on widened copies (which would double a stored model's bytes).
"""

from __future__ import annotations

from typing import Any

from hpcpipe.kernels.formats import RowWeight

ROWS_AT_ONCE = 8
THREADS = 256                 # 8 warps a block: 8 weight rows

_SOURCE = r"""
__device__ __forceinline__ float f16_to_f32(unsigned short h) {
    unsigned sign = (unsigned)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (e == 0x1fu) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (e == 0) {
        if (man == 0) {
            u = sign;
        } else {
            int shift = -1;
            do { shift++; man <<= 1; } while (!(man & 0x400u));
            u = sign | ((unsigned)(127 - 15 - shift) << 23) | ((man & 0x3ffu) << 13);
        }
    } else {
        u = sign | ((e + 127 - 15) << 23) | (man << 13);
    }
    return __uint_as_float(u);
}

__device__ __forceinline__ float weight_at(const void *w, const unsigned short *scales, long long n, long long k,
                                           long long cols) {
    long long i = n * cols + k;
#if KIND == 0
    return ((const float *)w)[i];
#elif KIND == 1
    return __uint_as_float(((unsigned)((const unsigned short *)w)[i]) << 16);
#elif KIND == 2
    return f16_to_f32(((const unsigned short *)w)[i]);
#else
    return (float)((const signed char *)w)[i] * f16_to_f32(scales[n * (cols / 32) + k / 32]);
#endif
}

extern "C" __global__ void matmul(const void *w, const unsigned short *scales, const float *x, float *y,
                                  long long rows, long long cols, long long m, long long ldx, long long ldy,
                                  int accumulate) {
    long long n = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (n >= rows) return;
    for (long long r0 = 0; r0 < m; r0 += 8) {
        int rn = (int)(m - r0 < 8 ? m - r0 : 8);
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (long long k = lane; k < cols; k += 32) {
            float wv = weight_at(w, scales, n, k, cols);
#pragma unroll
            for (int r = 0; r < 8; r++)
                if (r < rn) acc[r] += wv * x[(r0 + r) * ldx + k];
        }
#pragma unroll
        for (int r = 0; r < 8; r++) {
            float v = acc[r];
            for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
            if (lane == 0 && r < rn) {
                float *out = y + (r0 + r) * ldy + n;
                *out = accumulate ? *out + v : v;
            }
        }
    }
}
"""

_KIND_CODES = {"float32": 0, "bfloat16": 1, "float16": 2, "q8_0": 3}
_kernels: dict[str, Any] = {}


def kernel_source(kind: str) -> str:
    """The CUDA C source of the product for row weights of ``kind`` (NVRTC compiles it)."""
    return f"#define KIND {_KIND_CODES[kind]}\n" + _SOURCE


def _kernel(kind: str) -> Any:
    if kind not in _kernels:
        import cupy
        _kernels[kind] = cupy.RawKernel(kernel_source(kind), "matmul")
    return _kernels[kind]


def to_device(w: RowWeight) -> RowWeight:
    """The row weight with its arrays on the current GPU (the same bytes: 16-bit and q8_0 stay compact)."""
    import cupy
    return RowWeight(w.kind, cupy.ascontiguousarray(cupy.asarray(w.data)),
                     None if w.scales is None else cupy.ascontiguousarray(cupy.asarray(w.scales)))


def _f32_rows(x: Any, cols: int, what: str) -> Any:
    if str(x.dtype) != "float32" or x.ndim != 2 or x.shape[1] != cols or x.strides[1] != 4:
        raise ValueError(f"{what}: expected float32 rows of {cols} contiguous values, got {x.dtype} {x.shape}")
    return x


def matmul(w: RowWeight, x: Any, out: Any = None, accumulate: bool = False) -> Any:
    """Return x @ W.T on the GPU (x: (m, in) float32 CuPy rows; ``w`` on the device, :func:`to_device`;
    ``out``: (m, out) float32, added to when ``accumulate``)."""
    import cupy
    rows, cols = w.shape
    x = _f32_rows(x, cols, "matmul input")
    if w.kind == "q8_0" and cols % 32:
        raise ValueError(f"matmul: a q8_0 weight's input width must be a multiple of 32, got {cols}")
    if out is None:
        out = cupy.empty((x.shape[0], rows), dtype=cupy.float32)
    out = _f32_rows(out, rows, "matmul output")
    if out.shape[0] != x.shape[0]:
        raise ValueError(f"matmul: {x.shape[0]} input rows but {out.shape[0]} output rows")
    if x.shape[0] and rows:
        scales = w.scales if w.scales is not None else cupy.empty(1, dtype=cupy.uint16)
        blocks = (rows * 32 + THREADS - 1) // THREADS
        _kernel(w.kind)((blocks,), (THREADS,), (w.data, scales, x, out, cupy.int64(rows), cupy.int64(cols),
                                                 cupy.int64(x.shape[0]), cupy.int64(x.strides[0] // 4),
                                                 cupy.int64(out.strides[0] // 4), cupy.int32(int(accumulate))))
    return out
