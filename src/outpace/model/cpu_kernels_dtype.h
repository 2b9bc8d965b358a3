/* cpu_kernels.c's kernels for one activation dtype T: NAME(f) names them, LOAD and STORE convert
 * one value to and from float32, ROUND rounds a float32 result as an op of dtype T does, LOAD16
 * (AVX-512 only) loads 16 values as floats. */

/* h_out = h + delta (delta may be NULL: h_out is h); x_out = rms_norm(h_out) * weight:
 * normalised in float32, rounded to the dtype, then scaled (the reference's order) */
void NAME(add_rms_norm)(const T *h, const T *delta, const T *weight, T *h_out, T *x_out, long rows, long dim,
                        float eps) {
    for (long r = 0; r < rows; r++) {
        const T *hr = h + r * dim;
        T *xo = x_out + r * dim;
        if (delta) {
            T *ho = h_out + r * dim;
            const T *dr = delta + r * dim;
            for (long i = 0; i < dim; i++) ho[i] = STORE(LOAD(hr[i]) + LOAD(dr[i]));
            hr = ho;
        }
        float parts[LANES] = {0};
        long i = 0;
        for (; i + LANES <= dim; i += LANES) {
            for (int l = 0; l < LANES; l++) parts[l] += LOAD(hr[i + l]) * LOAD(hr[i + l]);
        }
        for (; i < dim; i++) parts[i % LANES] += LOAD(hr[i]) * LOAD(hr[i]);
        float inv = 1.0f / sqrtf(lanes_sum(parts) / (float)dim + eps);
        for (i = 0; i < dim; i++) xo[i] = STORE(ROUND(LOAD(hr[i]) * inv) * LOAD(weight[i]));
    }
}

/* out [rows, inter] = silu(gate) * up from gate_up [rows, 2 * inter] */
void NAME(silu_mul)(const T *gate_up, T *out, long rows, long inter) {
    for (long r = 0; r < rows; r++) {
        const T *g = gate_up + r * 2 * inter, *u = g + inter;
        T *o = out + r * inter;
        for (long i = 0; i < inter; i++) {
            float x = LOAD(g[i]);
            o[i] = STORE(ROUND(x / (1.0f + exp_f32(-x))) * LOAD(u[i]));
        }
    }
}

/* One rotary rotation into float32: x * cos + roll(x, D/2) * signed_sin, each op rounded as
 * PyTorch's ops of dtype T round */
static inline void NAME(rotate)(const T *x, const T *cos, const T *sin, long D, float *out) {
    long half = D / 2;
    for (long i = 0; i < D; i++) {
        float a = ROUND(LOAD(x[i]) * LOAD(cos[i]));
        float b = ROUND(LOAD(x[(i + half) % D]) * LOAD(sin[i]));
        out[i] = ROUND(a + b);
    }
}

/* q . k over D values */
static inline float NAME(dot)(const float *q, const T *k, long D) {
    long i = 0;
    float total = 0.0f;
#ifdef LOAD16
    __m512 sum = _mm512_setzero_ps();
    for (; i + 16 <= D; i += 16) sum = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), LOAD16(k + i), sum);
    total = _mm512_reduce_add_ps(sum);
#endif
    if (i == D) return total;
    float parts[LANES] = {0};
    for (; i + LANES <= D; i += LANES) {
        for (int l = 0; l < LANES; l++) parts[l] += q[i + l] * LOAD(k[i + l]);
    }
    for (; i < D; i++) parts[i % LANES] += q[i] * LOAD(k[i]);
    return total + lanes_sum(parts);
}

/* acc [D] = sum over j < n of p[j] * values[j * D ..] */
static inline void NAME(weighted_sum)(float *acc, const float *p, const T *values, long n, long D) {
    long i = 0;
#ifdef LOAD16
    for (; i + 64 <= D; i += 64) {      /* four registers of sums held across the keys */
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (long j = 0; j < n; j++) {
            const T *v = values + j * D + i;
            __m512 w = _mm512_set1_ps(p[j]);
            a0 = _mm512_fmadd_ps(w, LOAD16(v), a0);
            a1 = _mm512_fmadd_ps(w, LOAD16(v + 16), a1);
            a2 = _mm512_fmadd_ps(w, LOAD16(v + 32), a2);
            a3 = _mm512_fmadd_ps(w, LOAD16(v + 48), a3);
        }
        _mm512_storeu_ps(acc + i, a0);
        _mm512_storeu_ps(acc + i + 16, a1);
        _mm512_storeu_ps(acc + i + 32, a2);
        _mm512_storeu_ps(acc + i + 48, a3);
    }
#endif
    for (long k = i; k < D; k++) acc[k] = 0.0f;
    for (long j = 0; j < n && i < D; j++) {
        for (long k = i; k < D; k++) acc[k] += p[j] * LOAD(values[j * D + k]);
    }
}

/* Attention of one token's `group` query heads (unrotated, at q_heads) over one key/value head's
 * cache (keys, values: position 0 of [L, D]), keys at positions <= pos (and > pos - window when
 * window > 0); scratch: [group, pos + 1] scores then [group, D] queries and [group, D] sums. */
static void NAME(attend_group)(const T *q_heads, const T *cos, const T *sin, const T *keys, const T *values,
                               long pos, long window, long group, long D, float scale, float *scratch, T *out) {
    long first = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0, n = pos + 1 - first;
    float *scores = scratch, *q = scratch + group * (pos + 1), *acc = q + group * D;
    float top[MAX_GROUP], total[MAX_GROUP];
    keys += first * D;
    values += first * D;
    for (long r = 0; r < group; r++) {
        NAME(rotate)(q_heads + r * D, cos, sin, D, q + r * D);
        top[r] = -INFINITY;
        total[r] = 0.0f;
    }
    for (long j = 0; j < n; j++) {
        for (long r = 0; r < group; r++) {
            float s = NAME(dot)(q + r * D, keys + j * D, D) * scale;
            scores[r * n + j] = s;
            top[r] = s > top[r] ? s : top[r];
        }
    }
    for (long r = 0; r < group; r++) {
        float *p = scores + r * n;
        for (long j = 0; j < n; j++) p[j] = exp_f32(p[j] - top[r]);
        for (long j = 0; j < n; j++) total[r] += p[j];
    }
    for (long r = 0; r < group; r++) NAME(weighted_sum)(acc + r * D, scores + r * n, values, n, D);
    for (long r = 0; r < group; r++) {
        for (long i = 0; i < D; i++) out[r * D + i] = STORE(acc[r * D + i] / total[r]);
    }
}

/* Rotates the T tokens' queries and keys (cos, sin: token t's rows at t * D, the sin signed as
 * rope_tables makes it), writes keys and values into the caches [slots, KVH, L, D] at (slot,
 * position), then attends: each token's query heads over its slot's keys at positions <= its
 * own (and > position - window when window > 0), a key/value head serving NH / KVH query heads,
 * which read each of its keys together. qk: token t's NH query heads then KVH key heads at
 * qk + t * qk_stride; v: its KVH value heads at v + t * v_stride; its slot is slots[t / slot_div].
 * Every token is written before any attends, so a row's later tokens see its earlier ones.
 * Token and key/value head pairs are shared among OpenMP threads (built with OpenMP) when the
 * keys read add up to PARALLEL_MIN_KEYS. out [T, NH * D]. Returns 0, -1 when memory for the
 * scores ran out, -2 for unsupported sizes. */
int NAME(rope_attend)(const T *qk, long qk_stride, const T *v, long v_stride, const T *cos, const T *sin,
                      T *k_cache, T *v_cache, const int64_t *slots, long slot_div, const int64_t *positions,
                      long tokens, long NH, long KVH, long D, long L, long window, float scale, T *out) {
    long group = NH / KVH;
    if (D > MAX_HEAD_DIM || group > MAX_GROUP || group * KVH != NH) return -2;
    float rot[MAX_HEAD_DIM];
    for (long t = 0; t < tokens; t++) {
        long pos = positions[t], slot = slots[t / slot_div];
        for (long g = 0; g < KVH; g++) {
            T *kd = k_cache + ((slot * KVH + g) * L + pos) * D;
            T *vd = v_cache + ((slot * KVH + g) * L + pos) * D;
            const T *vs = v + t * v_stride + g * D;
            NAME(rotate)(qk + t * qk_stride + (NH + g) * D, cos + t * D, sin + t * D, D, rot);
            for (long i = 0; i < D; i++) {
                kd[i] = STORE(rot[i]);
                vd[i] = vs[i];
            }
        }
    }
    long max_keys = 0, work = 0;
    for (long t = 0; t < tokens; t++) {
        if (positions[t] + 1 > max_keys) max_keys = positions[t] + 1;
        work += (positions[t] + 1) * KVH;
    }
    int failed = 0;
#pragma omp parallel if (tokens * KVH > 1 && work >= PARALLEL_MIN_KEYS)
    {
        /* this thread's scores [group, keys], rotated queries and sums [group, D] */
        float *scores = malloc(sizeof(float) * (size_t)(group * max_keys + 2 * group * D));
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for collapse(2) schedule(static)
        for (long t = 0; t < tokens; t++) {
            for (long g = 0; g < KVH; g++) {
                if (scores) {
                    NAME(attend_group)(qk + t * qk_stride + g * group * D, cos + t * D, sin + t * D,
                                       k_cache + (slots[t / slot_div] * KVH + g) * L * D,
                                       v_cache + (slots[t / slot_div] * KVH + g) * L * D, positions[t], window,
                                       group, D, scale, scores, out + (t * NH + g * group) * D);
                }
            }
        }
        free(scores);
    }
    if (failed) return -1;
    return 0;
}
