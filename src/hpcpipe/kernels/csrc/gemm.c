/* Weight products with many rows (a prompt's prefill): y (M, N) = x (M, K) . W^T, W (N, K) in any format.
 *
 * matmul.c's tiles take the dot product of a row of x with a row of W (reduced across the vector at the end),
 * which suits a few rows; for many rows this file widens a panel of 32 rows of W to float32 once, laid out
 * k-major (panel[k][32]: the 32 weights of column k of W^T side by side), and multiplies every row of x by it
 * with an outer-product register tile: 12 rows of x by 32 outputs in 24 zmm accumulators, one broadcast of
 * x[r][k] and two FMAs per row and k. A panel covers KC columns of W (hp_gemm) and stays in L1 while all M
 * rows pass, so the widening is paid once per weight per call, not once per 4 rows.
 * Sums run in another order than the NumPy path's (float32 throughout): results agree to float32 rounding.
 */
#include <stdlib.h>
#include <string.h>

#include "hp.h"

#if HP_X86
#include <immintrin.h>

#define HP_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#define NR 32          /* outputs of a panel: two zmm */
#define KC 192         /* columns of W a panel holds */
#define MR 12          /* rows of x a register tile holds: 24 accumulators, two weight vectors, one broadcast */

/* row n of W, columns [k0, k0 + kc) (k0 a multiple of 32), widened to float32 into out */
static HP_TARGET void widen_row(const hp_weight *w, int64_t n, int64_t k0, int64_t kc, float *out) {
    int64_t K = w->cols, k = 0;
    switch (w->fmt) {
    case HP_BF16: {
        const uint16_t *p = (const uint16_t *)w->data + n * K + k0;
        for (; k + 16 <= kc; k += 16)
            _mm512_storeu_ps(out + k, _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p + k))), 16)));
        for (; k < kc; k++) out[k] = hp_bf16_to_f32(p[k]);
        break;
    }
    case HP_F16: {
        const uint16_t *p = (const uint16_t *)w->data + n * K + k0;
        for (; k + 16 <= kc; k += 16) _mm512_storeu_ps(out + k, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + k))));
        for (; k < kc; k++) out[k] = hp_f16_to_f32(p[k]);
        break;
    }
    case HP_Q8_0: {                       /* K % 32 == 0 (hp_matmul sends other widths to the portable path) */
        const int8_t *q = (const int8_t *)w->data + n * K + k0;
        const uint16_t *d = w->scales + n * (K / 32) + k0 / 32;
        for (; k < kc; k += 16) {
            __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + k))));
            _mm512_storeu_ps(out + k, _mm512_mul_ps(v, _mm512_set1_ps(_cvtsh_ss(d[k / 32]))));
        }
        break;
    }
    default:
        memcpy(out, (const float *)w->data + n * K + k0, (size_t)kc * sizeof(float));
    }
}

/* rows [n0, n0 + cols) of W, columns [k0, k0 + kc), as a k-major panel of NR columns (zeros past cols) */
static HP_TARGET void pack_panel(const hp_weight *w, int64_t n0, int64_t cols, int64_t k0, int64_t kc, float *row,
                                 float *panel) {
    for (int64_t c = 0; c < NR; c++) {
        if (c < cols) widen_row(w, n0 + c, k0, kc, row);
        else memset(row, 0, (size_t)kc * sizeof(float));
        for (int64_t k = 0; k < kc; k++) panel[k * NR + c] = row[k];
    }
}

/* R rows of x (ldx apart) times the panel: y[r][0, 32) (masked by m0 | m1) = (or +=) the products */
#define GEMM_TILE(R)                                                                                            \
static HP_TARGET void tile##R(const float *panel, int64_t K, const float *x, int64_t ldx, float *y, int64_t ldy, \
                              __mmask16 m0, __mmask16 m1, int accumulate) {                                     \
    __m512 a0[R], a1[R];                                                                                        \
    _Pragma("GCC unroll 12") for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm512_setzero_ps();                  \
    _Pragma("GCC unroll 2") for (int64_t k = 0; k < K; k++) {                                                 \
        __m512 b0 = _mm512_load_ps(panel + k * NR), b1 = _mm512_load_ps(panel + k * NR + 16);                 \
        _Pragma("GCC unroll 12") for (int r = 0; r < R; r++) {                                                 \
            __m512 xv = _mm512_set1_ps(x[r * ldx + k]);                                                         \
            a0[r] = _mm512_fmadd_ps(xv, b0, a0[r]);                                                             \
            a1[r] = _mm512_fmadd_ps(xv, b1, a1[r]);                                                             \
        }                                                                                                       \
    }                                                                                                           \
    _Pragma("GCC unroll 12") for (int r = 0; r < R; r++) {                                                     \
        float *yr = y + r * ldy;                                                                                \
        if (accumulate) {                                                                                       \
            a0[r] = _mm512_add_ps(a0[r], _mm512_maskz_loadu_ps(m0, yr));                                        \
            a1[r] = _mm512_add_ps(a1[r], _mm512_maskz_loadu_ps(m1, yr + 16));                                   \
        }                                                                                                       \
        _mm512_mask_storeu_ps(yr, m0, a0[r]);                                                                   \
        _mm512_mask_storeu_ps(yr + 16, m1, a1[r]);                                                              \
    }                                                                                                           \
}

GEMM_TILE(1) GEMM_TILE(2) GEMM_TILE(3) GEMM_TILE(4) GEMM_TILE(5) GEMM_TILE(6)
GEMM_TILE(7) GEMM_TILE(8) GEMM_TILE(9) GEMM_TILE(10) GEMM_TILE(11) GEMM_TILE(12)

typedef void (*tile_fn)(const float *, int64_t, const float *, int64_t, float *, int64_t, __mmask16, __mmask16, int);
static const tile_fn TILES[MR + 1] = {0, tile1, tile2, tile3, tile4, tile5, tile6, tile7, tile8, tile9, tile10,
                                      tile11, tile12};

/* 0 when done; -1 when the panel's memory could not be had (the caller multiplies another way).
 * Columns of W go KC at a time (a multiple of 32: whole q8_0 blocks): the rows of x over those columns
 * (M x KC floats) stay in L2 while every panel passes, and a panel (NR x KC: 24 KiB) in L1 while every row
 * of x passes; y is added to from the second block on. */
int hp_gemm(const hp_weight *w, const float *x, int64_t m, int64_t ldx, float *y, int64_t ldy, int accumulate) {
    int64_t N = w->rows, K = w->cols;
    float *panel = aligned_alloc(64, (size_t)(KC * NR) * sizeof(float));
    float *row = malloc((size_t)KC * sizeof(float));
    if (!panel || !row) {
        free(panel);
        free(row);
        return -1;
    }
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        int64_t kc = K - k0 < KC ? K - k0 : KC;
        int add = accumulate || k0 > 0;
        for (int64_t n0 = 0; n0 < N; n0 += NR) {
            int64_t cols = N - n0 < NR ? N - n0 : NR;
            __mmask16 m0 = (__mmask16)(cols >= 16 ? 0xffff : (1u << cols) - 1);
            __mmask16 m1 = (__mmask16)(cols >= 32 ? 0xffff : cols > 16 ? (1u << (cols - 16)) - 1 : 0);
            pack_panel(w, n0, cols, k0, kc, row, panel);
            const float *xk = x + k0;
            int64_t r = 0;
            for (; r + MR <= m; r += MR) tile12(panel, kc, xk + r * ldx, ldx, y + r * ldy + n0, ldy, m0, m1, add);
            if (r < m) TILES[m - r](panel, kc, xk + r * ldx, ldx, y + r * ldy + n0, ldy, m0, m1, add);
        }
    }
    free(panel);
    free(row);
    return 0;
}

#else
int hp_gemm(const hp_weight *w, const float *x, int64_t m, int64_t ldx, float *y, int64_t ldy, int accumulate) {
    (void)w; (void)x; (void)m; (void)ldx; (void)y; (void)ldy; (void)accumulate;
    return -1;
}
#endif
