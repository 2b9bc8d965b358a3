/* AVX2 helpers of the activation kernels (cpu_kernels_dtype.h's LOAD8 paths, where AVX-512 is
 * absent): the exp, the bfloat16 rounding and a transpose, on 8 lanes. Builds of other levels
 * compile none of it. */
#if !defined(OUTPACE_PORTABLE) && defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>
#define AVX2_PATHS

/* exp_f32 on 8 lanes, the same arithmetic (2^n from its bits, n = 128 as 2^127 * 2) */
static inline __m256 exp_f32x8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.7f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x));
    __m256 p = _mm256_set1_ps(1.98756912e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.39819994e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.33345205e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.16657962e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.66666657e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
    __m256 top = _mm256_set1_ps(127.0f);
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(_mm256_min_ps(n, top)), _mm256_set1_epi32(127)), 23);
    __m256 twice = _mm256_blendv_ps(_mm256_set1_ps(1.0f), _mm256_set1_ps(2.0f), _mm256_cmp_ps(n, top, _CMP_GT_OQ));
    return _mm256_mul_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(bits)), twice);
}

static inline __m128i round_to_bf16x8(__m256 v) {      /* f32_to_bf16 on 8 lanes */
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));     /* each lane < 2^16 */
}

/* rows r[0..8) of 8 floats become the columns */
static inline void transpose8(__m256 r[8]) {
    __m256 t[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        __m256d a = _mm256_castps_pd(t[4 * i]), b = _mm256_castps_pd(t[4 * i + 1]);
        __m256d c = _mm256_castps_pd(t[4 * i + 2]), d = _mm256_castps_pd(t[4 * i + 3]);
        r[4 * i] = _mm256_castpd_ps(_mm256_unpacklo_pd(a, c));
        r[4 * i + 1] = _mm256_castpd_ps(_mm256_unpackhi_pd(a, c));
        r[4 * i + 2] = _mm256_castpd_ps(_mm256_unpacklo_pd(b, d));
        r[4 * i + 3] = _mm256_castpd_ps(_mm256_unpackhi_pd(b, d));
    }
    for (int i = 0; i < 4; i++) {           /* 128-bit halves */
        t[i] = _mm256_permute2f128_ps(r[i], r[4 + i], 0x20);
        t[4 + i] = _mm256_permute2f128_ps(r[i], r[4 + i], 0x31);
    }
    for (int i = 0; i < 8; i++) r[i] = t[i];
}

/* lanes l of `bits` set as all-ones, else zeros */
static inline __m256 lane_mask8(unsigned bits) {
    __m256i lanes = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)bits), lanes), lanes));
}
#endif
