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
 * after its gate). States and everything between are float32.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef uint16_t bf16;

#define MAX_DIM 256         /* head sizes dk, dv */
#define MAX_TAPS 16         /* convolution kernel size */
#define CHANNEL_BLOCK 256   /* channels a piece of convolution work */
#define LANES 16            /* partial sums of a sum of squares: one AVX-512 register of floats */
/* a call shares its work among threads from this many state values updated (or, for the
 * convolution, inputs times taps): fewer cost less than waking the threads */
#define PARALLEL_MIN_WORK 65536

/* the row table (recurrent_rows.py): one row per sequence of the forward */
enum { ROW_SLOT, ROW_READ, ROW_WRITE, ROW_FRESH, ROW_CONV_START, ROW_OFFSET, ROW_LENGTH, ROW_VERIFY, ROW_COLUMNS };

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

static inline float load(const void *p, long i, int bf) {
    return bf ? bf16_to_f32(((const bf16 *)p)[i]) : ((const float *)p)[i];
}

static inline void store(void *p, long i, float x, int bf) {
    if (bf) ((bf16 *)p)[i] = f32_to_bf16(x);
    else ((float *)p)[i] = x;
}

static inline float rounded(float x, int bf) { return bf ? bf16_to_f32(f32_to_bf16(x)) : x; }

static inline float lanes_sum(const float parts[LANES]) {
    float sum = 0.0f;
    for (int l = 0; l < LANES; l++) sum += parts[l];
    return sum;
}

/* sum of x[i]^2 in LANES partial sums (vectorised; i % LANES picks the lane) */
static inline float sum_squares(const float *x, long n) {
    float parts[LANES] = {0};
    long i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) parts[l] = fmaf(x[i + l], x[i + l], parts[l]);
    for (; i < n; i++) parts[i % LANES] = fmaf(x[i], x[i], parts[i % LANES]);
    return lanes_sum(parts);
}

static inline float silu(float x) { return x / (1.0f + expf(-x)); }

/* ---- the causal convolution ------------------------------------------------------------- */

/* One sequence's convolution over channels [c0, c1): in [n, C] float inputs (values of the
 * activation dtype), out [n, C] = sum_i w[c, i] x_{t-K+1+i} (+ bias), through silu with `act`,
 * rounded to the activation dtype (`bf`). The K-1 inputs before the first token are history rows
 * conv_start.. (zeros when fresh), in the cache's dtype (`hist_bf`: the model's, which a
 * bfloat16 model's float32 prompt chunk rounds its inputs to). The history keeps, for a verify row, that window and then
 * every input (rows 0 .. K-2+n: the window after token j is rows j+1 .. j+K-1); otherwise the
 * last K-1 inputs (rows 0 .. K-2). */
static void conv_block(const float *in, float *out, long n, long C, long c0, long c1, const float *w,
                       const float *bias, int K, void *hist, int hist_bf, long conv_start, int fresh, int verify, int act,
                       int bf) {
    float window[MAX_TAPS - 1][CHANNEL_BLOCK];
    long width = c1 - c0;
    for (int i = 0; i < K - 1; i++)
        for (long c = 0; c < width; c++)
            window[i][c] = fresh ? 0.0f : load(hist, (conv_start + i) * C + c0 + c, hist_bf);
    for (long t = 0; t < n; t++) {
        for (long c = c0; c < c1; c++) {
            const float *wc = w + c * K;
            float acc = 0.0f;
            for (int i = 0; i < K; i++) {
                long at = t + i - (K - 1);          /* input index; < 0: the window */
                float x = at < 0 ? window[K - 1 + at][c - c0] : in[at * C + c];
                acc = fmaf(wc[i], x, acc);
            }
            if (bias) acc += bias[c];
            acc = rounded(acc, bf);
            out[t * C + c] = act ? rounded(silu(acc), bf) : acc;
        }
    }
    if (verify) {
        for (int i = 0; i < K - 1; i++)
            for (long c = 0; c < width; c++) store(hist, i * C + c0 + c, window[i][c], hist_bf);
        for (long t = 0; t < n; t++)
            for (long c = c0; c < c1; c++) store(hist, (K - 1 + t) * C + c, in[t * C + c], hist_bf);
        return;
    }
    for (int i = 0; i < K - 1; i++) {                /* inputs n-K+1+i of (window, inputs) */
        long at = n - (K - 1) + i;
        for (long c = 0; c < width; c++)
            store(hist, i * C + c0 + c, at < 0 ? window[K - 1 + at][c] : in[at * C + c0 + c], hist_bf);
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

/* One token on one head: dst = a src + k delta^T with delta = b (v - a src^T k), where kv holds
 * src^T k (src NULL: a zero state). o = dst^T q when q; kv_next = dst^T k_next when k_next (the
 * next token's kv, summed as a pass over dst would sum it). dst may be src. */
static void delta_token(const float *src, float *dst, const float *k, const float *v, float a, float b,
                        const float *kv, const float *q, float *o, const float *k_next, float *kv_next, int dk, int dv) {
    float delta[MAX_DIM];
    for (int c = 0; c < dv; c++) delta[c] = b * (v[c] - a * kv[c]);
    if (q) memset(o, 0, dv * sizeof(float));
    if (k_next) memset(kv_next, 0, dv * sizeof(float));
    for (int i = 0; i < dk; i++) {
        float *s = dst + (long)i * dv, ki = k[i];
        if (src) {
            const float *p = src + (long)i * dv;
            for (int c = 0; c < dv; c++) s[c] = fmaf(ki, delta[c], a * p[c]);
        } else {
            for (int c = 0; c < dv; c++) s[c] = ki * delta[c];
        }
        if (q) {
            float qi = q[i];
            for (int c = 0; c < dv; c++) o[c] = fmaf(qi, s[c], o[c]);
        }
        if (k_next) {
            float ni = k_next[i];
            for (int c = 0; c < dv; c++) kv_next[c] = fmaf(ni, s[c], kv_next[c]);
        }
    }
}

/* kv = state^T k (state NULL: zeros), summed in delta_token's order */
static void state_dot(const float *state, const float *k, float *kv, int dk, int dv) {
    memset(kv, 0, dv * sizeof(float));
    if (!state) return;
    for (int i = 0; i < dk; i++) {
        const float *s = state + (long)i * dv;
        for (int c = 0; c < dv; c++) kv[c] = fmaf(k[i], s[c], kv[c]);
    }
}

/* x * rsqrt(sum(x^2) + 1e-6) * scale over n values */
static void l2_normalized(const float *x, float *out, int n, float scale) {
    float inv = 1.0f / sqrtf(sum_squares(x, n) + 1e-6f);
    for (int i = 0; i < n; i++) out[i] = x[i] * inv * scale;
}

static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* A Gated DeltaNet layer's work between its projections for every row (see the top of the file).
 *
 * proj [T, proj_stride]: each token's in_proj output, [q k v | z | b | a] (q, k: Hk heads of dk;
 * v, z: H heads of dv; b, a: H). conv_w [C, K] float32 (C = 2 Hk dk + H dv), hist [slots,
 * hist_rows, C] in the model's dtype (hist_bf). state [slots, E, H, dk, dv] float32: a row reads entry
 * ROW_READ (zeros when fresh) and writes the state after its token j into entry (read + 1 + j) % E
 * when ROW_WRITE < 0 (snapshots), else after every token into entry ROW_WRITE. log_k [slots, R,
 * Hk, dk], log_v [slots, R, H, dv], log_g, log_b [slots, R, H] float32 (NULL: none): verify
 * rows' inputs of the rule, for delta_replay. neg_a [H] = -exp(A_log), dt_bias [H], norm_w [dv]
 * float32. out [T, H dv] in the activation dtype. Returns -1 when out of memory, -2 for sizes
 * beyond the limits. */
int gated_deltanet(const void *proj, long proj_stride, int bf, const float *conv_w, int K, void *hist, int hist_bf,
                   long hist_rows,
                   float *state, long E, float *log_k, float *log_v, float *log_g, float *log_b, long R,
                   const float *neg_a, const float *dt_bias, const float *norm_w, float eps, const long *rows,
                   long num_rows, long T, int Hk, int dk, int H, int dv, void *out) {
    if (dk > MAX_DIM || dv > MAX_DIM || K > MAX_TAPS || K < 1 || H % Hk) return -2;
    long C = 2L * Hk * dk + (long)H * dv, z_at = C, b_at = C + (long)H * dv, a_at = b_at + H;
    float *in = malloc(sizeof(float) * T * C), *mixed = malloc(sizeof(float) * T * C);
    if (!in || !mixed) {
        free(in);
        free(mixed);
        return -1;
    }
    long work = 0;
    for (long r = 0; r < num_rows; r++) work += rows[r * ROW_COLUMNS + ROW_LENGTH];
    for (long r = 0; r < num_rows; r++) {
        const long *row = rows + r * ROW_COLUMNS;
        for (long t = row[ROW_OFFSET]; t < row[ROW_OFFSET] + row[ROW_LENGTH]; t++)
            for (long c = 0; c < C; c++) in[t * C + c] = load(proj, t * proj_stride + c, bf);
    }
    conv_rows(in, mixed, C, conv_w, NULL, K, hist, hist_bf, hist_rows, rows, num_rows, 1, bf);
    long head_size = (long)dk * dv, group = H / Hk, keys = (long)Hk * dk;     /* mixed: [q k v] */
    float scale = 1.0f / sqrtf((float)dk);
#pragma omp parallel for collapse(2) if (work * H * head_size >= PARALLEL_MIN_WORK) schedule(static)
    for (long r = 0; r < num_rows; r++) {
        for (int h = 0; h < H; h++) {
            const long *row = rows + r * ROW_COLUMNS;
            long slot = row[ROW_SLOT], read = row[ROW_READ], write = row[ROW_WRITE], offset = row[ROW_OFFSET];
            long n = row[ROW_LENGTH];
            int hk = h / group;
            float *slot_state = state + slot * E * H * head_size + h * head_size;
            const float *src = row[ROW_FRESH] ? NULL : slot_state + read * H * head_size;
            float q[MAX_DIM], k[MAX_DIM], k_next[MAX_DIM], kv[MAX_DIM], kv_next[MAX_DIM], o[MAX_DIM];
            l2_normalized(mixed + offset * C + keys + hk * dk, k, dk, 1.0f);
            state_dot(src, k, kv, dk, dv);
            for (long j = 0; j < n; j++) {
                long t = offset + j;
                const float *m = mixed + t * C;
                const float *v = m + 2 * keys + (long)h * dv;
                l2_normalized(m + hk * dk, q, dk, scale);
                float b = rounded(1.0f / (1.0f + expf(-load(proj, t * proj_stride + b_at + h, bf))), bf);
                float g = neg_a[h] * softplus(load(proj, t * proj_stride + a_at + h, bf) + dt_bias[h]);
                long entry = write < 0 ? (read + 1 + j) % E : write;
                float *dst = slot_state + entry * H * head_size;
                if (j + 1 < n) l2_normalized(mixed + (t + 1) * C + keys + hk * dk, k_next, dk, 1.0f);
                delta_token(src, dst, k, v, expf(g), b, kv, q, o, j + 1 < n ? k_next : NULL, kv_next, dk, dv);
                if (log_k && row[ROW_VERIFY]) {
                    long at = slot * R + j;
                    if (h % group == 0) memcpy(log_k + (at * Hk + hk) * dk, k, dk * sizeof(float));
                    memcpy(log_v + (at * H + h) * dv, v, dv * sizeof(float));
                    log_g[at * H + h] = g;
                    log_b[at * H + h] = b;
                }
                /* the gated RMSNorm: normalised and rounded, scaled by the weight and rounded, gated
                 * by silu(z) in float32 */
                for (int c = 0; c < dv; c++) o[c] = rounded(o[c], bf);
                float inv = 1.0f / sqrtf(sum_squares(o, dv) / (float)dv + eps);
                for (int c = 0; c < dv; c++) {
                    float normed = rounded(rounded(o[c] * inv, bf) * norm_w[c], bf);
                    float z = load(proj, t * proj_stride + z_at + (long)h * dv + c, bf);
                    store(out, t * H * dv + (long)h * dv + c, normed * silu(z), bf);
                }
                src = dst;
                if (j + 1 < n) {
                    memcpy(k, k_next, dk * sizeof(float));
                    memcpy(kv, kv_next, dv * sizeof(float));
                }
            }
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
            const float *src = row[3] ? NULL : slot_state + row[1] * H * head_size;
            float *dst = slot_state + row[2] * H * head_size;
            float kv[MAX_DIM], kv_next[MAX_DIM];
            const float *k = log_k + (slot * R * Hk + h / group) * dk;
            state_dot(src, k, kv, dk, dv);
            for (long j = 0; j < n; j++) {
                long at = slot * R + j;
                const float *k_next = j + 1 < n ? log_k + ((at + 1) * Hk + h / group) * dk : NULL;
                delta_token(src, dst, log_k + (at * Hk + h / group) * dk, log_v + (at * H + h) * dv,
                            expf(log_g[at * H + h]), log_b[at * H + h], kv, NULL, NULL, k_next, kv_next, dk, dv);
                src = dst;
                memcpy(kv, kv_next, dv * sizeof(float));
            }
        }
    }
}

/* ---- LFM2's short convolution and Qwen3.5's norm ------------------------------------------ */

/* out [T, C] = c * conv(b * x) from proj [T, 3C] = [b | c | x] per token, each product rounded
 * to the activation dtype; conv_w [C, K] and bias [C] (or NULL) float32, hist as in
 * gated_deltanet (it keeps b * x). Returns -1 when out of memory, -2 for K beyond the limit. */
int short_conv(const void *proj, int bf, const float *conv_w, const float *bias, int K, void *hist, int hist_bf,
               long hist_rows,
               const long *rows, long num_rows, long T, long C, void *out) {
    if (K > MAX_TAPS || K < 1) return -2;
    float *in = malloc(sizeof(float) * T * C), *mixed = malloc(sizeof(float) * T * C);
    if (!in || !mixed) {
        free(in);
        free(mixed);
        return -1;
    }
    for (long r = 0; r < num_rows; r++) {
        const long *row = rows + r * ROW_COLUMNS;
        for (long t = row[ROW_OFFSET]; t < row[ROW_OFFSET] + row[ROW_LENGTH]; t++)
            for (long c = 0; c < C; c++)
                in[t * C + c] = rounded(load(proj, t * 3 * C + c, bf) * load(proj, t * 3 * C + 2 * C + c, bf), bf);
    }
    conv_rows(in, mixed, C, conv_w, bias, K, hist, hist_bf, hist_rows, rows, num_rows, 0, bf);
    for (long r = 0; r < num_rows; r++) {
        const long *row = rows + r * ROW_COLUMNS;
        for (long t = row[ROW_OFFSET]; t < row[ROW_OFFSET] + row[ROW_LENGTH]; t++)
            for (long c = 0; c < C; c++) store(out, t * C + c, load(proj, t * 3 * C + C + c, bf) * mixed[t * C + c], bf);
    }
    free(in);
    free(mixed);
    return 0;
}

/* h_out = h + delta (delta NULL: h_out unused); x_out = rms_norm(h_out) * w1, computed in float32
 * and rounded once (w1 = 1 + w in float32), over rows of dim values */
void offset_rms_norm(const void *h, const void *delta, const float *w1, void *h_out, void *x_out, long num_rows,
                     long dim, float eps, int bf) {
#pragma omp parallel for if (num_rows * dim >= PARALLEL_MIN_WORK) schedule(static)
    for (long r = 0; r < num_rows; r++) {
        const void *x = h;
        if (delta) {
            for (long i = 0; i < dim; i++)
                store(h_out, r * dim + i, load(h, r * dim + i, bf) + load(delta, r * dim + i, bf), bf);
            x = h_out;
        }
        float parts[LANES] = {0};
        for (long i = 0; i < dim; i++) {
            float v = load(x, r * dim + i, bf);
            parts[i % LANES] = fmaf(v, v, parts[i % LANES]);
        }
        float inv = 1.0f / sqrtf(lanes_sum(parts) / (float)dim + eps);
        for (long i = 0; i < dim; i++) store(x_out, r * dim + i, load(x, r * dim + i, bf) * inv * w1[i], bf);
    }
}
