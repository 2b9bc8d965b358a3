/* AVX-512 helpers of the activation kernels (cpu_kernels_dtype.h's LOAD16 paths): the exp, the
 * bfloat16 rounding and a transpose, on 16 lanes. Builds of other levels compile none of it. */
#ifdef __AVX512F__
#include <immintrin.h>

/* exp_f32 on 16 lanes, the same arithmetic */
static inline __m512 exp_f32x16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
    __m512 p = _mm512_set1_ps(1.98756912e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.39819994e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.33345205e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.16657962e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.66666657e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

static inline __m256i round_to_bf16(__m512 v) {       /* f32_to_bf16 on 16 lanes */
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

/* rows r[0..16) of 16 floats become the columns */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
        __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int i = 0; i < 4; i++) {           /* 128-bit lanes, then 256-bit halves */
        t[i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0x88);
        t[4 + i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0xDD);
        t[8 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0x88);
        t[12 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0xDD);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
        r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xDD);
        r[4 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0x88);
        r[12 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0xDD);
    }
}
#endif
