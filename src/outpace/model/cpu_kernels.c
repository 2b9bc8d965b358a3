/* The small ops of a CPU decode or verify step, one call each (see cpu_kernels.py).
 *
 * Each function runs one op over T token rows, row by row, so a row's result never depends on
 * how many rows the call holds. Every function exists for float32 and bfloat16 activations
 * (suffix _f32, _bf16: cpu_kernels_dtype.h, included once per dtype); bfloat16 ones compute in
 * float32 and round where PyTorch's bfloat16 ops round (after every op), so they follow the
 * reference's arithmetic step by step. Attention's dot products and softmax sums are the
 * exception: they accumulate in float32 in an order of their own, as PyTorch's kernels do.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

typedef uint16_t bf16;

#define MAX_HEAD_DIM 256
#define MAX_GROUP 64        /* query heads per key/value head */
#define LANES 16            /* partial sums per reduction: one AVX-512 register of floats */
/* attention runs on several threads from this many keys (summed over tokens and key/value heads):
 * fewer cost less than waking the threads */
#define PARALLEL_MIN_KEYS 512

static inline float bf16_to_f32(bf16 x) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}

static inline bf16 f32_to_bf16(float f) {     /* round to nearest even, NaN stays NaN */
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (bf16)((v.u >> 16) | 0x40u);
    v.u += 0x7fffu + ((v.u >> 16) & 1u);
    return (bf16)(v.u >> 16);
}

/* exp(x) in float32 to about 1 ulp, written so the compiler vectorises loops over it (glibc's
 * expf is a call per element): 2^n * e^r with |r| <= ln2/2, e^r by its Taylor polynomial. */
static inline float exp_f32(float x) {
    x = x < -87.3f ? -87.3f : x > 88.7f ? 88.7f : x;
    float n = rintf(x * 1.44269504f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.98756912e-4f;
    p = p * r + 1.39819994e-3f;
    p = p * r + 8.33345205e-3f;
    p = p * r + 4.16657962e-2f;
    p = p * r + 1.66666657e-1f;
    p = p * r + 5.0e-1f;
    p = p * r * r + r + 1.0f;
    union { uint32_t u; float f; } scale;
    scale.u = (uint32_t)((int32_t)n + 127) << 23;
    return p * scale.f;
}

/* sum of parts[0..LANES) in a fixed order */
static inline float lanes_sum(const float *parts) {
    float total = 0.0f;
    for (int l = 0; l < LANES; l++) total += parts[l];
    return total;
}

#define T float
#define NAME(f) f##_f32
#define LOAD(x) (x)
#define STORE(x) (x)
#define ROUND(x) (x)
#ifdef __AVX512F__
#define LOAD16(p) _mm512_loadu_ps(p)
#endif
#include "cpu_kernels_dtype.h"
#undef T
#undef NAME
#undef LOAD
#undef STORE
#undef ROUND
#undef LOAD16

#define T bf16
#define NAME(f) f##_bf16
#define LOAD(x) bf16_to_f32(x)
#define STORE(x) f32_to_bf16(x)
#define ROUND(x) bf16_to_f32(f32_to_bf16(x))
#ifdef __AVX512F__
#define LOAD16(p) _mm512_castsi512_ps(_mm512_slli_epi32( \
    _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#endif
#include "cpu_kernels_dtype.h"
