/* What the AVX-512 paths of ops.c, attend.c and matmul.c share: their target attribute, a vector e^x and lane sums. */
#ifndef HP_VEC_H
#define HP_VEC_H

#include "hp.h"

#if HP_X86
#include <immintrin.h>

#define HP_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))

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

/* The sum of a vector's 16 lanes, in the order sum_lanes16 adds each of its vectors: within each 128-bit lane
 * (e0 + e2) + (e1 + e3), then (L0 + L2) + (L1 + L3); so below the switch to gemm.c's panel (another order) a row's
 * product is the same whichever row tile computed it */
static HP_TARGET inline float sum_lanes(__m512 a) {
    __m512 t = _mm512_add_ps(a, _mm512_permute_ps(a, 0x4e));              /* e0+e2, e1+e3 in each lane */
    t = _mm512_add_ps(t, _mm512_permute_ps(t, 0xb1));                       /* (e0+e2)+(e1+e3) */
    __m512 u = _mm512_add_ps(t, _mm512_shuffle_f32x4(t, t, 0x4e));          /* L0+L2, L1+L3 */
    u = _mm512_add_ps(u, _mm512_shuffle_f32x4(u, u, 0xb1));                 /* (L0+L2)+(L1+L3) */
    return _mm512_cvtss_f32(u);
}

/* lane j = the sum of a[j]'s 16 lanes, for 16 vectors at once: 45 shuffles and adds where 16 separate
 * horizontal sums take about 140 (a 4 x 4 row tile's, or 16 keys' scores) */
static HP_TARGET inline __m512 sum_lanes16(const __m512 *a) {
    __m512 c[4];
    for (int i = 0; i < 4; i++) {
        const __m512 *b = a + 4 * i;
        __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(b[0], b[1]), _mm512_unpackhi_ps(b[0], b[1]));
        __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(b[2], b[3]), _mm512_unpackhi_ps(b[2], b[3]));
        __m512d d0 = _mm512_castps_pd(t0), d1 = _mm512_castps_pd(t1);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(d0, d1)), _mm512_castpd_ps(_mm512_unpackhi_pd(d0, d1)));
    }
    __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x44), _mm512_shuffle_f32x4(c[0], c[1], 0xee));
    __m512 w = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x44), _mm512_shuffle_f32x4(c[2], c[3], 0xee));
    return _mm512_add_ps(_mm512_shuffle_f32x4(u, w, 0x88), _mm512_shuffle_f32x4(u, w, 0xdd));
}

#endif
#endif
