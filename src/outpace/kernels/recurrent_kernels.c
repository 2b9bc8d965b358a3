/* The recurrent layers of hybrid models on the CPU, one call a layer (see recurrent_kernels.py).
 *
 *   gated_deltanet  everything a Gated DeltaNet layer does between its two projections, for
 *                   every sequence of a forward: the causal convolution and silu (its history in
 *                   the state cache), l2-normalised q and k, write strength and decay, the gated
 *                   delta rule from each slot's state (a snapshot per token or one final entry,
 *                   replay inputs logged), and each head's gated RMSNorm;
 *   short_conv      LFM2's gated short convolution, c * conv(b * x);
 *   delta_replay    the delta rule over logged inputs (replay mode's commit);
 *   offset_rms_norm Qwen3.5's x / rms(x) * (1 + w), with the residual add before it.
 *
 * A sequence's tokens run in order; sequences, heads and channel blocks are independent pieces
 * of work, each done by one thread in one order, so a token's result never depends on what else
 * the call holds: a verify row's token j gets the bits a decode step of that token gets, and a
 * replayed state the bits of the state the verify forward computed. Activations are float32 or
 * bfloat16 (`bf`); bfloat16 values are rounded where the reference's bfloat16 tensors are
 * (convolution output, silu, write strength, the rule's output, the norm before its weight and
 * after its gate). States and everything between are float32. With AVX-512 the loops over a
 * head's values run 16 at a time with the arithmetic of the scalar code, op for op.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

typedef uint16_t bf16;

#define MAX_DIM 256         /* head sizes dk, dv */
#define MAX_TAPS 16         /* convolution kernel size */
#define CHANNEL_BLOCK 256   /* channels a piece of convolution work */
#define LANES 16            /* partial sums of a sum of squares: one AVX-512 register of floats */
#define BLOCK 8             /* registers of 16 values a pass of the delta rule keeps per sum */
#define MAX_NORM_DIM 16384  /* offset_rms_norm's rows */
/* a call shares its work among threads from this many state values updated (or, for the
 * convolution, inputs times taps): fewer cost less than waking the threads */
#define PARALLEL_MIN_WORK 65536

/* the row table (recurrent_rows.py): one row per sequence of the forward */
enum { ROW_SLOT, ROW_READ, ROW_WRITE, ROW_FRESH, ROW_CONV_START, ROW_OFFSET, ROW_LENGTH, ROW_VERIFY, ROW_COLUMNS };

/* a fresh row's state before its first token, read as any other state */
static const float zero_state[MAX_DIM * MAX_DIM];
/* each thread's copy of the state a verify row's next token reads (delta_token's keep) */
static __thread float head_work[MAX_DIM * MAX_DIM] __attribute__((aligned(64)));

/* ---- values ------------------------------------------------------------------------------ */

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

static inline float rounded(float x, int bf) { return bf ? bf16_to_f32(f32_to_bf16(x)) : x; }

static inline float load_at(const void *p, long i, int bf) {
    return bf ? bf16_to_f32(((const bf16 *)p)[i]) : ((const float *)p)[i];
}

/* exp(x): 2^n e^r with n = rint(x / ln 2), |r| <= ln2/2 (ln 2 in two parts), e^r by its Taylor
 * polynomial to r^7 (relative error below 1e-8) in fused multiply-adds, 2^n built from its bits;
 * x clamped to [-87, 88], where 2^n stays a normal float */
static inline float exp_poly(float x) {
    x = x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x;
    float n = rintf(x * 1.44269504f);
    float r = fmaf(-n, 1.42860677e-6f, fmaf(-n, 0.693145752f, x));
    float p = 1.98412698e-4f;
    p = fmaf(p, r, 1.38888889e-3f);
    p = fmaf(p, r, 8.33333333e-3f);
    p = fmaf(p, r, 4.16666667e-2f);
    p = fmaf(p, r, 1.66666667e-1f);
    p = fmaf(p, r, 0.5f);
    p = fmaf(p, r, 1.0f);
    p = fmaf(p, r, 1.0f);
    union { uint32_t u; float f; } scale;
    scale.u = (uint32_t)((int32_t)n + 127) << 23;
    return p * scale.f;
}

static inline float silu(float x) { return x / (1.0f + exp_poly(-x)); }

static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

#ifdef __AVX512F__
static inline __m512 exp_poly16(__m512 x) {     /* exp_poly on 16 lanes, op for op */
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x));
    __m512 p = _mm512_set1_ps(1.98412698e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.38888889e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.33333333e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.16666667e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.66666667e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

static inline __m512 silu16(__m512 x) {
    return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_poly16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}

static inline __m512 bf16x16_to_f32(const bf16 *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline __m256i f32x16_to_bf16(__m512 v) {     /* f32_to_bf16 on 16 lanes */
    __m512i u = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

static inline __m512 rounded16(__m512 v, int bf) {
    return bf ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(f32x16_to_bf16(v)), 16)) : v;
}
#endif

/* dst[0..n) = src as float32 (src float32 or, with bf, bfloat16) */
static void to_f32(const void *src, long n, int bf, float *dst) {
    if (!bf) {
        memcpy(dst, src, n * sizeof(float));
        return;
    }
    const bf16 *s = src;
    long i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, bf16x16_to_f32(s + i));
#endif
    for (; i < n; i++) dst[i] = bf16_to_f32(s[i]);
}

/* dst[0..n) = src in float32 or, with bf, rounded to bfloat16 */
static void from_f32(const float *src, long n, int bf, void *dst) {
    if (!bf) {
        memcpy(dst, src, n * sizeof(float));
        return;
    }
    bf16 *d = dst;
    long i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16) _mm256_storeu_si256((__m256i *)(d + i), f32x16_to_bf16(_mm512_loadu_ps(src + i)));
#endif
    for (; i < n; i++) d[i] = f32_to_bf16(src[i]);
}

/* x[0..n) rounded to bfloat16's precision in place (with bf; else unchanged) */
static void round_span(float *x, long n, int bf) {
    if (!bf) return;
    long i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, rounded16(_mm512_loadu_ps(x + i), 1));
#endif
    for (; i < n; i++) x[i] = rounded(x[i], 1);
}

static inline float lanes_sum(const float parts[LANES]) {
    float sum = 0.0f;
    for (int l = 0; l < LANES; l++) sum += parts[l];
    return sum;
}

/* sum of x[i]^2, lane i % LANES accumulating its values in order, the lanes then summed in order */
static float sum_squares(const float *x, long n) {
    float parts[LANES] = {0};
    long i = 0;
#ifdef __AVX512F__
    __m512 acc = _mm512_setzero_ps();
    for (; i + LANES <= n; i += LANES) {
        __m512 v = _mm512_loadu_ps(x + i);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    _mm512_storeu_ps(parts, acc);
#endif
    for (; i < n; i++) parts[i % LANES] = fmaf(x[i], x[i], parts[i % LANES]);
    return lanes_sum(parts);
}

/* out = x * rsqrt(sum(x^2) + 1e-6) * scale over n values */
static void l2_normalized(const float *x, float *out, int n, float scale) {
    float inv = 1.0f / sqrtf(sum_squares(x, n) + 1e-6f);
    for (int i = 0; i < n; i++) out[i] = x[i] * inv * scale;
}

/* ---- the causal convolution ------------------------------------------------------------- */

/* One sequence's convolution over channels [c0, c1): in [n, C] float inputs (values of the
 * activation dtype), out [n, C] = sum_i w[i, c] x_{t-K+1+i} (+ bias), through silu with `act`,
 * rounded to the activation dtype (`bf`). w is [K, C]. The K-1 inputs before the first token
 * are history rows conv_start.. (zeros when fresh), in the cache's dtype (`hist_bf`: the
 * model's, which a bfloat16 model's float32 prompt chunk rounds its inputs to). The history
 * keeps, for a verify row, that window and then every input (rows 0 .. K-2+n: the window after
 * token j is rows j+1 .. j+K-1); otherwise the last K-1 inputs (rows 0 .. K-2). */
static void conv_block(const float *in, float *out, long n, long C, long c0, long c1, const float *w,
                       const float *bias, int K, void *hist, int hist_bf, long conv_start, int fresh, int verify, int act,
                       int bf) {
    float window[MAX_TAPS - 1][CHANNEL_BLOCK], acc[CHANNEL_BLOCK];
    long width = c1 - c0, size = hist_bf ? 2 : 4;
    char *h = hist;
    for (int i = 0; i < K - 1; i++) {
        if (fresh) memset(window[i], 0, width * sizeof(float));
        else to_f32(h + ((conv_start + i) * C + c0) * size, width, hist_bf, window[i]);
    }
    for (long t = 0; t < n; t++) {
        memset(acc, 0, width * sizeof(float));
        for (int i = 0; i < K; i++) {
            long at = t + i - (K - 1);          /* input index; < 0: the window */
            const float *x = at < 0 ? window[K - 1 + at] : in + at * C + c0, *wi = w + i * C + c0;
            for (long c = 0; c < width; c++) acc[c] = fmaf(wi[c], x[c], acc[c]);
        }
        float *o = out + t * C + c0;
        long c = 0;
        if (bias)
            for (long j = 0; j < width; j++) acc[j] += bias[c0 + j];
        round_span(acc, width, bf);
#ifdef __AVX512F__
        if (act)
            for (; c + 16 <= width; c += 16) _mm512_storeu_ps(o + c, silu16(_mm512_loadu_ps(acc + c)));
#endif
        for (; c < width; c++) o[c] = act ? silu(acc[c]) : acc[c];
        if (act) round_span(o, width, bf);
    }
    if (verify) {
        for (int i = 0; i < K - 1; i++) from_f32(window[i], width, hist_bf, h + (i * C + c0) * size);
        for (long t = 0; t < n; t++) from_f32(in + t * C + c0, width, hist_bf, h + ((K - 1 + t) * C + c0) * size);
        return;
    }
    for (int i = 0; i < K - 1; i++) {                /* inputs n-K+1+i of (window, inputs) */
        long at = n - (K - 1) + i;
        from_f32(at < 0 ? window[K - 1 + at] : in + at * C + c0, width, hist_bf, h + (i * C + c0) * size);
    }
}

/* The convolution of every row: in, out [T, C] indexed by stream token; hist [slots, K-1+R, C]. */
static void conv_rows(const float *in, float *out, long C, const float *w, const float *bias, int K, void *hist,
                      int hist_bf, long hist_rows, const long *rows, long num_rows, int act, int bf) {
    long blocks = (C + CHANNEL_BLOCK - 1) / CHANNEL_BLOCK, tokens = 0;
    for (long r = 0; r < num_rows; r++) tokens += rows[r * ROW_COLUMNS + ROW_LENGTH];
#pragma omp parallel for collapse(2) if (tokens * C * K >= PARALLEL_MIN_WORK) schedule(static)
    for (long r = 0; r < num_rows; r++) {
        for (long b = 0; b < blocks; b++) {
            const long *row = rows + r * ROW_COLUMNS;
            long offset = row[ROW_OFFSET], c0 = b * CHANNEL_BLOCK, c1 = c0 + CHANNEL_BLOCK < C ? c0 + CHANNEL_BLOCK : C;
            char *slot_hist = (char *)hist + row[ROW_SLOT] * hist_rows * C * (hist_bf ? 2 : 4);
            conv_block(in + offset * C, out + offset * C, row[ROW_LENGTH], C, c0, c1, w, bias, K, slot_hist, hist_bf,
                       row[ROW_CONV_START], (int)row[ROW_FRESH], (int)row[ROW_VERIFY], act, bf);
        }
    }
}

/* ---- the gated delta rule ---------------------------------------------------------------- */

#ifdef __AVX512F__
/* delta_token over columns [c0, c0 + 16 nb) (nb a constant after inlining: the sums stay in
 * registers over the state's rows). With `stream` the state after the token goes to dst past the
 * caches (no read of dst's lines first), and to keep (unless NULL) through them. */
static inline __attribute__((always_inline)) void delta_columns(
        const float *src, float *dst, float *keep, const float *k, const float *delta, float a, const float *q,
        float *o, const float *k_next, float *kv_next, int dk, int dv, int c0, const int nb, const int stream) {
    __m512 d[BLOCK], so[BLOCK], sn[BLOCK], va = _mm512_set1_ps(a);
    for (int b = 0; b < nb; b++) {
        d[b] = _mm512_loadu_ps(delta + c0 + 16 * b);
        so[b] = sn[b] = _mm512_setzero_ps();
    }
    for (int i = 0; i < dk; i++) {
        long at = (long)i * dv + c0;
        __m512 ki = _mm512_set1_ps(k[i]), qi = _mm512_set1_ps(q[i]), ni = _mm512_set1_ps(k_next[i]);
        for (int b = 0; b < nb; b++) {
            __m512 x = _mm512_fmadd_ps(ki, d[b], _mm512_mul_ps(va, _mm512_loadu_ps(src + at + 16 * b)));
            if (stream) {
                _mm512_stream_ps(dst + at + 16 * b, x);
                if (keep) _mm512_storeu_ps(keep + at + 16 * b, x);
            } else {
                _mm512_storeu_ps(dst + at + 16 * b, x);
            }
            so[b] = _mm512_fmadd_ps(qi, x, so[b]);
            sn[b] = _mm512_fmadd_ps(ni, x, sn[b]);
        }
    }
    for (int b = 0; b < nb; b++) {
        _mm512_storeu_ps(o + c0 + 16 * b, so[b]);
        _mm512_storeu_ps(kv_next + c0 + 16 * b, sn[b]);
    }
}
#endif

/* One token on one head: dst = a src + k delta^T with delta = b (v - a src^T k), where kv holds
 * src^T k. o = dst^T q and kv_next = dst^T k_next (the next token's kv, summed as state_dot sums
 * it; q and k_next may be zero_state when not wanted). dst may be src. `stream` (dst 64-byte
 * aligned, dv % 16 == 0, dst not src): dst's lines are written without being read first and
 * leave the caches, and keep (unless NULL) gets a copy that stays in them: the state a row's
 * next token reads. Otherwise keep is unused. */
static void delta_token(const float *src, float *dst, float *keep, const float *k, const float *v, float a, float b,
                        const float *kv, const float *q, float *o, const float *k_next, float *kv_next, int dk, int dv,
                        int stream) {
    float delta[MAX_DIM];
    for (int c = 0; c < dv; c++) delta[c] = b * (v[c] - a * kv[c]);
#ifdef __AVX512F__
    if (dv % 16 == 0) {
        int c0 = 0;
        for (; c0 + 16 * BLOCK <= dv; c0 += 16 * BLOCK) {
            if (stream) delta_columns(src, dst, keep, k, delta, a, q, o, k_next, kv_next, dk, dv, c0, BLOCK, 1);
            else delta_columns(src, dst, NULL, k, delta, a, q, o, k_next, kv_next, dk, dv, c0, BLOCK, 0);
        }
        for (; c0 < dv; c0 += 16) {
            if (stream) delta_columns(src, dst, keep, k, delta, a, q, o, k_next, kv_next, dk, dv, c0, 1, 1);
            else delta_columns(src, dst, NULL, k, delta, a, q, o, k_next, kv_next, dk, dv, c0, 1, 0);
        }
        return;
    }
#endif
    (void)stream;
    (void)keep;
    memset(o, 0, dv * sizeof(float));
    memset(kv_next, 0, dv * sizeof(float));
    for (int i = 0; i < dk; i++) {
        const float *p = src + (long)i * dv;
        float *s = dst + (long)i * dv;
        for (int c = 0; c < dv; c++) {
            float x = fmaf(k[i], delta[c], a * p[c]);
            s[c] = x;
            o[c] = fmaf(q[i], x, o[c]);
            kv_next[c] = fmaf(k_next[i], x, kv_next[c]);
        }
    }
}

/* kv = state^T k, summed in delta_token's order */
static void state_dot(const float *state, const float *k, float *kv, int dk, int dv) {
    memset(kv, 0, dv * sizeof(float));
    for (int i = 0; i < dk; i++) {
        const float *s = state + (long)i * dv;
        for (int c = 0; c < dv; c++) kv[c] = fmaf(k[i], s[c], kv[c]);
    }
}

/* The gated RMSNorm of one head's output o [dv] (rounded to the activation dtype first, as the
 * reference's output is): normalised and rounded, scaled by w and rounded, gated by silu(z) in
 * float32, rounded into out */
static void gated_norm(float *o, const float *z, const float *w, float eps, int dv, int bf, float *out) {
    round_span(o, dv, bf);
    float inv = 1.0f / sqrtf(sum_squares(o, dv) / (float)dv + eps);
    int c = 0;
#ifdef __AVX512F__
    for (; c + 16 <= dv; c += 16) {
        __m512 normed = rounded16(_mm512_mul_ps(rounded16(_mm512_mul_ps(_mm512_loadu_ps(o + c), _mm512_set1_ps(inv)), bf),
                                                _mm512_loadu_ps(w + c)), bf);
        _mm512_storeu_ps(out + c, _mm512_mul_ps(normed, silu16(_mm512_loadu_ps(z + c))));
    }
#endif
    for (; c < dv; c++) out[c] = rounded(rounded(o[c] * inv, bf) * w[c], bf) * silu(z[c]);
}

/* A Gated DeltaNet layer's work between its projections for every row (see the top of the file).
 *
 * proj [T, proj_stride]: each token's in_proj output, [q k v | z | b | a] (q, k: Hk heads of dk;
 * v, z: H heads of dv; b, a: H). conv_w [K, C] float32 (C = 2 Hk dk + H dv), hist [slots,
 * hist_rows, C] in the model's dtype (hist_bf). state [slots, E, H, dk, dv] float32: a row reads
 * entry ROW_READ (zeros when fresh) and writes the state after its token j into entry
 * (read + 1 + j) % E when ROW_WRITE < 0 (snapshots), else after every token into entry ROW_WRITE.
 * log_k [slots, R, Hk, dk], log_v [slots, R, H, dv], log_g, log_b [slots, R, H] float32 (NULL:
 * none): verify rows' inputs of the rule, for delta_replay. neg_a [H] = -exp(A_log), dt_bias [H],
 * norm_w [dv] float32. out [T, H dv] in the activation dtype. Returns -1 when out of memory, -2
 * for sizes beyond the limits. */
int gated_deltanet(const void *proj, long proj_stride, int bf, const float *conv_w, int K, void *hist, int hist_bf,
                   long hist_rows, float *state, long E, float *log_k, float *log_v, float *log_g, float *log_b, long R,
                   const float *neg_a, const float *dt_bias, const float *norm_w, float eps, const long *rows,
                   long num_rows, long T, int Hk, int dk, int H, int dv, void *out) {
    if (dk > MAX_DIM || dv > MAX_DIM || K > MAX_TAPS || K < 1 || H % Hk) return -2;
    long keys = (long)Hk * dk, C = 2 * keys + (long)H * dv;        /* mixed: [q k v] */
    long z_at = C, b_at = C + (long)H * dv, a_at = b_at + H;
    float *in = malloc(sizeof(float) * T * C), *mixed = malloc(sizeof(float) * T * C);
    if (!in || !mixed) {
        free(in);
        free(mixed);
        return -1;
    }
    long tokens = 0, row_size = bf ? 2 : 4;
    for (long r = 0; r < num_rows; r++) {
        const long *row = rows + r * ROW_COLUMNS;
        tokens += row[ROW_LENGTH];
        for (long t = row[ROW_OFFSET]; t < row[ROW_OFFSET] + row[ROW_LENGTH]; t++)
            to_f32((const char *)proj + t * proj_stride * row_size, C, bf, in + t * C);
    }
    conv_rows(in, mixed, C, conv_w, NULL, K, hist, hist_bf, hist_rows, rows, num_rows, 1, bf);
    long head_size = (long)dk * dv, group = H / Hk;
    float scale = 1.0f / sqrtf((float)dk);
#ifdef __AVX512F__
    int streams = ((uintptr_t)state & 63) == 0 && dv % 16 == 0;
#else
    int streams = 0;        /* streamed states and their kept copies are delta_token's AVX-512 path */
#endif
#pragma omp parallel for collapse(2) if (tokens * H * head_size >= PARALLEL_MIN_WORK) schedule(static)
    for (long r = 0; r < num_rows; r++) {
        for (int h = 0; h < H; h++) {
            const long *row = rows + r * ROW_COLUMNS;
            long slot = row[ROW_SLOT], read = row[ROW_READ], write = row[ROW_WRITE], offset = row[ROW_OFFSET];
            long n = row[ROW_LENGTH];
            int hk = h / group;
            float *slot_state = state + slot * E * H * head_size + h * head_size;
            const float *src = row[ROW_FRESH] ? zero_state : slot_state + read * H * head_size;
            float q[MAX_DIM], k[MAX_DIM], k_next[MAX_DIM], kv[MAX_DIM], kv_next[MAX_DIM], o[MAX_DIM];
            float z[MAX_DIM], normed[MAX_DIM];
            float *work = streams ? head_work : NULL;
            l2_normalized(mixed + offset * C + keys + hk * dk, k, dk, 1.0f);
            state_dot(src, k, kv, dk, dv);
            for (long j = 0; j < n; j++) {
                long t = offset + j;
                const char *p = (const char *)proj + t * proj_stride * row_size;
                const float *v = mixed + t * C + 2 * keys + (long)h * dv;
                l2_normalized(mixed + t * C + hk * dk, q, dk, scale);
                float b = rounded(1.0f / (1.0f + expf(-load_at(p, b_at + h, bf))), bf);
                float g = neg_a[h] * softplus(load_at(p, a_at + h, bf) + dt_bias[h]);
                long entry = write < 0 ? (read + 1 + j) % E : write;
                float *dst = slot_state + entry * H * head_size;
                const float *following = zero_state;
                if (j + 1 < n) {
                    l2_normalized(mixed + (t + 1) * C + keys + hk * dk, k_next, dk, 1.0f);
                    following = k_next;
                }
                /* A verify row's states are read again next step at the earliest (one of them),
                 * after a whole step's weights have passed through the caches: they stream past
                 * them, the row's next token reading a copy kept in them. Where only the last
                 * state is kept (ROW_WRITE), the others stay in that copy alone. */
                int stream = streams && dst != src;
                float *keep = NULL;
                if (stream && j + 1 < n) {
                    if (write < 0) keep = work;
                    else dst = work, stream = 0;
                }
                delta_token(src, dst, keep, k, v, expf(g), b, kv, q, o, following, kv_next, dk, dv, stream);
                if (log_k && row[ROW_VERIFY]) {
                    long at = slot * R + j;
                    if (h % group == 0) memcpy(log_k + (at * Hk + hk) * dk, k, dk * sizeof(float));
                    memcpy(log_v + (at * H + h) * dv, v, dv * sizeof(float));
                    log_g[at * H + h] = g;
                    log_b[at * H + h] = b;
                }
                to_f32(p + (z_at + (long)h * dv) * row_size, dv, bf, z);
                gated_norm(o, z, norm_w, eps, dv, bf, normed);
                from_f32(normed, dv, bf, (char *)out + (t * H * dv + (long)h * dv) * row_size);
                src = keep ? keep : dst;
                memcpy(k, k_next, dk * sizeof(float));
                memcpy(kv, kv_next, dv * sizeof(float));
            }
#ifdef __AVX512F__
            _mm_sfence();           /* the streamed states are in memory before the call returns */
#endif
        }
    }
    free(in);
    free(mixed);
    return 0;
}

/* Replay mode's commit: for each row [slot, read, write, fresh, count], the rule over the logged
 * inputs of tokens 0 .. count-1 from entry `read` (zeros when fresh) into entry `write`, with the
 * arithmetic gated_deltanet used, so the state is the one it computed after token count-1. */
void delta_replay(float *state, long E, const float *log_k, const float *log_v, const float *log_g,
                  const float *log_b, long R, const long *rows, long num_rows, int Hk, int dk, int H, int dv) {
    long head_size = (long)dk * dv, group = H / Hk, work = 0;
    for (long r = 0; r < num_rows; r++) work += rows[r * 5 + 4];
#pragma omp parallel for collapse(2) if (work * H * head_size >= PARALLEL_MIN_WORK) schedule(static)
    for (long r = 0; r < num_rows; r++) {
        for (int h = 0; h < H; h++) {
            const long *row = rows + r * 5;
            long slot = row[0], n = row[4];
            float *slot_state = state + slot * E * H * head_size + h * head_size;
            const float *src = row[3] ? zero_state : slot_state + row[1] * H * head_size;
            float *dst = slot_state + row[2] * H * head_size;
            float kv[MAX_DIM], kv_next[MAX_DIM], o[MAX_DIM];
            state_dot(src, log_k + (slot * R * Hk + h / group) * dk, kv, dk, dv);
            for (long j = 0; j < n; j++) {
                long at = slot * R + j;
                const float *k_next = j + 1 < n ? log_k + ((at + 1) * Hk + h / group) * dk : zero_state;
                delta_token(src, dst, NULL, log_k + (at * Hk + h / group) * dk, log_v + (at * H + h) * dv,
                            expf(log_g[at * H + h]), log_b[at * H + h], kv, zero_state, o, k_next, kv_next, dk, dv, 0);
                src = dst;
                memcpy(kv, kv_next, dv * sizeof(float));
            }
        }
    }
}

/* ---- LFM2's short convolution and Qwen3.5's norm ------------------------------------------ */

/* out [T, C] = c * conv(b * x) from proj [T, 3C] = [b | c | x] per token, each product rounded
 * to the activation dtype; conv_w [K, C] and bias [C] (or NULL) float32, hist as in
 * gated_deltanet (it keeps b * x). Returns -1 when out of memory, -2 for K beyond the limit. */
int short_conv(const void *proj, int bf, const float *conv_w, const float *bias, int K, void *hist, int hist_bf,
               long hist_rows, const long *rows, long num_rows, long T, long C, void *out) {
    if (K > MAX_TAPS || K < 1) return -2;
    float *bcx = malloc(sizeof(float) * T * 3 * C), *mixed = malloc(sizeof(float) * T * C);
    float *in = malloc(sizeof(float) * T * C);
    if (!bcx || !mixed || !in) {
        free(bcx);
        free(mixed);
        free(in);
        return -1;
    }
    long row_size = bf ? 2 : 4;
    for (long r = 0; r < num_rows; r++) {
        const long *row = rows + r * ROW_COLUMNS;
        for (long t = row[ROW_OFFSET]; t < row[ROW_OFFSET] + row[ROW_LENGTH]; t++) {
            float *x = bcx + t * 3 * C;
            to_f32((const char *)proj + t * 3 * C * row_size, 3 * C, bf, x);
            for (long c = 0; c < C; c++) in[t * C + c] = x[c] * x[2 * C + c];
            round_span(in + t * C, C, bf);
        }
    }
    conv_rows(in, mixed, C, conv_w, bias, K, hist, hist_bf, hist_rows, rows, num_rows, 0, bf);
    for (long r = 0; r < num_rows; r++) {
        const long *row = rows + r * ROW_COLUMNS;
        for (long t = row[ROW_OFFSET]; t < row[ROW_OFFSET] + row[ROW_LENGTH]; t++) {
            for (long c = 0; c < C; c++) in[t * C + c] = bcx[t * 3 * C + C + c] * mixed[t * C + c];
            from_f32(in + t * C, C, bf, (char *)out + t * C * row_size);
        }
    }
    free(bcx);
    free(mixed);
    free(in);
    return 0;
}

/* h_out = h + delta (delta NULL: h_out unused); x_out = rms_norm(h_out) * w1, computed in float32
 * and rounded once (w1 = 1 + w in float32), over rows of dim values. Returns -2 for dim beyond
 * MAX_NORM_DIM. */
int offset_rms_norm(const void *h, const void *delta, const float *w1, void *h_out, void *x_out, long num_rows,
                    long dim, float eps, int bf) {
    if (dim > MAX_NORM_DIM) return -2;
    long size = bf ? 2 : 4;
#pragma omp parallel for if (num_rows * dim >= PARALLEL_MIN_WORK) schedule(static)
    for (long r = 0; r < num_rows; r++) {
        float x[MAX_NORM_DIM], d[MAX_NORM_DIM];
        to_f32((const char *)h + r * dim * size, dim, bf, x);
        if (delta) {
            to_f32((const char *)delta + r * dim * size, dim, bf, d);
            for (long i = 0; i < dim; i++) x[i] += d[i];
            round_span(x, dim, bf);
            from_f32(x, dim, bf, (char *)h_out + r * dim * size);
        }
        float inv = 1.0f / sqrtf(sum_squares(x, dim) / (float)dim + eps);
        for (long i = 0; i < dim; i++) d[i] = x[i] * inv * w1[i];
        from_f32(d, dim, bf, (char *)x_out + r * dim * size);
    }
    return 0;
}
