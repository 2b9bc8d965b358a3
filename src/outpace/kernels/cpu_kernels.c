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
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

typedef uint16_t bf16;

#define MAX_HEAD_DIM 256
#define MAX_GROUP 64        /* query heads per key/value head */
#define BLOCK_QUERIES 64    /* queries attend_blocked serves in one call: 16 from few heads a group, up to a group */
/* attend_blocked prefetches the keys (values in its second pass) of the block this many blocks
 * ahead into L2: the step's stream of weights has evicted the KV cache from the CPU's caches. A step
 * at 900 tokens of context, 1/3/5/9 tokens: 14.8/16.5/17.7/19.6 ms against 16.0/18.0/19.4/21.4
 * (8 blocks into L1: about half the gain) */
#define BLOCKS_AHEAD 32
#define LANES 16            /* partial sums per reduction: one AVX-512 register of floats */
/* attention runs on several threads from this many keys (summed over tokens and key/value heads):
 * fewer cost less than waking the threads */
#define PARALLEL_MIN_KEYS 512
/* the norm and SwiGLU kernels share their rows among threads from this many values (prompt chunks):
 * a decode step's few rows cost less than waking the threads */
#define PARALLEL_MIN_VALUES 65536

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
 * expf is a call per element): 2^n * e^r with |r| <= ln2/2, e^r by its Taylor polynomial in fused
 * multiply-adds; 2^n built from its bits, n = 128 as 2^127 * 2 (exact, as vscalefps scales) */
static inline float exp_f32(float x) {
    x = x < -87.3f ? -87.3f : x > 88.7f ? 88.7f : x;
    float n = rintf(x * 1.44269504f);
    float r = fmaf(n, 2.12194440e-4f, fmaf(-n, 0.693359375f, x));
    float p = 1.98756912e-4f;
    p = fmaf(p, r, 1.39819994e-3f);
    p = fmaf(p, r, 8.33345205e-3f);
    p = fmaf(p, r, 4.16657962e-2f);
    p = fmaf(p, r, 1.66666657e-1f);
    p = fmaf(p, r, 5.0e-1f);
    p = fmaf(p * r, r, r) + 1.0f;
    union { uint32_t u; float f; } scale;
    scale.u = (uint32_t)((int32_t)(n > 127.0f ? 127.0f : n) + 127) << 23;
    return p * scale.f * (n > 127.0f ? 2.0f : 1.0f);
}

#ifdef __AVX512F__
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
#define STORE16(p, v) _mm512_storeu_ps(p, v)
#define ROUND16(v) (v)
#endif
#include "cpu_kernels_dtype.h"
#undef T
#undef NAME
#undef LOAD
#undef STORE
#undef ROUND
#undef LOAD16
#undef STORE16
#undef ROUND16

#define T bf16
#define NAME(f) f##_bf16
#define LOAD(x) bf16_to_f32(x)
#define STORE(x) f32_to_bf16(x)
#define ROUND(x) bf16_to_f32(f32_to_bf16(x))
#ifdef __AVX512F__
#define LOAD16(p) _mm512_castsi512_ps(_mm512_slli_epi32( \
    _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define STORE16(p, v) _mm256_storeu_si256((__m256i *)(p), round_to_bf16(v))
#define ROUND16(v) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(round_to_bf16(v)), 16))
#endif
#ifdef __AVX512BF16__
#define DOT_PAIRS       /* attention scores as vdpbf16ps over pairs of bfloat16 values */
#endif
#include "cpu_kernels_dtype.h"

#ifdef __AVX512F__
/* Matrix products for a few rows: out [M, N] = x [M, K] @ W^T (+ bias), summed in float32 and
 * rounded once. W (bfloat16 or float32) is packed by cpu_kernels.pack_weight into blocks of 16
 * output columns, [N / 16][K / 2][2][16] float32 or [N / 16][K / 2][16][2] bfloat16: per pair of
 * inputs, one load (bfloat16, widened to two registers of floats) or two (float32) hold a block's
 * 16 columns, multiplied with the row's two inputs broadcast (float32 FMAs). Where the CPU has
 * AVX512_BF16, bfloat16 inputs over bfloat16 weights take vdpbf16ps instead (linear_tile_dp), one
 * instruction for both inputs of a pair: on an AMD EPYC (Zen 4) it runs at the FMAs' rate, so the
 * default model's 121 products of one step took 12.1 ms against 16.6 for 9 rows, 49.8 against 88.1
 * for 64, 174.1 against 372.9 for 256 (10.8 against 12.5 for one row); an earlier machine ran it at
 * half the FMAs' rate. A tile of TILE_BLOCKS blocks and up to TILE_ROWS rows keeps its sums in
 * registers over all of K, so each weight is read from memory once per call (later row tiles of a
 * call read it from L2). Each row's sums take one order whatever M is: a row's result never
 * depends on the rows beside it. */
#define TILE_BLOCKS 2
#define TILE_ROWS 12
/* each block's weights are prefetched this many bytes ahead into L2 (past a block's end, a later
 * block's; past the weight's end nothing faults). The default model's bfloat16 products of one
 * step on the vdpbf16ps path (Zen 4), against 2 KB ahead into L1: 1 row 11.0 against 12.5 ms,
 * 5 rows 11.4 / 14.0, 9 rows 11.0 / 14.1, 16 rows 14.1 / 18.3, 64 rows 49.6 / 54.0 (32 to 96 KB
 * alike; 32 KB into L1 no better than 2 KB). Float32 weights: no change. Into L1 2 KB ahead had
 * been the best on the first kernels' machine (Intel, the FMA path) */
#define PREFETCH_BYTES 65536

/* A tile's sums plus the bias (NULL: none; float32 when wide_bias, else bfloat16) into out
 * [rows, N] at its blocks' columns, float32 when wide_out, else rounded to bfloat16; columns from
 * n_valid on are not stored. */
static inline __attribute__((always_inline)) void store_tile(__m512 acc[TILE_ROWS][TILE_BLOCKS], long rows,
                                                             int blocks, const void *bias, int wide_bias,
                                                             long n_valid, void *out, int wide_out, long N) {
#pragma GCC unroll 4
    for (int b = 0; b < TILE_BLOCKS; b++) {
        if (b >= blocks) continue;
        long left = n_valid - b * 16;
        __mmask16 keep = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
        __m512 add = _mm512_setzero_ps();
        if (bias && wide_bias) add = _mm512_maskz_loadu_ps(keep, (const float *)bias + b * 16);
        if (bias && !wide_bias) add = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                    _mm256_maskz_loadu_epi16(keep, (const bf16 *)bias + b * 16)), 16));
#pragma GCC unroll 16
        for (int m = 0; m < TILE_ROWS; m++) {
            if (m >= rows) continue;
            __m512 v = _mm512_add_ps(acc[m][b], add);
            if (wide_out) _mm512_mask_storeu_ps((float *)out + m * N + b * 16, keep, v);
            else _mm256_mask_storeu_epi16((bf16 *)out + m * N + b * 16, keep, round_to_bf16(v));
        }
    }
}

/* wide: float32 weights and bias, else bfloat16; wide_out: float32 out, else bfloat16 */
static inline __attribute__((always_inline)) void linear_tile(const float *x, long K, const void *w, int wide,
                                                              long rows, int blocks, const void *bias,
                                                              long n_valid, void *out, int wide_out, long N) {
    long pairs = K / 2, pair_bytes = wide ? 128 : 64;
    const char *wb = w;
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    __m512 acc[TILE_ROWS][TILE_BLOCKS];
#pragma GCC unroll 16
    for (int m = 0; m < TILE_ROWS; m++) {
#pragma GCC unroll 4
        for (int b = 0; b < TILE_BLOCKS; b++) acc[m][b] = _mm512_setzero_ps();
    }
    for (long p = 0; p < pairs; p++) {
        __m512 even[TILE_BLOCKS], odd[TILE_BLOCKS];
#pragma GCC unroll 4
        for (int b = 0; b < TILE_BLOCKS; b++) {
            if (b < blocks) {
                const char *at = wb + (b * pairs + p) * pair_bytes;
                _mm_prefetch(at + PREFETCH_BYTES, _MM_HINT_T1);
                if (wide) {
                    _mm_prefetch(at + PREFETCH_BYTES + 64, _MM_HINT_T1);
                    even[b] = _mm512_loadu_ps(at);
                    odd[b] = _mm512_loadu_ps(at + 64);
                } else {
                    __m512i v = _mm512_loadu_si512(at);
                    even[b] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
                    odd[b] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
                }
            }
        }
#pragma GCC unroll 16
        for (int m = 0; m < TILE_ROWS; m++) {
            if (m < rows) {
                __m512 x0 = _mm512_set1_ps(x[m * K + 2 * p]), x1 = _mm512_set1_ps(x[m * K + 2 * p + 1]);
#pragma GCC unroll 4
                for (int b = 0; b < TILE_BLOCKS; b++) {
                    if (b < blocks) {
                        acc[m][b] = _mm512_fmadd_ps(x0, even[b], acc[m][b]);
                        acc[m][b] = _mm512_fmadd_ps(x1, odd[b], acc[m][b]);
                    }
                }
            }
        }
    }
    store_tile(acc, rows, blocks, bias, wide, n_valid, out, wide_out, N);
}

#ifdef __AVX512BF16__
/* linear_tile for bfloat16 inputs, weights and out with vdpbf16ps: a lane of a pair's load holds
 * one column's weights of inputs 2p and 2p+1, the row's two inputs are broadcast as one 32-bit
 * value, and one instruction adds both products to the column's float32 sum (the odd input's
 * product first, each rounded into it): half the instructions of two FMAs, and no widening. */
static inline __attribute__((always_inline)) void linear_tile_dp(const bf16 *x, long K, const bf16 *w, long rows,
                                                                 int blocks, const bf16 *bias, long n_valid,
                                                                 bf16 *out, long N) {
    long pairs = K / 2;
    const char *wb = (const char *)w;
    __m512 acc[TILE_ROWS][TILE_BLOCKS];
#pragma GCC unroll 16
    for (int m = 0; m < TILE_ROWS; m++) {
#pragma GCC unroll 4
        for (int b = 0; b < TILE_BLOCKS; b++) acc[m][b] = _mm512_setzero_ps();
    }
    for (long p = 0; p < pairs; p++) {
        __m512bh wv[TILE_BLOCKS];
#pragma GCC unroll 4
        for (int b = 0; b < TILE_BLOCKS; b++) {
            if (b < blocks) {
                const char *at = wb + (b * pairs + p) * 64;
                _mm_prefetch(at + PREFETCH_BYTES, _MM_HINT_T1);
                wv[b] = (__m512bh)_mm512_loadu_si512(at);
            }
        }
#pragma GCC unroll 16
        for (int m = 0; m < TILE_ROWS; m++) {
            if (m < rows) {
                int32_t both;
                memcpy(&both, x + m * K + 2 * p, sizeof both);
                __m512bh xp = (__m512bh)_mm512_set1_epi32(both);
#pragma GCC unroll 4
                for (int b = 0; b < TILE_BLOCKS; b++) {
                    if (b < blocks) acc[m][b] = _mm512_dpbf16_ps(acc[m][b], xp, wv[b]);
                }
            }
        }
    }
    store_tile(acc, rows, blocks, bias, 0, n_valid, out, 0, N);
}

#define TILE_DP_SHAPE(R) \
    if (blocks == TILE_BLOCKS) linear_tile_dp(x, K, w, R, TILE_BLOCKS, bias, n_valid, out, N); \
    else linear_tile_dp(x, K, w, R, blocks, bias, n_valid, out, N);
#define TILE_DP_CASE(R) case R: TILE_DP_SHAPE(R) break;

static void linear_tile_dp_any(const bf16 *x, long K, const bf16 *w, long rows, int blocks, const bf16 *bias,
                               long n_valid, bf16 *out, long N) {
    switch (rows) {
        TILE_DP_CASE(1) TILE_DP_CASE(2) TILE_DP_CASE(3) TILE_DP_CASE(4) TILE_DP_CASE(5) TILE_DP_CASE(6)
        TILE_DP_CASE(7) TILE_DP_CASE(8) TILE_DP_CASE(9) TILE_DP_CASE(10) TILE_DP_CASE(11) TILE_DP_CASE(12)
    }
}
#endif

/* rows, the weights' type and full tiles as constants, so each tile shape compiles to its own loop
 * with its sums in registers */
#define TILE_SHAPE(R, WIDE) \
    if (blocks == TILE_BLOCKS) linear_tile(x, K, w, WIDE, R, TILE_BLOCKS, bias, n_valid, out, wide_out, N); \
    else linear_tile(x, K, w, WIDE, R, blocks, bias, n_valid, out, wide_out, N);
#define TILE_CASE(R) case R: if (wide) { TILE_SHAPE(R, 1) } else { TILE_SHAPE(R, 0) } break;

static void linear_tile_any(const float *x, long K, const void *w, int wide, long rows, int blocks,
                            const void *bias, long n_valid, void *out, int wide_out, long N) {
    switch (rows) {
        TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4) TILE_CASE(5) TILE_CASE(6)
        TILE_CASE(7) TILE_CASE(8) TILE_CASE(9) TILE_CASE(10) TILE_CASE(11) TILE_CASE(12)
    }
}

/* 1 where bfloat16 products run on vdpbf16ps (linear_tile_dp), else 0 */
int linear_bf16_dot(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

/* out [M, N] = x [M, K] @ W^T + bias (bias may be NULL), w packed as above, K even; x and out
 * float32 when wide_io, else bfloat16; weights and bias float32 when wide_w, else bfloat16. Tiles of
 * columns are shared among OpenMP threads; a tile's rows run in equal parts of at most TILE_ROWS.
 * Returns 0, or -1 when memory for x widened to float32 ran out. */
int linear(const void *x, int wide_io, long M, long K, const void *w, int wide_w, long N, const void *bias,
           void *out) {
    long blocks = (N + 15) / 16, tiles = (blocks + TILE_BLOCKS - 1) / TILE_BLOCKS;
    long parts = (M + TILE_ROWS - 1) / TILE_ROWS, per_part = (M + parts - 1) / parts;
    int dot = 0;        /* vdpbf16ps over the bfloat16 inputs themselves */
#ifdef __AVX512BF16__
    dot = !wide_io && !wide_w;
#endif
    float *x_f32 = (float *)x;
    if (!wide_io && !dot) {
        x_f32 = malloc(sizeof(float) * (size_t)(M * K));
        if (!x_f32) return -1;
        for (long i = 0; i < M * K; i++) x_f32[i] = bf16_to_f32(((const bf16 *)x)[i]);
    }
    size_t w_size = wide_w ? 4 : 2, out_size = wide_io ? 4 : 2;
#pragma omp parallel for schedule(static) if (tiles > 1)
    for (long t = 0; t < tiles; t++) {
        long b0 = t * TILE_BLOCKS;
        int nb = blocks - b0 < TILE_BLOCKS ? (int)(blocks - b0) : TILE_BLOCKS;
        for (long m0 = 0; m0 < M; m0 += per_part) {
            long rows = M - m0 < per_part ? M - m0 : per_part;
            const void *bias_t = bias ? (const char *)bias + b0 * 16 * w_size : NULL;
            void *out_t = (char *)out + (m0 * N + b0 * 16) * out_size;
#ifdef __AVX512BF16__
            if (dot) {
                linear_tile_dp_any((const bf16 *)x + m0 * K, K, (const bf16 *)w + b0 * 16 * K, rows, nb, bias_t,
                                   N - b0 * 16, out_t, N);
                continue;
            }
#endif
            linear_tile_any(x_f32 + m0 * K, K, (const char *)w + b0 * 16 * K * w_size, wide_w, rows, nb, bias_t,
                            N - b0 * 16, out_t, wide_io, N);
        }
    }
    if (!wide_io && !dot) free(x_f32);
    return 0;
}
#endif

/* out[r] = the index of row r's largest value in x [rows, cols] float32, as torch.argmax picks it:
 * the first of equal values, and the first NaN where a row has one. Rows are shared among OpenMP
 * threads. PyTorch's own took about 40 us a row of the default model's 49152 logits on the
 * fourteenth session's machine (Zen 4), this one about 13. */
void argmax_f32(const float *x, long rows, long cols, int64_t *out) {
#pragma omp parallel for if (rows * cols >= PARALLEL_MIN_VALUES) schedule(static)
    for (long r = 0; r < rows; r++) {
        const float *row = x + r * cols;
        long best = 0, i = 0;
        int has_nan = 0;
#ifdef __AVX512F__
        if (cols >= 16) {
            /* each lane keeps its own first maximum; lanes' indices rise, so the first of equal
             * maxima across lanes is the smallest index among them */
            __m512 top = _mm512_loadu_ps(row);
            __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            __m512i index = at;
            const __m512i step = _mm512_set1_epi32(16);
            __mmask16 nan = _mm512_cmp_ps_mask(top, top, _CMP_UNORD_Q);
            for (i = 16; i + 16 <= cols; i += 16) {
                __m512 v = _mm512_loadu_ps(row + i);
                index = _mm512_add_epi32(index, step);
                __mmask16 higher = _mm512_cmp_ps_mask(v, top, _CMP_GT_OQ);
                nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
                top = _mm512_mask_mov_ps(top, higher, v);
                at = _mm512_mask_mov_epi32(at, higher, index);
            }
            has_nan = nan != 0;
            float peak = _mm512_reduce_max_ps(top);
            __mmask16 peaks = _mm512_cmp_ps_mask(top, _mm512_set1_ps(peak), _CMP_EQ_OQ);
            best = _mm512_mask_reduce_min_epi32(peaks, at);
        }
#endif
        if (has_nan) i = 0, best = 0;       /* find the first NaN one value at a time */
        for (; i < cols; i++) {
            float v = row[i], b = row[best];
            if (v > b || (isnan(v) && !isnan(b))) best = i;
        }
        out[r] = best;
    }
}
