/* The decoder's row-wise steps in float32: RMSNorm, LayerNorm, RoPE, SwiGLU, tanh-GELU, and decode attention
 * of many rows over their sequences' cached keys and values (each row sees its own sequence up to its position).
 * The formulas are the NumPy layers' (hpcpipe.nn.core); sums run in another order, so results agree to
 * float32 rounding, not bit for bit.
 */
#include <math.h>

#include "hp.h"

#if HP_X86
#include <immintrin.h>
#endif

#define HP_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))

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

/* ---- attention ------------------------------------------------------------------------------------------- */

static void attend_portable(const hp_stage *s, const float *const *keys, const float *const *values, const float *q,
                            int64_t n, float *out, float *scores) {
    /* one query head against n keys and values of one kv head (keys[t], values[t]: position t's hd values) */
    int64_t hd = s->hd;
    float mx = -INFINITY, sum = 0.0f;
    for (int64_t t = 0; t < n; t++) {
        float acc = 0.0f;
        for (int64_t i = 0; i < hd; i++) acc += q[i] * keys[t][i];
        scores[t] = acc * s->scale;
        if (scores[t] > mx) mx = scores[t];
    }
    for (int64_t t = 0; t < n; t++) {
        scores[t] = expf(scores[t] - mx);
        sum += scores[t];
    }
    for (int64_t i = 0; i < hd; i++) out[i] = 0.0f;
    for (int64_t t = 0; t < n; t++) {
        float p = scores[t] / sum;
        for (int64_t i = 0; i < hd; i++) out[i] += p * values[t][i];
    }
}

#if HP_X86
/* e^x for x <= 0 (softmax terms): 2^n e^r with |r| <= ln2 / 2 and a degree-6 polynomial; about 1 ulp */
static HP_TARGET inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

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

static HP_TARGET void attend_avx512(const hp_stage *s, const float *const *keys, const float *const *values,
                                    const float *q,
                                    int64_t group, int64_t n, float *out, float *scores) {
    /* the `group` query heads of one kv head (q: group x hd, out: group x hd) against its n keys and values */
    int64_t hd = s->hd, hv = hd / 16;
    for (int64_t g = 0; g < group; g++) {
        const float *qg = q + g * hd;
        float *sc = scores + g * n;
        __m512 qv[16];
        for (int64_t i = 0; i < hv; i++) qv[i] = _mm512_loadu_ps(qg + i * 16);
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int64_t t = 0; t < n; t++) {
            const float *kt = keys[t];
            __m512 acc = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kt));
            for (int64_t i = 1; i < hv; i++) acc = _mm512_fmadd_ps(qv[i], _mm512_loadu_ps(kt + i * 16), acc);
            sc[t] = _mm512_reduce_add_ps(acc) * s->scale;
        }
        for (int64_t t = 0; t < n; t += 16) {
            __mmask16 mask = n - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - t)) - 1);
            mx = _mm512_mask_max_ps(mx, mask, mx, _mm512_maskz_loadu_ps(mask, sc + t));
        }
        __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx)), total = _mm512_setzero_ps();
        for (int64_t t = 0; t < n; t += 16) {
            __mmask16 mask = n - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - t)) - 1);
            __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, sc + t), top));
            e = _mm512_maskz_mov_ps(mask, e);
            _mm512_mask_storeu_ps(sc + t, mask, e);
            total = _mm512_add_ps(total, e);
        }
        float inv = 1.0f / _mm512_reduce_add_ps(total);
        __m512 acc[16];
        for (int64_t i = 0; i < hv; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t t = 0; t < n; t++) {
            __m512 p = _mm512_set1_ps(sc[t]);
            const float *vt = values[t];
            for (int64_t i = 0; i < hv; i++) acc[i] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vt + i * 16), acc[i]);
        }
        __m512 scale = _mm512_set1_ps(inv);
        for (int64_t i = 0; i < hv; i++) _mm512_storeu_ps(out + g * hd + i * 16, _mm512_mul_ps(acc[i], scale));
    }
}

#endif

void hp_attend(const hp_stage *s, float *cache, const float *qkv, int64_t m, const int64_t *slots,
               const int64_t *positions, int64_t window, float *heads, float *scores, const float **rows) {
    /* every row's keys and values are written first, so rows of one prompt see each other causally.
     * The cache is paged: (2, K, pages, page, hd); a sequence's position t lives in block
     * tables[slot][t / page] at offset t % page, so attention reads its keys through one row pointer per
     * position (rows: 2 x seq_len pointers of scratch), never a copy. */
    int64_t hd = s->hd, H = s->n_heads, K = s->n_kv, B = s->page, P = s->pages, width = (H + 2 * K) * hd;
    int64_t G = H / K;
    float *key_cache = cache, *value_cache = cache + K * P * B * hd;
    const float **krows = rows, **vrows = rows + s->seq_len;
    for (int64_t r = 0; r < m; r++) {
        const float *row = qkv + r * width;
        int64_t block = s->tables[slots[r] * s->max_pages + positions[r] / B], off = positions[r] % B;
        for (int64_t j = 0; j < K; j++) {
            int64_t at = ((j * P + block) * B + off) * hd;
            for (int64_t i = 0; i < hd; i++) {
                key_cache[at + i] = row[(H + j) * hd + i];
                value_cache[at + i] = row[(H + K + j) * hd + i];
            }
        }
    }
    for (int64_t r = 0; r < m; r++) {
        const float *row = qkv + r * width;
        const int64_t *table = s->tables + slots[r] * s->max_pages;
        int64_t first = window > 0 && positions[r] >= window ? positions[r] - window + 1 : 0;
        int64_t n = positions[r] + 1 - first;
        for (int64_t j = 0; j < K; j++) {
            for (int64_t t = 0; t < n; t++) {
                int64_t at = ((j * P + table[(first + t) / B]) * B + (first + t) % B) * hd;
                krows[t] = key_cache + at;
                vrows[t] = value_cache + at;
            }
            float *out = heads + r * H * hd + j * G * hd;
#if HP_X86
            if (hp_avx512 && hd % 16 == 0 && hd <= 256) {
                attend_avx512(s, krows, vrows, row + j * G * hd, G, n, out, scores);
                continue;
            }
#endif
            {
                for (int64_t g = 0; g < G; g++) attend_portable(s, krows, vrows, row + (j * G + g) * hd, n, out + g * hd, scores);
            }
        }
    }
}
