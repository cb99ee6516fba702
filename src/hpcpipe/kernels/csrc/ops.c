/* The decoder's row-wise steps in float32: RMSNorm, LayerNorm, RoPE, SwiGLU, tanh-GELU (attention: attend.c).
 * The formulas are the NumPy layers' (hpcpipe.nn.core); sums run in another order, so results agree to
 * float32 rounding, not bit for bit.
 */
#include <math.h>

#include "hp.h"

#include "hp_vec.h"


/* sum of n floats in float32 as 16 running partial sums (what a vector loop does): NumPy's float32 rounding
 * and overflow (an overflowing row becomes inf, then NaN, on both paths), with error growing as n / 16 */
static float sum16(const float *x, const float *y, int64_t n, float shift) {
    float part[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) {
            float v = x[i + j] - shift;
            part[j] += y ? v * v : v;
        }
    for (int j = 0; i < n; i++, j++) {
        float v = x[i] - shift;
        part[j] += y ? v * v : v;
    }
    float total = 0.0f;
    for (int j = 0; j < 16; j++) total += part[j];
    return total;
}

void hp_rmsnorm(const float *x, const float *w, float *y, int64_t m, int64_t d, float eps) {
    for (int64_t r = 0; r < m; r++) {
        const float *xr = x + r * d;
        float *yr = y + r * d;
        float inv = 1.0f / sqrtf(sum16(xr, xr, d, 0.0f) / (float)d + eps);
        for (int64_t i = 0; i < d; i++) yr[i] = xr[i] * inv * w[i];
    }
}

void hp_layernorm(const float *x, const float *w, const float *b, float *y, int64_t m, int64_t d, float eps) {
    for (int64_t r = 0; r < m; r++) {
        const float *xr = x + r * d;
        float *yr = y + r * d;
        float mean = sum16(xr, NULL, d, 0.0f) / (float)d;
        float inv = 1.0f / sqrtf(sum16(xr, xr, d, mean) / (float)d + eps);
        for (int64_t i = 0; i < d; i++) yr[i] = (xr[i] - mean) * inv * w[i] + b[i];
    }
}

void hp_rope(float *x, int64_t m, int64_t heads, int64_t hd, int64_t stride, const float *cos, const float *sin,
             const int64_t *positions) {
    int64_t half = hd / 2;
    for (int64_t r = 0; r < m; r++) {
        const float *c = cos + positions[r] * half, *s = sin + positions[r] * half;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + r * stride + h * hd;
            for (int64_t i = 0; i < half; i++) {
                float a = v[i], b = v[i + half];
                v[i] = a * c[i] - b * s[i];
                v[i + half] = b * c[i] + a * s[i];
            }
        }
    }
}

#if HP_X86
static void swiglu_avx512(const float *gate_up, float *out, int64_t m, int64_t ff);
static void gelu_avx512(float *x, int64_t n);
#endif

void hp_swiglu(const float *gate_up, float *out, int64_t m, int64_t ff) {
#if HP_X86
    if (hp_avx512) {            /* a 512-row prefill spent 0.5 s of 1.6 in scalar tanhf here */
        swiglu_avx512(gate_up, out, m, ff);
        return;
    }
#endif
    for (int64_t r = 0; r < m; r++) {
        const float *g = gate_up + r * 2 * ff, *u = g + ff;
        float *o = out + r * ff;
        for (int64_t i = 0; i < ff; i++) o[i] = g[i] * (0.5f * (1.0f + tanhf(0.5f * g[i]))) * u[i];
    }
}

void hp_gelu(float *x, int64_t n) {
#if HP_X86
    if (hp_avx512) {
        gelu_avx512(x, n);
        return;
    }
#endif
    const float c = 0.7978845608028654f;   /* sqrt(2 / pi) */
    for (int64_t i = 0; i < n; i++) {
        float z = x[i];
        x[i] = 0.5f * z * (1.0f + tanhf(c * (z + 0.044715f * z * z * z)));
    }
}

#if HP_X86
/* sigmoid(g) = 1 / (1 + e^-g) from e = e^-|g| (never overflows): 1 / (1 + e) for g >= 0, e / (1 + e) below */
static HP_TARGET inline __m512 sigmoid512(__m512 g) {
    __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
    __m512 one = _mm512_set1_ps(1.0f);
    __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
    return _mm512_div_ps(_mm512_mask_blend_ps(negative, one, e), _mm512_add_ps(one, e));
}

static HP_TARGET void swiglu_avx512(const float *gate_up, float *out, int64_t m, int64_t ff) {
    for (int64_t r = 0; r < m; r++) {
        const float *g = gate_up + r * 2 * ff, *u = g + ff;
        float *o = out + r * ff;
        for (int64_t i = 0; i < ff; i += 16) {
            __mmask16 mask = ff - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (ff - i)) - 1);
            __m512 gv = _mm512_maskz_loadu_ps(mask, g + i), uv = _mm512_maskz_loadu_ps(mask, u + i);
            _mm512_mask_storeu_ps(o + i, mask, _mm512_mul_ps(_mm512_mul_ps(gv, sigmoid512(gv)), uv));
        }
    }
}

/* tanh(y) = sign(y) (1 - e) / (1 + e) with e = e^(-2|y|) */
static HP_TARGET void gelu_avx512(float *x, int64_t n) {
    const __m512 c = _mm512_set1_ps(0.7978845608028654f), a = _mm512_set1_ps(0.044715f);
    const __m512 one = _mm512_set1_ps(1.0f), half = _mm512_set1_ps(0.5f), m2 = _mm512_set1_ps(-2.0f);
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 mask = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        __m512 z = _mm512_maskz_loadu_ps(mask, x + i);
        __m512 y = _mm512_mul_ps(c, _mm512_fmadd_ps(_mm512_mul_ps(a, z), _mm512_mul_ps(z, z), z));
        __m512 e = exp512(_mm512_mul_ps(m2, _mm512_abs_ps(y)));
        __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
        __mmask16 negative = _mm512_cmp_ps_mask(y, _mm512_setzero_ps(), _CMP_LT_OQ);
        t = _mm512_mask_sub_ps(t, negative, _mm512_setzero_ps(), t);
        _mm512_mask_storeu_ps(x + i, mask, _mm512_mul_ps(_mm512_mul_ps(half, z), _mm512_add_ps(one, t)));
    }
}

#endif
