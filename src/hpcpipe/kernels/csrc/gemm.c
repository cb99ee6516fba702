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

/* 16 weights of row n of W from column k (k a multiple of 16, k0-relative block start a multiple of 32),
 * the first `valid` of them (the rest zero), widened to float32 */
static HP_TARGET inline __m512 widen16(const hp_weight *w, int64_t n, int64_t k, __mmask16 valid) {
    int64_t K = w->cols;
    switch (w->fmt) {
    case HP_BF16:
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
            _mm256_maskz_loadu_epi16(valid, (const uint16_t *)w->data + n * K + k)), 16));
    case HP_F16:
        return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, (const uint16_t *)w->data + n * K + k));
    case HP_Q8_0: {                       /* K % 32 == 0 (hp_matmul sends other widths to the portable path) */
        __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_maskz_loadu_epi8(valid, (const int8_t *)w->data + n * K + k)));
        return _mm512_mul_ps(v, _mm512_set1_ps(_cvtsh_ss(w->scales[n * (K / 32) + k / 32])));
    }
    default:
        return _mm512_maskz_loadu_ps(valid, (const float *)w->data + n * K + k);
    }
}

/* v[i][j] -> v[j][i] for a 16 x 16 block of floats in registers (4 rounds of in-lane and cross-lane shuffles) */
static HP_TARGET inline void transpose16(__m512 v[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(v[i], v[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(v[i], v[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        for (int j = 0; j < 2; j++) {
            __m512d a = _mm512_castps_pd(t[i + j]), b = _mm512_castps_pd(t[i + 2 + j]);
            v[i + 2 * j] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
            v[i + 2 * j + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        }
    }
    for (int i = 0; i < 16; i += 8) {
        for (int j = 0; j < 4; j++) {
            t[i + j] = _mm512_shuffle_f32x4(v[i + j], v[i + 4 + j], 0x88);
            t[i + 4 + j] = _mm512_shuffle_f32x4(v[i + j], v[i + 4 + j], 0xdd);
        }
    }
    for (int i = 0; i < 8; i++) {
        v[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        v[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    }
}

/* rows [n0, n0 + cols) of W, columns [k0, k0 + kc), as a k-major panel of NR columns (zeros past cols):
 * 16 rows by 16 columns at a time are widened into registers and transposed there (scalar stores with a
 * 128-byte stride took a third of a 128-row product's time) */
static HP_TARGET void pack_panel(const hp_weight *w, int64_t n0, int64_t cols, int64_t k0, int64_t kc,
                                 float *panel) {
    __m512 v[16];
    for (int64_t c0 = 0; c0 < NR; c0 += 16) {
        for (int64_t k = 0; k < kc; k += 16) {
            int64_t left = kc - k < 16 ? kc - k : 16;
            __mmask16 valid = (__mmask16)(left == 16 ? 0xffff : (1u << left) - 1);
            for (int i = 0; i < 16; i++)
                v[i] = c0 + i < cols ? widen16(w, n0 + c0 + i, k0 + k, valid) : _mm512_setzero_ps();
            transpose16(v);
            for (int64_t j = 0; j < left; j++) _mm512_store_ps(panel + (k + j) * NR + c0, v[j]);
        }
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

/* The lines of the panel hp_gemm packs next, fetched into L2 a few at a time while the present panel's tiles
 * run: a served model's weights come from memory, and 32 rows read 32 bytes at a time left the hardware
 * prefetchers behind (the packing then waited on every load) */
typedef struct {
    const char *row;          /* the next line's row, from its first line */
    int64_t stride, per_row, line, rows_left, total;
} panel_fetch;

static panel_fetch next_panel(const hp_weight *w, int64_t n0, int64_t k0) {
    int64_t N = w->rows, K = w->cols;
    panel_fetch f = {0, 0, 0, 0, 0, 0};
    n0 += NR;
    if (n0 >= N) {
        n0 = 0;
        k0 += KC;
    }
    if (k0 >= K) return f;
    int64_t size = w->fmt == HP_F32 ? 4 : w->fmt == HP_Q8_0 ? 1 : 2;
    int64_t kc = K - k0 < KC ? K - k0 : KC;
    int64_t rows = N - n0 < NR ? N - n0 : NR;
    f.row = (const char *)w->data + (n0 * K + k0) * size;
    f.stride = K * size;
    f.per_row = (kc * size + 63) / 64 + 1;    /* +1: a row's part need not start on a line */
    f.rows_left = rows;
    f.total = rows * f.per_row;
    return f;
}

static HP_TARGET void fetch_some(panel_fetch *f, int64_t count) {
    for (; count > 0 && f->rows_left > 0; count--) {
        _mm_prefetch(f->row + f->line * 64, _MM_HINT_T1);
        if (++f->line == f->per_row) {
            f->line = 0;
            f->row += f->stride;
            f->rows_left--;
        }
    }
}

/* 0 when done; -1 when the panel's memory could not be had (the caller multiplies another way).
 * Columns of W go KC at a time (a multiple of 32: whole q8_0 blocks): the rows of x over those columns
 * (M x KC floats) stay in L2 while every panel passes, and a panel (NR x KC: 24 KiB) in L1 while every row
 * of x passes; y is added to from the second block on. */
int hp_gemm(const hp_weight *w, const float *x, int64_t m, int64_t ldx, float *y, int64_t ldy, int accumulate) {
    int64_t N = w->rows, K = w->cols;
    if (m <= 0) return 0;
    float *panel = aligned_alloc(64, (size_t)(KC * NR) * sizeof(float));
    if (!panel) return -1;
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        int64_t kc = K - k0 < KC ? K - k0 : KC;
        int add = accumulate || k0 > 0;
        for (int64_t n0 = 0; n0 < N; n0 += NR) {
            int64_t cols = N - n0 < NR ? N - n0 : NR;
            __mmask16 m0 = (__mmask16)(cols >= 16 ? 0xffff : (1u << cols) - 1);
            __mmask16 m1 = (__mmask16)(cols >= 32 ? 0xffff : cols > 16 ? (1u << (cols - 16)) - 1 : 0);
            pack_panel(w, n0, cols, k0, kc, panel);
            panel_fetch ahead = next_panel(w, n0, k0);
            int64_t per_tile = (ahead.total + (m + MR - 1) / MR - 1) / ((m + MR - 1) / MR);
            const float *xk = x + k0;
            int64_t r = 0;
            for (; r + MR <= m; r += MR) {
                fetch_some(&ahead, per_tile);
                tile12(panel, kc, xk + r * ldx, ldx, y + r * ldy + n0, ldy, m0, m1, add);
            }
            if (r < m) {
                fetch_some(&ahead, per_tile);
                TILES[m - r](panel, kc, xk + r * ldx, ldx, y + r * ldy + n0, ldy, m0, m1, add);
            }
        }
    }
    free(panel);
    return 0;
}

#else
int hp_gemm(const hp_weight *w, const float *x, int64_t m, int64_t ldx, float *y, int64_t ldy, int accumulate) {
    (void)w; (void)x; (void)m; (void)ldx; (void)y; (void)ldy; (void)accumulate;
    return -1;
}
#endif
