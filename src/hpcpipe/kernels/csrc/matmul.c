/* Weight products y (M, N) = x (M, K) . W^T for float32 / bfloat16 / float16 / q8_0 weights W (N, K).
 *
 * Each weight row is read once per step for every row of x: tiles of up to 4 rows of x by 4 (or, for a
 * single row, 8) rows of W keep their partial sums in registers while K streams by, so a matrix-vector
 * product reads the weights at the memory's rate and a 32-row product reads them once from memory and a
 * few times from cache. 16-bit and 8-bit weights are widened to float32 in registers: the products and
 * sums are float32, as the NumPy path's, and only their order differs. Where the CPU has AVX512-VNNI, q8_0
 * products go to q8_vnni.c instead (activations quantized too, int8 x int8), unless hp_q8_int8_activations(0).
 */
#include <math.h>
#include <stdlib.h>

#include "hp.h"
#include "hp_vec.h"

#if HP_X86
#include <immintrin.h>
#endif

int hp_avx512 = 0;
static int forced_portable = 0, vnni = 0, int8_activations = 1;

int hp_init(void) {
#if HP_X86
    __builtin_cpu_init();
    hp_avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") && !forced_portable;
    vnni = hp_avx512 && __builtin_cpu_supports("avx512vnni");
#endif
    return hp_avx512;
}

int hp_q8_int8_activations(int on) {
    if (on >= 0) int8_activations = on;
    return vnni && int8_activations;
}

void hp_use_portable(int on) {
    forced_portable = on;
    hp_init();
}

/* ---- portable ------------------------------------------------------------------------------------------- */

static float weight_at(const hp_weight *w, int64_t n, int64_t k) {
    int64_t i = n * w->cols + k;
    switch (w->fmt) {
    case HP_BF16: return hp_bf16_to_f32(((const uint16_t *)w->data)[i]);
    case HP_F16: return hp_f16_to_f32(((const uint16_t *)w->data)[i]);
    case HP_Q8_0: return (float)((const int8_t *)w->data)[i] * hp_f16_to_f32(w->scales[n * (w->cols / 32) + k / 32]);
    default: return ((const float *)w->data)[i];
    }
}

static void matmul_portable(const hp_weight *w, const float *x, int64_t m, int64_t ldx, float *y, int64_t ldy,
                            int accumulate) {
    float row[1024];
    for (int64_t n = 0; n < w->rows; n++) {
        for (int64_t k0 = 0; k0 < w->cols; k0 += 1024) {
            int64_t kn = w->cols - k0 < 1024 ? w->cols - k0 : 1024;
            for (int64_t k = 0; k < kn; k++) row[k] = weight_at(w, n, k0 + k);
            for (int64_t r = 0; r < m; r++) {
                const float *xr = x + r * ldx + k0;
                float acc = 0.0f;
                for (int64_t k = 0; k < kn; k++) acc += xr[k] * row[k];
                if (k0 == 0 && !accumulate) y[r * ldy + n] = acc;
                else y[r * ldy + n] += acc;
            }
        }
    }
}

/* ---- AVX-512 -------------------------------------------------------------------------------------------- */
#if HP_X86

/* each accumulator's lanes summed into y (or added to it); a 4 x 4 tile sums its 16 at once, in the order
 * sum_lanes takes for one, so a row's outputs do not depend on the tile that computed them */
static HP_TARGET inline void store_sums44(const __m512 *acc, float *y, int64_t ldy, int accumulate) {
    __m512 v = sum_lanes16(acc);
    __m128 r0 = _mm512_extractf32x4_ps(v, 0), r1 = _mm512_extractf32x4_ps(v, 1);
    __m128 r2 = _mm512_extractf32x4_ps(v, 2), r3 = _mm512_extractf32x4_ps(v, 3);
    if (accumulate) {
        r0 = _mm_add_ps(r0, _mm_loadu_ps(y));
        r1 = _mm_add_ps(r1, _mm_loadu_ps(y + ldy));
        r2 = _mm_add_ps(r2, _mm_loadu_ps(y + 2 * ldy));
        r3 = _mm_add_ps(r3, _mm_loadu_ps(y + 3 * ldy));
    }
    _mm_storeu_ps(y, r0);
    _mm_storeu_ps(y + ldy, r1);
    _mm_storeu_ps(y + 2 * ldy, r2);
    _mm_storeu_ps(y + 3 * ldy, r3);
}

#define STORE_SUMS(R, C)                                                                                        \
    if (R == 4 && C == 4) {                                                                                     \
        /* a copy: passing acc's own address kept its 16 accumulators in memory through the whole loop */       \
        __m512 all[16];                                                                                         \
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)                                                   \
            _Pragma("GCC unroll 4") for (int c = 0; c < C && c < 4; c++) all[r * 4 + c] = acc[r][c];          \
        store_sums44(all, y, ldy, accumulate);                                                                  \
    } else {                                                                                                    \
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)                                                   \
            _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) {                                              \
                float v = sum_lanes(acc[r][c]);                                                                 \
                if (accumulate) y[r * ldy + c] += v; else y[r * ldy + c] = v;                                   \
            }                                                                                                   \
    }

/* 16 weights of row p from column k (the first `rem` of them when rem < 16), as float32 */
#define LOAD_F32(p, k, mask) _mm512_maskz_loadu_ps(mask, (const float *)(p) + (k))
#define LOAD_F16(p, k, mask) _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, (const uint16_t *)(p) + (k)))

/* a tile of R rows of x by C rows of W; W rows row_bytes apart. Every loop over the tile is unrolled so the
 * R x C accumulators live in registers; the main loop reads whole vectors, one masked step takes the tail. */
#define TILE_STEP(LOAD, ESIZE, R, C, k, mask)                                                                   \
    {                                                                                                           \
        __m512 wv[C];                                                                                           \
        if (pf) {               /* this tile's share of the next C rows (contiguous): pfl lines a step */       \
            _mm_prefetch(pf, _MM_HINT_T1);                                                                      \
            _Pragma("GCC unroll 8") for (int c = 1; c < C; c++) if (c < pfl) _mm_prefetch(pf + c * 64, _MM_HINT_T1); \
            pf += pfl * 64;                                                                                     \
        }                                                                                                       \
        _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) wv[c] = LOAD(wp + c * row_bytes, k, mask);          \
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                                 \
            __m512 xv = _mm512_maskz_loadu_ps(mask, x + r * ldx + (k));                                         \
            _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]); \
        }                                                                                                       \
    }

#define TILE_FN(NAME, LOAD, ESIZE, R, C)                                                                        \
static HP_TARGET void NAME(const char *wp, int64_t row_bytes, int64_t K, const float *x, int64_t ldx, float *y, \
                           int64_t ldy, int accumulate, const char *pf, int pfl) {                              \
    __m512 acc[R][C];                                                                                           \
    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)                                                       \
        _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();                  \
    int64_t k = 0;                                                                                              \
    for (; k + 16 <= K; k += 16) TILE_STEP(LOAD, ESIZE, R, C, k, (__mmask16)0xffff)                             \
    if (k < K) TILE_STEP(LOAD, ESIZE, R, C, k, (__mmask16)((1u << (K - k)) - 1))                               \
    STORE_SUMS(R, C)                                                                                            \
}

#define FORMAT_FNS(SUFFIX, LOAD, ESIZE)                                                                         \
TILE_FN(tile44_##SUFFIX, LOAD, ESIZE, 4, 4)                                                                     \
TILE_FN(tile41_##SUFFIX, LOAD, ESIZE, 4, 1)                                                                     \
TILE_FN(tile18_##SUFFIX, LOAD, ESIZE, 1, 8)                                                                     \
TILE_FN(tile11_##SUFFIX, LOAD, ESIZE, 1, 1)                                                                     \
static HP_TARGET void matmul_##SUFFIX(const hp_weight *w, const float *x, int64_t m, int64_t ldx, float *y,    \
                                      int64_t ldy, int accumulate) {                                            \
    const char *base = (const char *)w->data;                                                                   \
    int64_t N = w->rows, K = w->cols, rb = K * ESIZE, n = 0;                                                    \
    /* the tiles of a group of weight rows prefetch the next group (see matmul_bf16) */                         \
    if (m == 1) {                                                                                               \
        for (; n + 8 <= N; n += 8)                                                                              \
            tile18_##SUFFIX(base + n * rb, rb, K, x, ldx, y + n, ldy, accumulate,                               \
                            n + 16 <= N ? base + (n + 8) * rb : NULL, 2 * ESIZE);                               \
        for (; n < N; n++) tile11_##SUFFIX(base + n * rb, rb, K, x, ldx, y + n, ldy, accumulate, NULL, 0);      \
        return;                                                                                                 \
    }                                                                                                           \
    /* the next group's 4 rows, ESIZE lines a step, prefetched by the first tiles (hp_prefetch_split) */        \
    int share, pfl = hp_prefetch_split(m, ESIZE, &share);                                                       \
    int64_t share_bytes = ((K + 15) >> 4) * pfl * 64;                                                           \
    for (; n + 4 <= N; n += 4) {                                                                                \
        int64_t r = 0;                                                                                          \
        const char *next = n + 8 <= N ? base + (n + 4) * rb : NULL;                                             \
        for (int t = 0; r + 4 <= m; r += 4, t++)                                                                \
            tile44_##SUFFIX(base + n * rb, rb, K, x + r * ldx, ldx, y + r * ldy + n, ldy, accumulate,           \
                            next && t < share ? next + t * share_bytes : NULL, pfl);                            \
        for (; r < m; r++) {                                                                                    \
            for (int c = 0; c < 4; c++)                                                                         \
                tile11_##SUFFIX(base + (n + c) * rb, rb, K, x + r * ldx, ldx, y + r * ldy + n + c, ldy,         \
                                accumulate, NULL, 0);                                                           \
        }                                                                                                       \
    }                                                                                                           \
    for (; n < N; n++) {                                                                                        \
        int64_t r = 0;                                                                                          \
        for (; r + 4 <= m; r += 4) tile41_##SUFFIX(base + n * rb, rb, K, x + r * ldx, ldx, y + r * ldy + n, ldy, \
                                                   accumulate, NULL, 0);                                        \
        for (; r < m; r++) tile11_##SUFFIX(base + n * rb, rb, K, x + r * ldx, ldx, y + r * ldy + n, ldy,        \
                                           accumulate, NULL, 0);                                                \
    }                                                                                                           \
}

FORMAT_FNS(f32, LOAD_F32, 4)
FORMAT_FNS(f16, LOAD_F16, 2)

/* bfloat16, 32 weights a step: one 512-bit load holds them as 16 pairs; a pair's even weight is its low half
 * shifted up (a float32 whose low bits are 0) and its odd weight the high half masked, so the widening costs two
 * operations for 32 weights instead of four (no cross-lane conversion). x is laid out to match once per call:
 * each 32 columns as their 16 even values, then their 16 odd ones (``ld`` floats a row, K rounded up to 32 with
 * zeros, which the masked loads of a ragged tail multiply by zero weights). */
#define BF16_STEP(R, C, k, mask)                                                                                \
    {                                                                                                           \
        __m512 we[C], wo[C];                                                                                    \
        if (pf) {               /* the next rows: pfl lines a step (see TILE_STEP) */                           \
            _mm_prefetch(pf, _MM_HINT_T0);                                                                      \
            _Pragma("GCC unroll 8") for (int c = 1; c < C; c++) if (c < pfl) _mm_prefetch(pf + c * 64, _MM_HINT_T0); \
            pf += pfl * 64;                                                                                     \
        }                                                                                                       \
        _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) {                                                  \
            __m512i v = _mm512_maskz_loadu_epi16(mask, (const uint16_t *)(wp + c * row_bytes) + (k));           \
            we[c] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));                                              \
            wo[c] = _mm512_castsi512_ps(_mm512_and_si512(v, high));                                             \
        }                                                                                                       \
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                                 \
            __m512 xe = _mm512_loadu_ps(xd + r * ld + (k)), xo = _mm512_loadu_ps(xd + r * ld + (k) + 16);      \
            _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) {                                              \
                acc[r][c] = _mm512_fmadd_ps(xe, we[c], acc[r][c]);                                              \
                acc[r][c] = _mm512_fmadd_ps(xo, wo[c], acc[r][c]);                                              \
            }                                                                                                   \
        }                                                                                                       \
    }

#define BF16_TILE_FN(NAME, R, C)                                                                                \
static HP_TARGET void NAME(const char *wp, int64_t row_bytes, int64_t K, const float *xd, int64_t ld, float *y, \
                           int64_t ldy, int accumulate, const char *pf, int pfl) {                              \
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);                                                   \
    __m512 acc[R][C];                                                                                           \
    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)                                                       \
        _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();                  \
    int64_t k = 0;                                                                                              \
    for (; k + 32 <= K; k += 32) BF16_STEP(R, C, k, (__mmask32)0xffffffffu)                                     \
    if (k < K) BF16_STEP(R, C, k, (__mmask32)((1u << (K - k)) - 1))                                            \
    STORE_SUMS(R, C)                                                                                            \
}

BF16_TILE_FN(bf16_tile44, 4, 4)
BF16_TILE_FN(bf16_tile41, 4, 1)
BF16_TILE_FN(bf16_tile18, 1, 8)
BF16_TILE_FN(bf16_tile11, 1, 1)

/* x's rows with each 32 columns as 16 even then 16 odd values, zero past K (see BF16_STEP) */
static void deinterleave(const float *x, int64_t m, int64_t ldx, int64_t K, float *xd, int64_t ld) {
    for (int64_t r = 0; r < m; r++) {
        const float *src = x + r * ldx;
        float *dst = xd + r * ld;
        for (int64_t k = 0; k < ld; k += 32)
            for (int j = 0; j < 16; j++) {
                dst[k + j] = k + 2 * j < K ? src[k + 2 * j] : 0.0f;
                dst[k + 16 + j] = k + 2 * j + 1 < K ? src[k + 2 * j + 1] : 0.0f;
            }
    }
}

static HP_TARGET void matmul_bf16(const hp_weight *w, const float *x, int64_t m, int64_t ldx, float *y,
                                  int64_t ldy, int accumulate) {
    const char *base = (const char *)w->data;
    int64_t N = w->rows, K = w->cols, rb = K * 2, ld = (K + 31) / 32 * 32, n = 0;
    float stack[4096];
    float *xd = m * ld <= 4096 ? stack : (float *)malloc((size_t)(m * ld) * sizeof(float));
    if (!xd) {                                  /* no memory for the copy: the portable loop needs none */
        matmul_portable(w, x, m, ldx, y, ldy, accumulate);
        return;
    }
    deinterleave(x, m, ldx, K, xd, ld);
    if (m == 1) {
        /* a tile of 8 rows prefetches the next 8 (8 lines a step), as q8_vnni.c: the hardware prefetchers follow
         * its 8 short streams late */
        for (; n + 8 <= N; n += 8)
            bf16_tile18(base + n * rb, rb, K, xd, ld, y + n, ldy, accumulate, base + (n + 8 < N ? n + 8 : n) * rb,
                        8);
        for (; n < N; n++) bf16_tile11(base + n * rb, rb, K, xd, ld, y + n, ldy, accumulate, NULL, 0);
    } else {
        /* the row tiles of each 4 weight rows prefetch the next 4 (4 lines a step in all; the later tiles find
         * them in L1): a served model's weights come from L3 or memory, which the hardware prefetchers fetch
         * late. Spread over the first `share` tiles (as matmul_f32) rather than all issued by the first. */
        int share, pfl = hp_prefetch_split(m, 4, &share);
        int64_t share_bytes = ((K + 31) >> 5) * pfl * 64;
        for (; n + 4 <= N; n += 4) {
            int64_t r = 0;
            const char *next = n + 8 <= N ? base + (n + 4) * rb : NULL;
            for (int t = 0; r + 4 <= m; r += 4, t++)
                bf16_tile44(base + n * rb, rb, K, xd + r * ld, ld, y + r * ldy + n, ldy, accumulate,
                            next && t < share ? next + t * share_bytes : NULL, pfl);
            for (; r < m; r++)
                for (int c = 0; c < 4; c++)
                    bf16_tile11(base + (n + c) * rb, rb, K, xd + r * ld, ld, y + r * ldy + n + c, ldy, accumulate,
                                NULL, 0);
        }
        for (; n < N; n++) {
            int64_t r = 0;
            for (; r + 4 <= m; r += 4)
                bf16_tile41(base + n * rb, rb, K, xd + r * ld, ld, y + r * ldy + n, ldy, accumulate, NULL, 0);
            for (; r < m; r++)
                bf16_tile11(base + n * rb, rb, K, xd + r * ld, ld, y + r * ldy + n, ldy, accumulate, NULL, 0);
        }
    }
    if (xd != stack) free(xd);
}

/* q8_0: per block of 32, the products of the widened int8 values sum first, then scale by the block's d */
#define Q8_TILE_FN(NAME, R, C)                                                                                  \
static HP_TARGET void NAME(const int8_t *q, const uint16_t *d, int64_t K, const float *x, int64_t ldx,          \
                           float *y, int64_t ldy, int accumulate, const int8_t *pf) {                           \
    int64_t nb = K / 32;                                                                                        \
    __m512 acc[R][C];                                                                                           \
    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)                                                       \
        _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();                  \
    for (int64_t b = 0; b < nb; b++) {                                                                          \
        __m512 lo[C], hi[C], dv[C];                                                                             \
        _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) {                                                  \
            const int8_t *p = q + c * K + b * 32;                                                               \
            if (C == 8 && c < 4) _mm_prefetch((const char *)pf + b * 256 + c * 64, _MM_HINT_T0);                \
            lo[c] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));              \
            hi[c] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));       \
            dv[c] = _mm512_set1_ps(_cvtsh_ss(d[c * nb + b]));                                                   \
        }                                                                                                       \
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                                 \
            __m512 x0 = _mm512_loadu_ps(x + r * ldx + b * 32), x1 = _mm512_loadu_ps(x + r * ldx + b * 32 + 16); \
            _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) {                                              \
                __m512 t = _mm512_fmadd_ps(x1, hi[c], _mm512_mul_ps(x0, lo[c]));                                \
                acc[r][c] = _mm512_fmadd_ps(t, dv[c], acc[r][c]);                                               \
            }                                                                                                   \
        }                                                                                                       \
    }                                                                                                           \
    STORE_SUMS(R, C)                                                                                            \
}

Q8_TILE_FN(q8_tile44, 4, 4)
Q8_TILE_FN(q8_tile41, 4, 1)
Q8_TILE_FN(q8_tile18, 1, 8)
Q8_TILE_FN(q8_tile11, 1, 1)

static HP_TARGET void matmul_q8(const hp_weight *w, const float *x, int64_t m, int64_t ldx, float *y, int64_t ldy,
                                int accumulate) {
    const int8_t *q = (const int8_t *)w->data;
    const uint16_t *d = w->scales;
    int64_t N = w->rows, K = w->cols, nb = K / 32, n = 0;
    if (m == 1) {
        for (; n + 8 <= N; n += 8)       /* prefetching the next 8 rows, 4 lines a block (see matmul_bf16) */
            q8_tile18(q + n * K, d + n * nb, K, x, ldx, y + n, ldy, accumulate, q + (n + 8 < N ? n + 8 : n) * K);
        for (; n < N; n++) q8_tile11(q + n * K, d + n * nb, K, x, ldx, y + n, ldy, accumulate, NULL);
        return;
    }
    for (; n + 4 <= N; n += 4) {
        int64_t r = 0;
        for (; r + 4 <= m; r += 4)
            q8_tile44(q + n * K, d + n * nb, K, x + r * ldx, ldx, y + r * ldy + n, ldy, accumulate, NULL);
        for (; r < m; r++)
            for (int c = 0; c < 4; c++)
                q8_tile11(q + (n + c) * K, d + (n + c) * nb, K, x + r * ldx, ldx, y + r * ldy + n + c, ldy,
                          accumulate, NULL);
    }
    for (; n < N; n++) {
        int64_t r = 0;
        for (; r + 4 <= m; r += 4) q8_tile41(q + n * K, d + n * nb, K, x + r * ldx, ldx, y + r * ldy + n, ldy,
                                            accumulate, NULL);
        for (; r < m; r++)
            q8_tile11(q + n * K, d + n * nb, K, x + r * ldx, ldx, y + r * ldy + n, ldy, accumulate, NULL);
    }
}

#endif

/* from this many rows of x the widened-panel product (gemm.c) is as fast as the row tiles (bench/bench_gemm.py,
 * 2026-11-28: float32 / bf16 at 64 rows, q8_0, whose tiles widen in float, at half that) */
static int64_t gemm_rows = 64;

void hp_set_gemm_rows(int64_t rows) { gemm_rows = rows; }

void hp_matmul(const hp_weight *w, const float *x, int64_t m, int64_t ldx, float *y, int64_t ldy, int accumulate) {
    if (m <= 0 || w->rows <= 0) return;
#if HP_X86
    if (hp_avx512 && !(w->fmt == HP_Q8_0 && w->cols % 32)) {
        /* q8_0: the widened panel beats the float-activation tiles from half the rows, and the int8 (VNNI) tiles
         * only from twice them (bench: 32-64 rows int8 105-122 GFLOP/s against the panel's 75-105, 128 rows even,
         * 512 rows the panel's 124-149 against 100-108) */
        int64_t from = w->fmt != HP_Q8_0 ? gemm_rows : vnni && int8_activations ? 2 * gemm_rows : (gemm_rows + 1) / 2;
        if (m >= from && hp_gemm(w, x, m, ldx, y, ldy, accumulate) == 0)
            return;
        switch (w->fmt) {
        case HP_BF16: matmul_bf16(w, x, m, ldx, y, ldy, accumulate); return;
        case HP_F16: matmul_f16(w, x, m, ldx, y, ldy, accumulate); return;
        case HP_Q8_0:
            if (!(vnni && int8_activations && hp_matmul_q8_vnni(w, x, m, ldx, y, ldy, accumulate)))
                matmul_q8(w, x, m, ldx, y, ldy, accumulate);
            return;
        default: matmul_f32(w, x, m, ldx, y, ldy, accumulate); return;
        }
    }
#endif
    matmul_portable(w, x, m, ldx, y, ldy, accumulate);
}
