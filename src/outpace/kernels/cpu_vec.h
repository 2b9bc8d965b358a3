/* The level's register of floats for the product kernels (cpu_products.h), so one kernel text
 * compiles to every level: VF holds VL floats; the build's flags pick the level (cpu_isa.py),
 * OUTPACE_PORTABLE plain C whatever the compiler targets.
 *
 *   vf_zero()                      all zeros
 *   vf_set1(x)                     x in every lane
 *   vf_load(p)                     p[0..VL)
 *   vf_store(p, v)                 p[0..VL) = v
 *   vf_fma(a, b, c)                c + a * b, each lane (one rounding where the level fuses it)
 *   vf_mul(a, b), vf_add(a, b)     a * b, a + b, each lane (one rounding each)
 *   vf_widen_pairs(p, &e, &o)      VL pairs of bfloat16 values p[2l], p[2l + 1]: e[l] = p[2l] and
 *                                  o[l] = p[2l + 1] as floats (exact)
 *   vf_load_half(p)                VL float16 values p[0..VL) as floats (exact)
 *   vf_widen_bits(p, shift, mask)  VL bytes p[0..VL): lane l = (p[l] >> shift) & mask as a float
 *                                  (mask << shift < 256)
 *   vf_fmadd(a, b, c)              c + a * b, each lane, with one rounding at EVERY level
 *
 * VI holds VL int32 lanes, one a column, for the int8 products; as loaded, lane l is the 4 bytes
 * p[4l..4l+4) (byte j: input j of a run of 4), the column's weights:
 *   vi_zero(), vi_set1(x), vi_add(a, b), vi_sub(a, b), vi_mul(a, b) (low 32 bits), vf_of_vi(v)
 *                                  (exact below 2^24)
 *   vi_load(p)                     p[0..4 VL) as above
 *   vi_widen_i8(p)                 VL int8 values p[0..VL), lane l = p[l]
 *   vi_low_nibbles(v), vi_high_nibbles(v)   each byte's low / high 4 bits, as a byte
 *   vi_byte_bits(v, shift, mask)   each byte b as (b >> shift) & mask (mask << shift < 256)
 *   vi_or(a, b)                    a | b, bit for bit
 *   vi_fifth_bits(v, bits)         byte b (0..4 VL) | 16 where bit b of bits is set
 *   vi_dot_u8(acc, w, x4)          acc + sum over j of w's byte j (unsigned, at most 127) times
 *                                  x4's byte j (signed, never -128), exact; x4 4 int8 inputs
 *   vi_dot_s8(acc, w, x4)          acc + sum over j of (w's byte j (signed) + DOT_S8_OFFSET) times
 *                                  x4's byte j, exact: VNNI's vpdpbusd multiplies unsigned by
 *                                  signed bytes, so there w is offset by 128 (one xor a weight,
 *                                  shared by the rows; the caller subtracts 128 * sum(x) once a
 *                                  block); without VNNI, |w| times x with w's sign (maddubs'
 *                                  pairs then reach 2 * 128 * 127 < 2^15: no saturation, where
 *                                  an offset weight's 2 * 255 * 127 would saturate)
 *   vi_sum16_u8(s, w, x4)          vi_dot_u8's products into s, where SUM16 is 1 as maddubs' pairs:
 *                                  lane l's two int16 halves each the sum of 2 products, added
 *                                  without the widening to int32 (half the multiplies)
 *   vi_add_sum16(acc, s)           acc + s's sums per lane as int32 (at SUM16 1 its halves added)
 *   SUM16_RUNS(top)                how many runs of 4 inputs s takes before vi_add_sum16, for
 *                                  weights at most top: a half then stays below 2^15 (2 * top * 127
 *                                  a run), so the sums are exact
 *
 * TILE_VECS registers of sums a row and TILE_ROWS rows make a product tile: as many as the
 * level's registers hold beside the weights' registers and the inputs' broadcasts; QUANT_ROWS
 * rows make an int8 tile (its integer block sums beside its float sums), Q6_K_ROWS (QUANT_ROWS
 * where a level does not set it) a Q6_K one. Q4_K tiles of UNROLL_RUNS_FROM rows or more unroll a
 * sub-block's 8 runs whole.
 * PREFETCH_BYTES: how far ahead of its reads a tile prefetches a column block's weights, where a
 * column block's weights (16 columns' over all inputs, one stream of reads) are fewer bytes than
 * PREFETCH_STREAMS_UNDER: a short stream ends before the CPU's own prefetcher has followed it, and
 * the prefetches then reach into the next blocks; over a long one the CPU keeps ahead alone, and
 * the prefetch instructions only take issue slots from the products.
 */
/* a float16 value as a float (exact, subnormals included) */
static inline float half_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    union { uint32_t u; float f; } v;
    if (exponent == 0x1f) v.u = sign | 0x7f800000u | (mantissa << 13);
    else if (exponent) v.u = sign | ((exponent + 112) << 23) | (mantissa << 13);
    else { v.f = (float)mantissa * 5.9604644775390625e-8f; v.u |= sign; }    /* mantissa * 2^-24 */
    return v.f;
}

/* a float as the nearest float16, ties to even (numpy's astype(float16)): overflow to infinity,
 * subnormals rounded in float32 arithmetic, which is exact there under the default rounding */
static inline uint16_t f32_to_half(float f) {
    union { float f; uint32_t u; } v = {f};
    uint32_t sign = (v.u >> 16) & 0x8000u, a = v.u & 0x7fffffffu;
    if (a >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (a > 0x7f800000u ? 0x200u : 0));
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);          /* 65520 and above round to inf */
    if (a < 0x38800000u) {                                              /* below 2^-14: subnormal */
        v.u = a;
        return (uint16_t)(sign | (uint32_t)lrintf(v.f * 16777216.0f));   /* units of 2^-24 */
    }
    uint32_t r = a - 0x38000000u;                                       /* exponent rebiased 127 -> 15 */
    return (uint16_t)(sign | ((r + 0x0fffu + ((r >> 13) & 1u)) >> 13));
}

#if !defined(OUTPACE_PORTABLE) && defined(__AVX512F__)
#include <immintrin.h>
#define VL 16
#define TILE_VECS 2         /* two blocks of 16 columns */
#define TILE_ROWS 12        /* 24 sums + 4 weights + 2 inputs of 32 registers */
typedef __m512 VF;
static inline VF vf_zero(void) { return _mm512_setzero_ps(); }
static inline VF vf_set1(float x) { return _mm512_set1_ps(x); }
static inline VF vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float *p, VF v) { _mm512_storeu_ps(p, v); }
static inline VF vf_fma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
static inline VF vf_mul(VF a, VF b) { return _mm512_mul_ps(a, b); }
static inline VF vf_add(VF a, VF b) { return _mm512_add_ps(a, b); }
static inline VF vf_load_half(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
/* (p[l] >> shift) & mask on 16 bytes (mask << shift < 256: 16-bit shifts bring no bits of the next byte in) */
static inline __m128i bits_u8x16(const uint8_t *p, int shift, int mask) {
    __m128i v = _mm_srl_epi16(_mm_loadu_si128((const __m128i *)p), _mm_cvtsi32_si128(shift));
    return _mm_and_si128(v, _mm_set1_epi8((char)mask));
}
static inline VF vf_widen_bits(const uint8_t *p, int shift, int mask) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bits_u8x16(p, shift, mask)));
}
static inline void vf_widen_pairs(const bf16 *p, VF *even, VF *odd) {
    __m512i v = _mm512_loadu_si512(p);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)));
}
static inline VF vf_fmadd(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
#define QUANT_ROWS 6        /* 12 float sums + 12 integer sums + 4 weights of 32 registers */
#define Q6_K_ROWS 4         /* Q6_K's weights take 8 registers: a 151936 x 1536 product (Qwen2.5-Coder-1.5B's LM
                             * head) of 5-16 rows 1.06-1.15x faster than in tiles of 6 on an AMD EPYC (Zen 4),
                             * 1-4 and 64 rows level */
typedef __m512i VI;
static inline VI vi_zero(void) { return _mm512_setzero_si512(); }
static inline VI vi_set1(int32_t x) { return _mm512_set1_epi32(x); }
static inline VI vi_sub(VI a, VI b) { return _mm512_sub_epi32(a, b); }
static inline VI vi_add(VI a, VI b) { return _mm512_add_epi32(a, b); }
static inline VI vi_mul(VI a, VI b) { return _mm512_mullo_epi32(a, b); }
static inline VF vf_of_vi(VI v) { return _mm512_cvtepi32_ps(v); }
static inline VI vi_load(const void *p) { return _mm512_loadu_si512(p); }
static inline VI vi_widen_i8(const int8_t *p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline VI vi_low_nibbles(VI v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }
static inline VI vi_high_nibbles(VI v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15)); }
static inline VI vi_byte_bits(VI v, int shift, int mask) {    /* 16-bit shifts: the next byte's bits are masked off */
    return _mm512_and_si512(shift ? _mm512_srli_epi16(v, shift) : v, _mm512_set1_epi8((char)mask));
}
static inline VI vi_or(VI a, VI b) { return _mm512_or_si512(a, b); }
static inline VI vi_fifth_bits(VI v, uint64_t bits) {
    return _mm512_or_si512(v, _mm512_maskz_mov_epi8((__mmask64)bits, _mm512_set1_epi8(16)));
}
#ifdef __AVX512VNNI__
#define DOT_S8_OFFSET 128
static inline VI vi_dot_u8(VI acc, VI w, int32_t x4) { return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(x4)); }
static inline VI vi_dot_s8(VI acc, VI w, int32_t x4) {
    return _mm512_dpbusd_epi32(acc, _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80)), _mm512_set1_epi32(x4));
}
#else
#define DOT_S8_OFFSET 0
static inline VI vi_dot_u8(VI acc, VI w, int32_t x4) {
    __m512i pairs = _mm512_maddubs_epi16(w, _mm512_set1_epi32(x4));
    return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
}
static inline VI vi_dot_s8(VI acc, VI w, int32_t x4) {
    __m512i x = _mm512_set1_epi32(x4);
    x = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
    __m512i pairs = _mm512_maddubs_epi16(_mm512_abs_epi8(w), x);
    return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
}
#endif

#elif !defined(OUTPACE_PORTABLE) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VL 8
#define TILE_VECS 2         /* one block of 16 columns (two: 9 and 16 rows 1.3-1.8x slower) */
#define TILE_ROWS 5         /* 10 sums + 4 weights + 2 inputs of 16 registers (9 rows 1.2x faster than 4) */
typedef __m256 VF;
static inline VF vf_zero(void) { return _mm256_setzero_ps(); }
static inline VF vf_set1(float x) { return _mm256_set1_ps(x); }
static inline VF vf_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void vf_store(float *p, VF v) { _mm256_storeu_ps(p, v); }
static inline VF vf_fma(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
static inline VF vf_mul(VF a, VF b) { return _mm256_mul_ps(a, b); }
static inline VF vf_add(VF a, VF b) { return _mm256_add_ps(a, b); }
static inline VF vf_load_half(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
/* (p[l] >> shift) & mask on 8 bytes (mask << shift < 256: 16-bit shifts bring no bits of the next byte in) */
static inline __m128i bits_u8x8(const uint8_t *p, int shift, int mask) {
    __m128i v = _mm_srl_epi16(_mm_loadl_epi64((const __m128i *)p), _mm_cvtsi32_si128(shift));
    return _mm_and_si128(v, _mm_set1_epi8((char)mask));
}
static inline VF vf_widen_bits(const uint8_t *p, int shift, int mask) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bits_u8x8(p, shift, mask)));
}
static inline void vf_widen_pairs(const bf16 *p, VF *even, VF *odd) {
    __m256i v = _mm256_loadu_si256((const __m256i *)p);
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    *odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
}
static inline VF vf_fmadd(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
#define QUANT_ROWS 5        /* 10 float sums + 10 integer sums of 16 registers: the float ones spill, touched once
                             * a block. A verify row with 4 drafts is then one tile: 5-row Q4_K, Q8_0 and Q4_1
                             * products 1.1-1.4x faster than as 3 + 2 rows on an AMD EPYC (Zen 3), 64 rows alike;
                             * 2 rows made 9-16 rows about 1.4x slower */
#define Q6_K_ROWS 4         /* Q6_K's weights take 8 registers: 5 rows made its 64-row products 0.89-0.98x */
#define UNROLL_RUNS_FROM 4  /* 4- and 5-row Q4_K tiles unroll a sub-block's runs whole (1.08x and 1.20x on an AMD
                             * EPYC, Zen 3: in the loop a 5-row tile's sums spill); fewer rows keep the loop
                             * (unrolled, 1-2 rows 0.97x) */
typedef __m256i VI;
static inline VI vi_zero(void) { return _mm256_setzero_si256(); }
static inline VI vi_set1(int32_t x) { return _mm256_set1_epi32(x); }
static inline VI vi_sub(VI a, VI b) { return _mm256_sub_epi32(a, b); }
static inline VI vi_add(VI a, VI b) { return _mm256_add_epi32(a, b); }
static inline VI vi_mul(VI a, VI b) { return _mm256_mullo_epi32(a, b); }
static inline VF vf_of_vi(VI v) { return _mm256_cvtepi32_ps(v); }
static inline VI vi_load(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline VI vi_widen_i8(const int8_t *p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline VI vi_low_nibbles(VI v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
static inline VI vi_high_nibbles(VI v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15)); }
static inline VI vi_byte_bits(VI v, int shift, int mask) {    /* 16-bit shifts: the next byte's bits are masked off */
    return _mm256_and_si256(shift ? _mm256_srli_epi16(v, shift) : v, _mm256_set1_epi8((char)mask));
}
static inline VI vi_or(VI a, VI b) { return _mm256_or_si256(a, b); }
static inline VI vi_fifth_bits(VI v, uint64_t bits) {    /* byte b takes byte b / 8 of bits, then its bit b % 8 */
    __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)(uint32_t)bits),
                                         _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    return _mm256_or_si256(v, _mm256_and_si256(set, _mm256_set1_epi8(16)));
}
#ifdef __AVXVNNI__     /* avx2_vnni: VNNI's vpdpbusd on 8 lanes (Intel's client cores from Alder Lake on) */
#define DOT_S8_OFFSET 128
static inline VI vi_dot_u8(VI acc, VI w, int32_t x4) { return _mm256_dpbusd_avx_epi32(acc, w, _mm256_set1_epi32(x4)); }
static inline VI vi_dot_s8(VI acc, VI w, int32_t x4) {
    return _mm256_dpbusd_avx_epi32(acc, _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80)), _mm256_set1_epi32(x4));
}
#else
#define DOT_S8_OFFSET 0
static inline VI vi_dot_u8(VI acc, VI w, int32_t x4) {
    __m256i pairs = _mm256_maddubs_epi16(w, _mm256_set1_epi32(x4));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
static inline VI vi_dot_s8(VI acc, VI w, int32_t x4) {
    __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(_mm256_set1_epi32(x4), w));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
/* one multiply a run where vi_dot_u8 takes two: the k-quants' products at 1-9 rows 1.03-1.11x
 * faster on an AMD EPYC (Q4_1's, tried too, 0.88-1.13x: its blocks keep vi_dot_u8) */
#define SUM16 1
static inline VI vi_sum16_u8(VI s, VI w, int32_t x4) { return _mm256_add_epi16(s, _mm256_maddubs_epi16(w, _mm256_set1_epi32(x4))); }
static inline VI vi_add_sum16(VI acc, VI s) { return _mm256_add_epi32(acc, _mm256_madd_epi16(s, _mm256_set1_epi16(1))); }
#endif
/* v, held in a register at this point (an empty asm takes it and gives it back). GCC 12 otherwise
 * computed a run's products ahead of their adds and spilled the sums of a 5-row tile (10 of the 16
 * registers) to the stack, every run's adds then waiting on a reload; the products' tiles keep
 * their sums so after each run (KEEP_SUMS): Q4_K products of 16 rows 1.2-1.3x faster, of 1-5 rows
 * 1.1x, Q6_K, Q8_0 and Q4_1 up to 1.1x on an AMD EPYC (Zen 3). It orders integer adds only, so
 * no result changes. */
#define VI_KEEP
static inline __attribute__((always_inline)) void vi_keep(VI *v) { __asm__("" : "+x"(*v)); }

#elif !defined(OUTPACE_PORTABLE) && defined(__ARM_NEON)
#include <arm_neon.h>
#define VL 4
#define TILE_VECS 4         /* one block of 16 columns */
#define TILE_ROWS 4         /* 16 sums + 8 weights + 2 inputs of 32 registers */
typedef float32x4_t VF;
static inline VF vf_zero(void) { return vdupq_n_f32(0.0f); }
static inline VF vf_set1(float x) { return vdupq_n_f32(x); }
static inline VF vf_load(const float *p) { return vld1q_f32(p); }
static inline void vf_store(float *p, VF v) { vst1q_f32(p, v); }
static inline VF vf_fma(VF a, VF b, VF c) { return vfmaq_f32(c, a, b); }
static inline VF vf_mul(VF a, VF b) { return vmulq_f32(a, b); }
static inline VF vf_add(VF a, VF b) { return vaddq_f32(a, b); }
static inline VF vf_load_half(const uint16_t *p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }
static inline uint8x8_t four_bytes(const void *p) {     /* p[0..4) in the low lanes */
    uint32_t w;
    memcpy(&w, p, sizeof w);
    return vreinterpret_u8_u32(vdup_n_u32(w));
}
static inline uint32x4_t widen_u8x4(const uint8_t *p) { return vmovl_u16(vget_low_u16(vmovl_u8(four_bytes(p)))); }
static inline VF vf_widen_bits(const uint8_t *p, int shift, int mask) {     /* a shift left by -shift: right */
    uint32x4_t v = vshlq_u32(widen_u8x4(p), vdupq_n_s32(-shift));
    return vcvtq_f32_u32(vandq_u32(v, vdupq_n_u32((uint32_t)mask)));
}
static inline void vf_widen_pairs(const bf16 *p, VF *even, VF *odd) {
    uint32x4_t v = vld1q_u32((const uint32_t *)p);
    *even = vreinterpretq_f32_u32(vshlq_n_u32(v, 16));
    *odd = vreinterpretq_f32_u32(vandq_u32(v, vdupq_n_u32(0xffff0000u)));
}
static inline VF vf_fmadd(VF a, VF b, VF c) { return vfmaq_f32(c, a, b); }
#define QUANT_ROWS 2        /* 8 float sums + 8 integer sums + 8 weights + temporaries of 32 registers */
#define DOT_S8_OFFSET 0
typedef int32x4_t VI;
static inline VI vi_zero(void) { return vdupq_n_s32(0); }
static inline VI vi_set1(int32_t x) { return vdupq_n_s32(x); }
static inline VI vi_sub(VI a, VI b) { return vsubq_s32(a, b); }
static inline VI vi_add(VI a, VI b) { return vaddq_s32(a, b); }
static inline VI vi_mul(VI a, VI b) { return vmulq_s32(a, b); }
static inline VF vf_of_vi(VI v) { return vcvtq_f32_s32(v); }
static inline VI vi_load(const void *p) { return vreinterpretq_s32_u8(vld1q_u8((const uint8_t *)p)); }
static inline VI vi_widen_i8(const int8_t *p) { return vmovl_s16(vget_low_s16(vmovl_s8(vreinterpret_s8_u8(four_bytes(p))))); }
static inline VI vi_byte_bits(VI v, int shift, int mask) {     /* a shift left by -shift: right */
    uint8x16_t b = vshlq_u8(vreinterpretq_u8_s32(v), vdupq_n_s8((int8_t)-shift));
    return vreinterpretq_s32_u8(vandq_u8(b, vdupq_n_u8((uint8_t)mask)));
}
static inline VI vi_or(VI a, VI b) { return vorrq_s32(a, b); }
static inline VI vi_low_nibbles(VI v) {
    return vreinterpretq_s32_u8(vandq_u8(vreinterpretq_u8_s32(v), vdupq_n_u8(15)));
}
static inline VI vi_high_nibbles(VI v) { return vreinterpretq_s32_u8(vshrq_n_u8(vreinterpretq_u8_s32(v), 4)); }
static inline VI vi_fifth_bits(VI v, uint64_t bits) {
    const uint8_t lanes[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    uint8x16_t spread = vcombine_u8(vdup_n_u8((uint8_t)bits), vdup_n_u8((uint8_t)(bits >> 8)));
    uint8x16_t set = vtstq_u8(spread, vld1q_u8(lanes));
    return vreinterpretq_s32_u8(vorrq_u8(vreinterpretq_u8_s32(v), vandq_u8(set, vdupq_n_u8(16))));
}
/* bytes as signed at both operands: unsigned weights are at most 127 here; products fit int16 */
static inline VI vi_dot_s8(VI acc, VI w, int32_t x4) {
    int8x16_t a = vreinterpretq_s8_s32(w), x = vreinterpretq_s8_s32(vdupq_n_s32(x4));
    int32x4_t low = vpaddlq_s16(vmull_s8(vget_low_s8(a), vget_low_s8(x)));     /* columns 0, 0, 1, 1 */
    int32x4_t high = vpaddlq_s16(vmull_high_s8(a, x));                         /* columns 2, 2, 3, 3 */
    return vaddq_s32(acc, vpaddq_s32(low, high));
}
static inline VI vi_dot_u8(VI acc, VI w, int32_t x4) { return vi_dot_s8(acc, w, x4); }

#else   /* portable: one float a "register"; the compiler vectorises the tile's loops over them */
#define VL 1
#define TILE_VECS 16        /* one block of 16 columns */
#define TILE_ROWS 4
typedef float VF;
static inline VF vf_zero(void) { return 0.0f; }
static inline VF vf_set1(float x) { return x; }
static inline VF vf_load(const float *p) { return *p; }
static inline void vf_store(float *p, VF v) { *p = v; }
static inline VF vf_fma(VF a, VF b, VF c) { return c + a * b; }
static inline VF vf_mul(VF a, VF b) { return a * b; }
static inline VF vf_add(VF a, VF b) { return a + b; }
static inline VF vf_load_half(const uint16_t *p) { return half_to_f32(*p); }
static inline VF vf_widen_bits(const uint8_t *p, int shift, int mask) { return (float)((*p >> shift) & mask); }
static inline void vf_widen_pairs(const bf16 *p, VF *even, VF *odd) {
    *even = bf16_to_f32(p[0]);
    *odd = bf16_to_f32(p[1]);
}
static inline VF vf_fmadd(VF a, VF b, VF c) { return fmaf(a, b, c); }
#define QUANT_ROWS 4
#define DOT_S8_OFFSET 0
typedef int32_t VI;         /* byte j of a loaded lane: bits 8j..8j+8 (little-endian) */
static inline VI vi_zero(void) { return 0; }
static inline VI vi_set1(int32_t x) { return x; }
static inline VI vi_sub(VI a, VI b) { return a - b; }
static inline VI vi_add(VI a, VI b) { return a + b; }
static inline VI vi_mul(VI a, VI b) { return a * b; }
static inline VF vf_of_vi(VI v) { return (float)v; }
static inline VI vi_widen_i8(const int8_t *p) { return *p; }
static inline VI vi_load(const void *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline VI vi_low_nibbles(VI v) { return (int32_t)((uint32_t)v & 0x0f0f0f0fu); }
static inline VI vi_high_nibbles(VI v) { return (int32_t)(((uint32_t)v >> 4) & 0x0f0f0f0fu); }
static inline VI vi_byte_bits(VI v, int shift, int mask) { return (int32_t)(((uint32_t)v >> shift) & 0x01010101u * (uint32_t)mask); }
static inline VI vi_or(VI a, VI b) { return a | b; }
static inline VI vi_fifth_bits(VI v, uint64_t bits) {  /* bit j of 4 to bit 8j: the products do not overlap */
    return (int32_t)((uint32_t)v | ((((uint32_t)bits & 15u) * 0x00204081u) & 0x01010101u) << 4);
}
static inline VI vi_dot_u8(VI acc, VI w, int32_t x4) {
    for (int j = 0; j < 4; j++) acc += (int32_t)(uint8_t)((uint32_t)w >> 8 * j) * (int8_t)((uint32_t)x4 >> 8 * j);
    return acc;
}
static inline VI vi_dot_s8(VI acc, VI w, int32_t x4) {
    for (int j = 0; j < 4; j++) acc += (int8_t)((uint32_t)w >> 8 * j) * (int8_t)((uint32_t)x4 >> 8 * j);
    return acc;
}
#endif

#ifndef VI_KEEP     /* other levels: the compiler's own order (not measured against a kept one) */
static inline void vi_keep(VI *v) { (void)v; }
#endif
#ifndef SUM16       /* vpdpbusd, NEON's and plain C's products sum in int32 lanes at once */
#define SUM16 0
static inline VI vi_sum16_u8(VI s, VI w, int32_t x4) { return vi_dot_u8(s, w, x4); }
static inline VI vi_add_sum16(VI acc, VI s) { return vi_add(acc, s); }
#endif
#define SUM16_RUNS(top) (SUM16 ? 32767 / (2 * 127 * (top)) : 64)
#ifndef UNROLL_RUNS_FROM    /* other levels: the compiler's own unrolling (not measured against a whole one) */
#define UNROLL_RUNS_FROM 64
#endif

#define PREFETCH_BYTES 65536
#define PREFETCH_STREAMS_UNDER 16384
