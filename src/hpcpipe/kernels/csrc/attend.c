/* Attention of a call's rows over their sequences' cached keys and values (each row sees its own sequence up
 * to its position, or its last `window` positions), in float32 as the NumPy steps compute it (max-subtracted
 * softmax, then the weighted sum of values); sums run in another order, so results agree to float32 rounding.
 *
 * A decode row (one row of its sequence in the call) is one query head x one key at a time, as it always was.
 * A prompt chunk's rows (consecutive positions of one sequence) go in query tiles: up to 16 query heads (rows x
 * the G heads sharing a kv head) sit in the 16 lanes of a vector, so each key is loaded once per tile and its
 * scores for every lane come out of hd FMAs with no horizontal sum; the values are then summed for 4 lanes at a
 * time, each value row loaded once per 4 lanes. Scores of a tile: 16 x (its keys) floats of scratch.
 */
#include <math.h>

#include "hp.h"
#include "hp_vec.h"

#define LANES HP_TILE_LANES

/* A query tile: `lanes` query heads against keys first..first+n-1 of one sequence's kv head. */
typedef struct {
    int64_t lanes, n;
    int32_t lo[LANES], hi[LANES];     /* lane l sees keys lo..hi (tile-relative); unused lanes see all */
    const float *q[LANES];            /* each lane's query (hd values) */
    float *out[LANES];                /* and where its hd outputs go */
} tile;

/* pointers to positions first..first+n-1 of kv head j through the sequence's block table, one division a call */
static void key_rows(const hp_stage *s, const float *key_cache, const float *value_cache, const int64_t *table,
                     int64_t j, int64_t first, int64_t n, const float **krows, const float **vrows) {
    int64_t B = s->page, hd = s->hd, page = first / B, off = first % B, head = j * s->pages;
    for (int64_t t = 0; t < n; t++) {
        int64_t at = ((head + table[page]) * B + off) * hd;
        krows[t] = key_cache + at;
        vrows[t] = value_cache + at;
        if (++off == B) {
            off = 0;
            page++;
        }
    }
}

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

static void tile_portable(const hp_stage *s, const tile *tl, const float *const *keys, const float *const *values,
                          float *sc) {
    /* the tiled computation in plain C, lanes innermost as the vector path has them (sc: n x 16) */
    int64_t hd = s->hd, n = tl->n, L = tl->lanes;
    float mx[LANES], sum[LANES];
    for (int64_t l = 0; l < L; l++) mx[l] = -INFINITY, sum[l] = 0.0f;
    for (int64_t t = 0; t < n; t++)
        for (int64_t l = 0; l < L; l++) {
            if (t < tl->lo[l] || t > tl->hi[l]) continue;
            float acc = 0.0f;
            for (int64_t i = 0; i < hd; i++) acc += tl->q[l][i] * keys[t][i];
            sc[t * LANES + l] = acc * s->scale;
            if (sc[t * LANES + l] > mx[l]) mx[l] = sc[t * LANES + l];
        }
    for (int64_t t = 0; t < n; t++)
        for (int64_t l = 0; l < L; l++) {
            float *p = sc + t * LANES + l;
            *p = t < tl->lo[l] || t > tl->hi[l] ? 0.0f : expf(*p - mx[l]);
            sum[l] += *p;
        }
    for (int64_t l = 0; l < L; l++)
        for (int64_t i = 0; i < hd; i++) tl->out[l][i] = 0.0f;
    for (int64_t t = 0; t < n; t++)
        for (int64_t l = 0; l < L; l++) {
            float p = sc[t * LANES + l] / sum[l];
            if (p == 0.0f) continue;
            for (int64_t i = 0; i < hd; i++) tl->out[l][i] += p * values[t][i];
        }
}

#if HP_X86
static HP_TARGET void attend_avx512(const hp_stage *s, const float *const *keys, const float *const *values,
                                    const float *q, int64_t group, int64_t n, float *out, float *scores) {
    /* the `group` query heads of one kv head (q: group x hd, out: group x hd) against its n keys and values */
    int64_t hd = s->hd, hv = hd / 16;
    for (int64_t g = 0; g < group; g++) {
        const float *qg = q + g * hd;
        float *sc = scores + g * n;
        __m512 qv[16];
        for (int64_t i = 0; i < hv; i++) qv[i] = _mm512_loadu_ps(qg + i * 16);
        __m512 mx = _mm512_set1_ps(-INFINITY);
        /* 16 keys' dot products, their lanes summed together (sum_lanes16: a third of 16 separate sums' work) */
        __m512 scale = _mm512_set1_ps(s->scale), acc16[16];
        int64_t key = 0;
        for (; key + 16 <= n; key += 16) {
            for (int j = 0; j < 16; j++) {
                const float *kt = keys[key + j];
                __m512 acc = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kt));
                for (int64_t i = 1; i < hv; i++) acc = _mm512_fmadd_ps(qv[i], _mm512_loadu_ps(kt + i * 16), acc);
                acc16[j] = acc;
            }
            _mm512_storeu_ps(sc + key, _mm512_mul_ps(sum_lanes16(acc16), scale));
        }
        for (; key < n; key++) {
            const float *kt = keys[key];
            __m512 acc = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kt));
            for (int64_t i = 1; i < hv; i++) acc = _mm512_fmadd_ps(qv[i], _mm512_loadu_ps(kt + i * 16), acc);
            sc[key] = sum_lanes(acc) * s->scale;
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
        __m512 norm = _mm512_set1_ps(inv);
        for (int64_t i = 0; i < hv; i++) _mm512_storeu_ps(out + g * hd + i * 16, _mm512_mul_ps(acc[i], norm));
    }
}

/* the lanes of a tile that see key t (a lane sees lo..hi) */
static HP_TARGET inline __mmask16 seen(__m512i lo, __m512i hi, int64_t t) {
    __m512i tv = _mm512_set1_epi32((int32_t)t);
    return _mm512_cmp_epi32_mask(lo, tv, _MM_CMPINT_LE) & _mm512_cmp_epi32_mask(tv, hi, _MM_CMPINT_LE);
}

static HP_TARGET void tile_avx512(const hp_stage *s, const tile *tl, const float *const *keys,
                                  const float *const *values, float *sc, float *qt) {
    /* sc: n x 16 scores, then weights; qt: the tile's queries transposed, hd x 16, scaled by 1 / sqrt(hd) */
    int64_t hd = s->hd, n = tl->n, L = tl->lanes;
    for (int64_t i = 0; i < hd; i++)
        for (int64_t l = 0; l < LANES; l++) qt[i * LANES + l] = l < L ? tl->q[l][i] * s->scale : 0.0f;
    __m512i lo = _mm512_loadu_si512(tl->lo), hi = _mm512_loadu_si512(tl->hi);
    int64_t all_from = 0, all_to = n - 1;      /* keys every lane sees: no mask */
    for (int64_t l = 0; l < L; l++) {
        if (tl->lo[l] > all_from) all_from = tl->lo[l];
        if (tl->hi[l] < all_to) all_to = tl->hi[l];
    }
    const __m512 minus_inf = _mm512_set1_ps(-INFINITY);
    __m512 mx = minus_inf;
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {                 /* 8 keys a pass: one load of a query column feeds 8 FMAs */
        __m512 a[8];
        const float *k[8];
#pragma GCC unroll 8
        for (int u = 0; u < 8; u++) a[u] = _mm512_setzero_ps(), k[u] = keys[t + u];
        for (int64_t i = 0; i < hd; i++) {
            __m512 qv = _mm512_loadu_ps(qt + i * LANES);
#pragma GCC unroll 8
            for (int u = 0; u < 8; u++) a[u] = _mm512_fmadd_ps(qv, _mm512_set1_ps(k[u][i]), a[u]);
        }
#pragma GCC unroll 8
        for (int u = 0; u < 8; u++) {
            if (t + u < all_from || t + u > all_to) a[u] = _mm512_mask_mov_ps(minus_inf, seen(lo, hi, t + u), a[u]);
            mx = _mm512_max_ps(mx, a[u]);
            _mm512_storeu_ps(sc + (t + u) * LANES, a[u]);
        }
    }
    for (; t < n; t++) {
        const float *k = keys[t];
        __m512 a = _mm512_setzero_ps();
        for (int64_t i = 0; i < hd; i++) a = _mm512_fmadd_ps(_mm512_loadu_ps(qt + i * LANES), _mm512_set1_ps(k[i]), a);
        if (t < all_from || t > all_to) a = _mm512_mask_mov_ps(minus_inf, seen(lo, hi, t), a);
        mx = _mm512_max_ps(mx, a);
        _mm512_storeu_ps(sc + t * LANES, a);
    }
    __m512 total = _mm512_setzero_ps();
    for (t = 0; t < n; t++) {                    /* every lane sees a key (its own position): mx is finite */
        __m512 v = _mm512_loadu_ps(sc + t * LANES);
        __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, minus_inf, _CMP_NEQ_OQ), exp512(_mm512_sub_ps(v, mx)));
        _mm512_storeu_ps(sc + t * LANES, e);
        total = _mm512_add_ps(total, e);
    }
    float inv[LANES];
    _mm512_storeu_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), total));
    for (int64_t l0 = 0; l0 < L; l0 += 4) {      /* 4 lanes x 64 outputs a pass: a value row loaded once */
        int64_t nl = L - l0 < 4 ? L - l0 : 4;
        int64_t i0 = 0;
        for (; i0 + 64 <= hd; i0 += 64) {
            __m512 acc[4][4];
#pragma GCC unroll 16
            for (int c = 0; c < 16; c++) acc[c / 4][c % 4] = _mm512_setzero_ps();
            for (t = 0; t < n; t++) {
                const float *v = values[t] + i0, *p = sc + t * LANES + l0;
                __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
                __m512 v2 = _mm512_loadu_ps(v + 32), v3 = _mm512_loadu_ps(v + 48);
#pragma GCC unroll 4
                for (int c = 0; c < 4; c++) {
                    __m512 pc = _mm512_set1_ps(p[c]);
                    acc[c][0] = _mm512_fmadd_ps(pc, v0, acc[c][0]);
                    acc[c][1] = _mm512_fmadd_ps(pc, v1, acc[c][1]);
                    acc[c][2] = _mm512_fmadd_ps(pc, v2, acc[c][2]);
                    acc[c][3] = _mm512_fmadd_ps(pc, v3, acc[c][3]);
                }
            }
            for (int64_t c = 0; c < nl; c++) {
                __m512 scale = _mm512_set1_ps(inv[l0 + c]);
                for (int z = 0; z < 4; z++)
                    _mm512_storeu_ps(tl->out[l0 + c] + i0 + 16 * z, _mm512_mul_ps(acc[c][z], scale));
            }
        }
        for (; i0 < hd; i0 += 16) {              /* hd not a multiple of 64: 16 outputs a pass */
            __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
            for (t = 0; t < n; t++) {
                __m512 v = _mm512_loadu_ps(values[t] + i0);
                const float *p = sc + t * LANES + l0;
#pragma GCC unroll 4
                for (int c = 0; c < 4; c++) acc[c] = _mm512_fmadd_ps(_mm512_set1_ps(p[c]), v, acc[c]);
            }
            for (int64_t c = 0; c < nl; c++)
                _mm512_storeu_ps(tl->out[l0 + c] + i0, _mm512_mul_ps(acc[c], _mm512_set1_ps(inv[l0 + c])));
        }
    }
}
#endif

/* rows r.. of one sequence at consecutive positions, at most `most` of them */
static int64_t run_length(const int64_t *slots, const int64_t *positions, int64_t r, int64_t m, int64_t most) {
    int64_t q = 1;
    while (q < most && r + q < m && slots[r + q] == slots[r] && positions[r + q] == positions[r] + q) q++;
    return q;
}

static int64_t first_seen(int64_t position, int64_t window) {
    return window > 0 && position >= window ? position - window + 1 : 0;
}

void hp_attend(const hp_stage *s, float *cache, const float *qkv, int64_t m, const int64_t *slots,
               const int64_t *positions, int64_t window, float *heads, float *scores, const float **rows) {
    /* every row's keys and values are written first, so rows of one prompt see each other causally.
     * The cache is paged: (2, K, pages, page, hd); a sequence's position t lives in block
     * tables[slot][t / page] at offset t % page, so attention reads its keys through one row pointer per
     * position (rows: 2 x seq_len pointers of scratch), never a copy. scores: hp_scratch_floats' share. */
    int64_t hd = s->hd, H = s->n_heads, K = s->n_kv, B = s->page, P = s->pages, width = (H + 2 * K) * hd;
    int64_t G = H / K, tile_rows = G <= LANES / 2 ? LANES / G : 1;
    float *key_cache = cache, *value_cache = cache + K * P * B * hd;
    const float **krows = rows, **vrows = rows + s->seq_len;
    int vector = 0;
#if HP_X86
    vector = hp_avx512 && hd % 16 == 0 && hd <= 256;
#endif
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
    for (int64_t r = 0; r < m;) {
        const int64_t *table = s->tables + slots[r] * s->max_pages;
        int64_t q = run_length(slots, positions, r, m, tile_rows);
        if (q == 1) {                             /* a decode row: its G heads one at a time */
            const float *row = qkv + r * width;
            int64_t first = first_seen(positions[r], window), n = positions[r] + 1 - first;
            for (int64_t j = 0; j < K; j++) {
                key_rows(s, key_cache, value_cache, table, j, first, n, krows, vrows);
                float *out = heads + r * H * hd + j * G * hd;
#if HP_X86
                if (vector) {
                    attend_avx512(s, krows, vrows, row + j * G * hd, G, n, out, scores);
                    continue;
                }
#endif
                for (int64_t g = 0; g < G; g++)
                    attend_portable(s, krows, vrows, row + (j * G + g) * hd, n, out + g * hd, scores);
            }
            r++;
            continue;
        }
        /* q rows of one sequence at consecutive positions: lane i G + g is row r + i's head g of a kv head */
        tile tl;
        int64_t first = first_seen(positions[r], window);
        tl.lanes = q * G;
        tl.n = positions[r + q - 1] + 1 - first;
        for (int64_t l = 0; l < LANES; l++) {
            int64_t i = l / G;
            tl.lo[l] = l < tl.lanes ? (int32_t)(first_seen(positions[r + i], window) - first) : 0;
            tl.hi[l] = l < tl.lanes ? (int32_t)(positions[r + i] - first) : (int32_t)(tl.n - 1);
        }
        for (int64_t j = 0; j < K; j++) {
            key_rows(s, key_cache, value_cache, table, j, first, tl.n, krows, vrows);
            for (int64_t l = 0; l < tl.lanes; l++) {
                int64_t i = l / G, g = l % G;
                tl.q[l] = qkv + (r + i) * width + (j * G + g) * hd;
                tl.out[l] = heads + (r + i) * H * hd + (j * G + g) * hd;
            }
#if HP_X86
            if (vector) {
                tile_avx512(s, &tl, krows, vrows, scores, scores + LANES * tl.n);
                continue;
            }
#endif
            tile_portable(s, &tl, krows, vrows, scores);
        }
        r += q;
    }
}
