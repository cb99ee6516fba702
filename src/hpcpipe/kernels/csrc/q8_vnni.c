/* q8_0 weight products with the activations quantized to q8 too: int8 x int8 dot products with AVX512-VNNI.
 *
 * What llama.cpp computes for a q8_0 matrix: each row of x is quantized once per call in blocks of 32 (one
 * float32 scale dx = max|x| / 127, values round-to-nearest-even(x / dx)); a block's 32 int8 x int8 products sum
 * exactly in int32, and y = sum over blocks of that sum * dx * dw. ``vpdpbusd`` multiplies unsigned by signed
 * bytes, so one side must be made unsigned:
 *
 * * one row of x (decode): |x| as the unsigned side and x's sign moved onto w (a masked negation per weight
 *   vector; q8_0 weights are in [-127, 127], so negating never overflows);
 * * several rows (prefill): x + 128 as the unsigned side, stored once per call, and the -128 sum(w) it adds
 *   taken off by starting each dot product from that correction (computed once per weight vector for all rows).
 *
 * Each 64-byte step covers two blocks: lanes 0-7 of the int32 sums are the first block's, 8-15 the second's,
 * so the scales are expanded to [s_b x8, s_b+1 x8] with a permute of 16 converted scales, and sums stay in
 * float32 lanes until one reduction at the end. Not bit-exact with the float path (x is rounded to 8 bits):
 * docs/kernels.md "q8_0 quality" measures what that costs.
 */
#include <math.h>
#include <stdlib.h>

#include "hp.h"

#if HP_X86
#include <immintrin.h>

#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")))

/* x's rows as q8 blocks: xq (K bytes a row; with ``offset`` each value + 128 as uint8) and the block scales dx
 * (nb a row). A block holding Inf or NaN gets a NaN scale, so the product is NaN as the float one would be. */
static VNNI_TARGET void quantize_rows(const float *x, int64_t m, int64_t ldx, int64_t K, int8_t *xq, float *dx,
                                      int offset) {
    int64_t nb = K / 32;
    const __m128i flip = _mm_set1_epi8((char)0x80);
    for (int64_t r = 0; r < m; r++)
        for (int64_t b = 0; b < nb; b++) {
            __m512 v0 = _mm512_loadu_ps(x + r * ldx + b * 32), v1 = _mm512_loadu_ps(x + r * ldx + b * 32 + 16);
            float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
            int bad = (_mm512_fpclass_ps_mask(v0, 0x99) | _mm512_fpclass_ps_mask(v1, 0x99)) != 0; /* NaN, Inf */
            float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            __m512 vid = _mm512_set1_ps(bad ? 0.0f : id);
            __m128i q0 = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v0, vid)));
            __m128i q1 = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v1, vid)));
            if (offset) {
                q0 = _mm_xor_si128(q0, flip);
                q1 = _mm_xor_si128(q1, flip);
            }
            _mm_storeu_si128((__m128i *)(xq + r * K + b * 32), q0);
            _mm_storeu_si128((__m128i *)(xq + r * K + b * 32 + 16), q1);
            dx[r * nb + b] = bad ? NAN : d;
        }
}

#ifndef PF_TILES
#define PF_TILES 1
#endif
/* lanes 0-7 pick scale 0 of a pair, 8-15 scale 1; adding 2 moves to the next pair */
#define PAIR_INDEX _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0)
#define STORE_TILE(R, C)                                                                                        \
    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)                                                       \
        _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) {                                                  \
            float v = _mm512_reduce_add_ps(acc[r][c]);                                                          \
            if (accumulate) y[r * ldy + c] += v; else y[r * ldy + c] = v;                                       \
        }

/* one row of x (signed xq, scales dx) by C weight rows; s[c] holds dx * dw of 16 blocks */
#define ROW_STEP(C, mask)                                                                                       \
    {                                                                                                           \
        __m512i xv = _mm512_maskz_loadu_epi8(mask, xq + (b0 + j) * 32);                                         \
        __m512i ax = _mm512_abs_epi8(xv);                                                                       \
        __mmask64 neg = _mm512_movepi8_mask(xv);                                                                \
        _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) {                                                  \
            _mm_prefetch((const char *)pf + (b0 + j) * 256 + c * 64, _MM_HINT_T0);                               \
            __m512i wv = _mm512_maskz_loadu_epi8(mask, q + c * K + (b0 + j) * 32);                              \
            __m512i dot = _mm512_dpbusd_epi32(zero, ax, _mm512_mask_sub_epi8(wv, neg, zero, wv));               \
            acc[0][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(idx, s[c]), acc[0][c]);  \
        }                                                                                                       \
    }

#define ROW_TILE_FN(NAME, C)                                                                                    \
static VNNI_TARGET void NAME(const int8_t *q, const uint16_t *d, int64_t K, const int8_t *xq, const float *dx,  \
                             const int8_t *pf, float *y, int accumulate) {                                      \
    const int64_t nb = K / 32, ldy = 0;                                                                         \
    const __m512i zero = _mm512_setzero_si512(), two = _mm512_set1_epi32(2);                                    \
    __m512 acc[1][C];                                                                                           \
    _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) acc[0][c] = _mm512_setzero_ps();                       \
    for (int64_t b0 = 0; b0 < nb; b0 += 16) {                                                                   \
        int64_t nc = nb - b0 < 16 ? nb - b0 : 16, j = 0;                                                        \
        __mmask16 sm = (__mmask16)((1u << nc) - 1);                                                             \
        __m512 xs = _mm512_maskz_loadu_ps(sm, dx + b0), s[C];                                                   \
        _Pragma("GCC unroll 8") for (int c = 0; c < C; c++)                                                    \
            s[c] = _mm512_mul_ps(xs, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(sm, d + c * nb + b0)));          \
        __m512i idx = PAIR_INDEX;                                                                               \
        for (; j + 2 <= nc; j += 2, idx = _mm512_add_epi32(idx, two)) ROW_STEP(C, ~(__mmask64)0)               \
        if (j < nc) ROW_STEP(C, (__mmask64)0xffffffffu)                                                         \
    }                                                                                                           \
    STORE_TILE(1, C)                                                                                            \
}

ROW_TILE_FN(row_tile8, 8)
ROW_TILE_FN(row_tile1, 1)

/* R rows of x (x + 128 as uint8 in xu, K bytes a row; scales expanded per pair in xe, le floats a row) by C
 * weight rows. corr[c] = -128 sum(w) per int32 lane, shared by the R rows. */
#define ROWS_STEP(R, C, mask)                                                                                   \
    {                                                                                                           \
        __m512i wv[C], corr[C];                                                                                 \
        __m512 we[C];                                                                                           \
        _Pragma("GCC unroll 4") for (int c = 0; c < C; c++) {                                                  \
            if (pf && c < pfl) _mm_prefetch((const char *)pf + c * K + (b0 + j) * 32, _MM_HINT_T0);             \
            wv[c] = _mm512_maskz_loadu_epi8(mask, q + c * K + (b0 + j) * 32);                                   \
            corr[c] = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, c80, wv[c]));                            \
            we[c] = _mm512_permutexvar_ps(idx, dw[c]);                                                          \
        }                                                                                                       \
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                                 \
            __m512i xv = _mm512_maskz_loadu_epi8(mask, xu + r * K + (b0 + j) * 32);                             \
            __m512 xs = _mm512_loadu_ps(xe + r * le + (b0 + j) * 8);                                            \
            _Pragma("GCC unroll 4") for (int c = 0; c < C; c++) {                                              \
                /* dot * (dx dw) in one FMA, as ROW_STEP rounds it: a row's product is the same alone or not */ \
                __m512 s = _mm512_mul_ps(xs, we[c]);                                                            \
                acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(corr[c], xv, wv[c])), s,     \
                                            acc[r][c]);                                                         \
            }                                                                                                   \
        }                                                                                                       \
    }

#define ROWS_TILE_FN(NAME, R, C)                                                                                \
static VNNI_TARGET void NAME(const int8_t *q, const uint16_t *d, int64_t K, const int8_t *xu, const float *xe,  \
                             int64_t le, float *y, int64_t ldy, int accumulate, const int8_t *pf, int pfl) {    \
    const int64_t nb = K / 32;                                                                                  \
    const __m512i zero = _mm512_setzero_si512(), two = _mm512_set1_epi32(2), c80 = _mm512_set1_epi8((char)0x80); \
    __m512 acc[R][C];                                                                                           \
    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)                                                       \
        _Pragma("GCC unroll 4") for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();                  \
    for (int64_t b0 = 0; b0 < nb; b0 += 16) {                                                                   \
        int64_t nc = nb - b0 < 16 ? nb - b0 : 16, j = 0;                                                        \
        __mmask16 sm = (__mmask16)((1u << nc) - 1);                                                             \
        __m512 dw[C];                                                                                           \
        _Pragma("GCC unroll 4") for (int c = 0; c < C; c++)                                                    \
            dw[c] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(sm, d + c * nb + b0));                            \
        __m512i idx = PAIR_INDEX;                                                                               \
        for (; j + 2 <= nc; j += 2, idx = _mm512_add_epi32(idx, two)) ROWS_STEP(R, C, ~(__mmask64)0)           \
        if (j < nc) ROWS_STEP(R, C, (__mmask64)0xffffffffu)                                                     \
    }                                                                                                           \
    STORE_TILE(R, C)                                                                                            \
}

ROWS_TILE_FN(rows_tile44, 4, 4)
ROWS_TILE_FN(rows_tile41, 4, 1)
ROWS_TILE_FN(rows_tile14, 1, 4)
ROWS_TILE_FN(rows_tile11, 1, 1)

/* each row's block scales as 16-float vectors [dx_b x8, dx_b+1 x8] per pair of blocks (le floats a row) */
static void expand_scales(const float *dx, int64_t m, int64_t nb, float *xe, int64_t le) {
    for (int64_t r = 0; r < m; r++)
        for (int64_t b = 0; b < le / 8; b++)
            for (int i = 0; i < 8; i++) xe[r * le + b * 8 + i] = b < nb ? dx[r * nb + b] : 0.0f;
}

int hp_matmul_q8_vnni(const hp_weight *w, const float *x, int64_t m, int64_t ldx, float *y, int64_t ldy,
                      int accumulate) {
    const int8_t *q = (const int8_t *)w->data;
    const uint16_t *d = w->scales;
    int64_t N = w->rows, K = w->cols, nb = K / 32, le = (nb + 1) / 2 * 16, n = 0;
    /* scratch: the quantized rows, their scales, and (several rows) the expanded scales */
    size_t bytes = (size_t)(m * K) + (size_t)(m * nb) * sizeof(float) + (m > 1 ? (size_t)(m * le) * sizeof(float) : 0);
    float stack[2048];
    float *dx = bytes <= sizeof(stack) ? stack : (float *)malloc(bytes);
    if (!dx) return 0;                               /* no memory: the caller's float path needs none */
    float *xe = dx + m * nb;
    int8_t *xq = (int8_t *)(xe + (m > 1 ? m * le : 0));
    quantize_rows(x, m, ldx, K, xq, dx, m > 1);
    if (m == 1) {
        /* each step also prefetches the next tile's weights (8 rows ahead: 8 K bytes over K / 64 steps of 8 lines):
         * a tile reads 8 short streams at once, which the hardware prefetchers follow late (decode then ran at
         * about a third of the copy rate) */
        for (; n + 8 <= N; n += 8) {
            int64_t next = n + 8 * PF_TILES < N ? n + 8 * PF_TILES : n;
            for (int64_t i = 0; i < 8 * nb * 2; i += 64) _mm_prefetch((const char *)(d + next * nb) + i, _MM_HINT_T0);
            row_tile8(q + n * K, d + n * nb, K, xq, dx, q + next * K, y + n, accumulate);
        }
        for (; n < N; n++) row_tile1(q + n * K, d + n * nb, K, xq, dx, q + n * K, y + n, accumulate);
    } else {
        expand_scales(dx, m, nb, xe, le);
#define ROWS_CALL(TILE, PF, PFL) \
    TILE(q + n * K, d + n * nb, K, xq + r * K, xe + r * le, le, y + r * ldy + n, ldy, accumulate, PF, PFL)
        /* the row tiles of each 4 weight rows prefetch the next 4 (one line a row a step, as they read their
         * own), spread over the first `share` tiles, pfl rows each (as matmul_f32): the later row tiles find
         * them in L1 anyway, and a served model's weights come from L3 or memory */
        int share, pfl = hp_prefetch_split(m, 4, &share);
        for (; n + 4 <= N; n += 4) {
            int64_t r = 0;
            const int8_t *next = n + 8 <= N ? q + (n + 4) * K : NULL;
            for (int64_t i = 0; next && i < 4 * nb * 2; i += 64)
                _mm_prefetch((const char *)(d + (n + 4) * nb) + i, _MM_HINT_T0);
            int t = 0;
            for (; r + 4 <= m; r += 4, t++) ROWS_CALL(rows_tile44, next && t < share ? next + t * pfl * K : NULL, pfl);
            for (; r < m; r++, t++) ROWS_CALL(rows_tile14, next && t == 0 ? next : NULL, 4);
        }
        for (; n < N; n++) {
            int64_t r = 0;
            for (; r + 4 <= m; r += 4) ROWS_CALL(rows_tile41, NULL, 0);
            for (; r < m; r++) ROWS_CALL(rows_tile11, NULL, 0);
        }
    }
    if (dx != stack) free(dx);
    return 1;
}

#else

int hp_matmul_q8_vnni(const hp_weight *w, const float *x, int64_t m, int64_t ldx, float *y, int64_t ldy,
                      int accumulate) {
    (void)w, (void)x, (void)m, (void)ldx, (void)y, (void)ldy, (void)accumulate;
    return 0;
}

#endif
