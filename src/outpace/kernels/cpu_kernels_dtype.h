/* cpu_kernels.c's kernels for one activation dtype T: NAME(f) names them, LOAD and STORE convert
 * one value to and from float32, ROUND rounds a float32 result as an op of dtype T does, LOAD16
 * (AVX-512 only) loads 16 values as floats, LOAD8 (AVX2 without AVX-512) 8, STORE16 and STORE8,
 * ROUND16 and ROUND8 as STORE and ROUND on those lanes. */

/* h_out = h + delta (delta may be NULL: h_out is h); x_out = rms_norm(h_out) * weight:
 * normalised in float32, rounded to the dtype, then scaled (the reference's order). With AVX-512
 * 16 values at a time (a 512-token chunk's norm 1.07-1.09x faster than the compiler's loops), with
 * AVX2 8 (the compiler's loops did not vectorise bfloat16's rounding), the squares summed in the
 * same order either way. */
void NAME(add_rms_norm)(const T *h, const T *delta, const T *weight, T *h_out, T *x_out, long rows, long dim,
                        float eps) {
#pragma omp parallel for if (PARALLEL_ROWS(rows, dim)) schedule(static)
    for (long r = 0; r < rows; r++) {
        const T *hr = h + r * dim;
        T *xo = x_out + r * dim;
        long i = 0;
        if (delta) {
            T *ho = h_out + r * dim;
            const T *dr = delta + r * dim;
#ifdef LOAD16
            for (; i + 16 <= dim; i += 16) STORE16(ho + i, _mm512_add_ps(LOAD16(hr + i), LOAD16(dr + i)));
#endif
#ifdef LOAD8
            for (; i + 8 <= dim; i += 8) STORE8(ho + i, _mm256_add_ps(LOAD8(hr + i), LOAD8(dr + i)));
#endif
            for (; i < dim; i++) ho[i] = STORE(LOAD(hr[i]) + LOAD(dr[i]));
            hr = ho;
        }
        float parts[LANES] = {0};
        i = 0;
#ifdef LOAD16
        __m512 squares = _mm512_setzero_ps();
        for (; i + LANES <= dim; i += LANES) {
            __m512 x = LOAD16(hr + i);
            squares = _mm512_add_ps(squares, _mm512_mul_ps(x, x));
        }
        _mm512_storeu_ps(parts, squares);
#endif
#ifdef LOAD8
        __m256 low = _mm256_setzero_ps(), high = low;       /* parts' lanes 0-7 and 8-15 */
        for (; i + LANES <= dim; i += LANES) {
            __m256 a = LOAD8(hr + i), b = LOAD8(hr + i + 8);
            low = _mm256_add_ps(low, _mm256_mul_ps(a, a));
            high = _mm256_add_ps(high, _mm256_mul_ps(b, b));
        }
        _mm256_storeu_ps(parts, low);
        _mm256_storeu_ps(parts + 8, high);
#endif
        for (; i + LANES <= dim; i += LANES) {
            for (int l = 0; l < LANES; l++) parts[l] += LOAD(hr[i + l]) * LOAD(hr[i + l]);
        }
        for (; i < dim; i++) parts[i % LANES] += LOAD(hr[i]) * LOAD(hr[i]);
        float inv = 1.0f / sqrtf(lanes_sum(parts) / (float)dim + eps);
        i = 0;
#ifdef LOAD16
        for (; i + 16 <= dim; i += 16) {
            STORE16(xo + i, _mm512_mul_ps(ROUND16(_mm512_mul_ps(LOAD16(hr + i), _mm512_set1_ps(inv))),
                                          LOAD16(weight + i)));
        }
#endif
#ifdef LOAD8
        for (; i + 8 <= dim; i += 8) {
            STORE8(xo + i, _mm256_mul_ps(ROUND8(_mm256_mul_ps(LOAD8(hr + i), _mm256_set1_ps(inv))), LOAD8(weight + i)));
        }
#endif
        for (; i < dim; i++) xo[i] = STORE(ROUND(LOAD(hr[i]) * inv) * LOAD(weight[i]));
    }
}

/* out [rows, inter] = silu(gate) * up from gate_up [rows, 2 * inter]; with AVX-512 16 values at
 * a time (a 512-token chunk's 1.2x faster in bfloat16, 1.5x in float32, than the compiler's
 * loops), with AVX2 8 (in bfloat16 the compiler's loops took 17 us a token of the default model's
 * 1536 values, a tenth of its decode step's layers), the same arithmetic */
void NAME(silu_mul)(const T *gate_up, T *out, long rows, long inter) {
#pragma omp parallel for if (PARALLEL_ROWS(rows, inter)) schedule(static)
    for (long r = 0; r < rows; r++) {
        const T *g = gate_up + r * 2 * inter, *u = g + inter;
        T *o = out + r * inter;
        long i = 0;
#ifdef LOAD16
        for (; i + 16 <= inter; i += 16) {
            __m512 x = LOAD16(g + i);
            __m512 e = exp_f32x16(_mm512_sub_ps(_mm512_setzero_ps(), x));
            __m512 silu = ROUND16(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
            STORE16(o + i, _mm512_mul_ps(silu, LOAD16(u + i)));
        }
#endif
#ifdef LOAD8
        for (; i + 8 <= inter; i += 8) {
            __m256 x = LOAD8(g + i);
            __m256 e = exp_f32x8(_mm256_sub_ps(_mm256_setzero_ps(), x));
            __m256 silu = ROUND8(_mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e)));
            STORE8(o + i, _mm256_mul_ps(silu, LOAD8(u + i)));
        }
#endif
        for (; i < inter; i++) {
            float x = LOAD(g[i]);
            o[i] = STORE(ROUND(x / (1.0f + exp_f32(-x))) * LOAD(u[i]));
        }
    }
}

/* One rotary rotation into float32: x * cos + roll(x, D/2) * signed_sin, each op rounded as
 * PyTorch's ops of dtype T round */
static inline void NAME(rotate)(const T *x, const T *cos, const T *sin, long D, float *out) {
    long half = D / 2;
    for (long i = 0; i < half; i++)         /* two loops rather than an index mod D: they vectorise */
        out[i] = ROUND(ROUND(LOAD(x[i]) * LOAD(cos[i])) + ROUND(LOAD(x[i + half]) * LOAD(sin[i])));
    for (long i = half; i < D; i++)
        out[i] = ROUND(ROUND(LOAD(x[i]) * LOAD(cos[i])) + ROUND(LOAD(x[i - half]) * LOAD(sin[i])));
}

/* q [tokens * group, D] = the tokens' `group` query heads rotated (token t's at qk + t * qk_stride) */
static inline void NAME(rotate_queries)(const T *qk, long qk_stride, const T *cos, const T *sin, long tokens,
                                        long group, long D, float *q) {
    for (long t = 0; t < tokens; t++) {
        for (long r = 0; r < group; r++) {
            NAME(rotate)(qk + t * qk_stride + r * D, cos + t * D, sin + t * D, D, q + (t * group + r) * D);
        }
    }
}

/* out [tokens, heads, D] = each head rotated (token t's heads at x + t * x_stride, its cos and sin
 * rows at t * D): rotate's arithmetic, so bit for bit PyTorch's ops of dtype T (fused.rope) */
void NAME(rope)(const T *x, long x_stride, long heads, const T *cos, const T *sin, long tokens, long D, T *out) {
#pragma omp parallel for if (PARALLEL_ROWS(tokens, heads * D)) schedule(static)
    for (long t = 0; t < tokens; t++) {
        float rot[MAX_HEAD_DIM];
        for (long h = 0; h < heads; h++) {
            NAME(rotate)(x + t * x_stride + h * D, cos + t * D, sin + t * D, D, rot);
            for (long i = 0; i < D; i++) out[(t * heads + h) * D + i] = STORE(rot[i]);
        }
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

/* acc [D] = sum over j < n of p[j] * the value row of position first + j (key_row) */
static inline void NAME(weighted_sum)(float *acc, const float *p, const T *values, long first, const int64_t *map,
                                      long n, long D) {
    long i = 0;
#ifdef LOAD16
    for (; i + 64 <= D; i += 64) {      /* four registers of sums held across the keys */
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (long j = 0; j < n; j++) {
            const T *v = values + key_row(map, first + j) * D + i;
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
        const T *v = values + key_row(map, first + j) * D;
        for (long k = i; k < D; k++) acc[k] += p[j] * LOAD(v[k]);
    }
}

/* Attention of one token's `group` query heads (unrotated, at q_heads) over one key/value head's
 * cache (keys, values: position 0 of [L, D]), keys at positions <= pos (and > pos - window when
 * window > 0), each read from its row key_row(map, position); scratch: [group, pos + 1] scores
 * then [group, D] queries and [group, D] sums. */
static void NAME(attend_group)(const T *q_heads, const T *cos, const T *sin, const T *keys, const T *values,
                               long pos, const int64_t *map, long window, long group, long D, float scale,
                               float *scratch, T *out) {
    long first = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0, n = pos + 1 - first;
    float *scores = scratch, *q = scratch + group * (pos + 1), *acc = q + group * D;
    float top[MAX_GROUP], total[MAX_GROUP];
    for (long r = 0; r < group; r++) {
        NAME(rotate)(q_heads + r * D, cos, sin, D, q + r * D);
        top[r] = -INFINITY;
        total[r] = 0.0f;
    }
    for (long j = 0; j < n; j++) {
        const T *key = keys + key_row(map, first + j) * D;
        for (long r = 0; r < group; r++) {
            float s = NAME(dot)(q + r * D, key, D) * scale;
            scores[r * n + j] = s;
            top[r] = s > top[r] ? s : top[r];
        }
    }
    for (long r = 0; r < group; r++) {
        float *p = scores + r * n;
        for (long j = 0; j < n; j++) p[j] = exp_f32(p[j] - top[r]);
        for (long j = 0; j < n; j++) total[r] += p[j];
    }
    for (long r = 0; r < group; r++) NAME(weighted_sum)(acc + r * D, scores + r * n, values, first, map, n, D);
    for (long r = 0; r < group; r++) {
        for (long i = 0; i < D; i++) out[r * D + i] = STORE(acc[r * D + i] / total[r]);
    }
}

#if defined(LOAD16) || defined(LOAD8)
/* A blocked attention pass's prefetches into L2 of a slot's keys or values from position base to
 * hi, in blocks of `width` keys (a step's stream of weights has evicted the cache). Before the
 * loop, the blocks its prefetches never reach: keys and values alike before the scores (pass 0),
 * the values' further blocks before the weighted values (pass 1). */
static inline void NAME(prefetch_first)(const T *keys, const T *values, const int64_t *map, long base, long hi,
                                        long D, long width, long pass) {
    for (long b = pass ? 16 * BLOCKS_AHEAD : 0; b < 16 * BLOCKS_AHEAD * (pass + 1) && base + b <= hi; b += width) {
        long row = key_row(map, base + b);     /* a block's rows are consecutive but for a tree's nodes */
        for (long k = 0; k < width * D * (long)sizeof(T) && k < (hi + 1 - base - b) * D * (long)sizeof(T); k += 64) {
            if (!pass) _mm_prefetch((const char *)(keys + row * D) + k, _MM_HINT_T1);
            _mm_prefetch((const char *)(values + row * D) + k, _MM_HINT_T1);
        }
    }
}

/* In the loop at the block from j0: the block 16 * BLOCKS_AHEAD keys further on (cache: the keys
 * or the values) */
static inline void NAME(prefetch_ahead)(const T *cache, const int64_t *map, long j0, long hi, long D, long width) {
    if (j0 + 16 * BLOCKS_AHEAD > hi) return;
    const char *ahead = (const char *)(cache + key_row(map, j0 + 16 * BLOCKS_AHEAD) * D);
    for (long b = 0; b < width * D * (long)sizeof(T); b += 64) _mm_prefetch(ahead + b, _MM_HINT_T1);
}
#endif

#ifdef LOAD16
/* Attention of `tokens` tokens of one slot, each at its own position, over one key/value head
 * (keys, values: position 0 of [L, D], the key of a position at its row key_row(map, position)),
 * `group` query heads each (unrotated, token t's at qk + t * qk_stride); out: token t's heads at
 * out + t * out_stride. Keys go in blocks of 16 at fixed positions (16b .. 16b + 15), each
 * widened to float32 and transposed once for all the queries, so a query's 16 scores are one
 * register of FMAs, four queries sharing each load. Two passes: every score and each query's
 * running maximum (lane by lane), then the exponentials and the weighted values. A query's
 * arithmetic depends on its own position (and window) alone: blocks outside its keys are skipped
 * and its masked keys weigh exact zeros, so its result is the same in any call. scratch: tokens *
 * group * (2 D + D / 2 + 32 + keys + 16) + 32 D floats (rope_attend sizes it). Where DOT_PAIRS
 * (bfloat16 with AVX512_BF16) and D is a multiple of 32, the scores are vdpbf16ps sums over pairs
 * of values, the keys moved as pairs without widening. D a multiple of 16. */
static void NAME(attend_blocked)(const T *qk, long qk_stride, const T *cos, const T *sin, const T *keys,
                                 const T *values, const int64_t *positions, const int64_t *map, long tokens,
                                 long window, long group, long D, float scale, float *scratch, T *out,
                                 long out_stride) {
    long queries = tokens * group, lo, hi;
    long first[BLOCK_QUERIES], last[BLOCK_QUERIES];     /* each query's keys */
    query_keys(positions, tokens, group, window, first, last, &lo, &hi);
    long base = lo / 16 * 16, span = hi + 1 - base;
    /* q [queries, D], acc [queries, D], kt [D, 16], vb [16, D], top and sums [queries, 16],
     * scores [queries, span rounded up to 16] */
    float *q = scratch, *acc = q + queries * D, *kt = acc + queries * D, *vb = kt + 16 * D;
    float *top = vb + 16 * D, *sums = top + queries * 16, *scores = sums + queries * 16;
    long stride = (span + 15) / 16 * 16;
    NAME(rotate_queries)(qk, qk_stride, cos, sin, tokens, group, D, q);
#ifdef DOT_PAIRS
    /* the queries (rounded to bfloat16 by rotate, so exactly) as pairs of bfloat16 values, one
     * 32-bit word a pair, after the scores: kt then holds the keys' pairs transposed, [D / 2][16] */
    int pairs = D % 32 == 0;
    uint32_t *qp = (uint32_t *)(scores + queries * stride);
    for (long i = 0; pairs && i < queries * D / 2; i++) {
        qp[i] = (uint32_t)f32_to_bf16(q[2 * i]) | (uint32_t)f32_to_bf16(q[2 * i + 1]) << 16;
    }
#else
    const int pairs = 0;
#endif
    for (long i = 0; i < queries * D; i++) acc[i] = 0.0f;
    for (long i = 0; i < queries; i++) {
        _mm512_storeu_ps(top + i * 16, _mm512_set1_ps(-INFINITY));
        _mm512_storeu_ps(sums + i * 16, _mm512_setzero_ps());
    }
    for (long pass = 0; pass < 2; pass++) {
        NAME(prefetch_first)(keys, values, map, base, hi, D, 16, pass);
        for (long j0 = base; j0 <= hi; j0 += 16) {
            long valid = hi - j0 + 1 < 16 ? hi - j0 + 1 : 16;     /* keys past hi may be unwritten */
            NAME(prefetch_ahead)(pass ? values : keys, map, j0, hi, D, 16);
#ifdef DOT_PAIRS
            for (long d = 0; pairs && !pass && d < D; d += 32) {    /* 16 pairs of 16 keys, transposed */
                __m512 rows[16];
                for (long j = 0; j < 16; j++) {
                    rows[j] = j >= valid ? _mm512_setzero_ps()
                                         : _mm512_loadu_ps((const void *)(keys + key_row(map, j0 + j) * D + d));
                }
                transpose16(rows);
                for (long i = 0; i < 16; i++) _mm512_storeu_ps(kt + (d / 2 + i) * 16, rows[i]);
            }
#endif
#ifdef DOT_PAIRS
            /* the values of keys 2p and 2p + 1 interleaved, one pair a 32-bit word, for vdpbf16ps:
             * [8 pairs][D / 32 slices of 32 values][2], each of the two 16 words: unpacklo and
             * unpackhi of the two rows' slice, which hold its values 0-3, 8-11, 16-19, 24-27 and
             * 4-7, 12-15, 20-23, 28-31 (the weighted sums put them back in order) */
            uint32_t *vp = (uint32_t *)vb;
            for (long p = 0; pairs && pass && p < 8; p++) {
                for (long d = 0; d < D; d += 32) {
                    __m512i a = 2 * p < valid ? _mm512_loadu_si512(values + key_row(map, j0 + 2 * p) * D + d)
                                              : _mm512_setzero_si512();
                    __m512i b = 2 * p + 1 < valid ? _mm512_loadu_si512(values + key_row(map, j0 + 2 * p + 1) * D + d)
                                                  : _mm512_setzero_si512();
                    _mm512_storeu_si512(vp + ((p * (D / 32) + d / 32) * 2) * 16, _mm512_unpacklo_epi16(a, b));
                    _mm512_storeu_si512(vp + ((p * (D / 32) + d / 32) * 2 + 1) * 16, _mm512_unpackhi_epi16(a, b));
                }
            }
#endif
            for (long d = 0; !pairs && d < D; d += 16) {
                __m512 rows[16];
                for (long j = 0; j < 16; j++) {
                    rows[j] = j >= valid ? _mm512_setzero_ps()
                                         : LOAD16((pass ? values : keys) + key_row(map, j0 + j) * D + d);
                }
                if (pass) {
                    for (long j = 0; j < 16; j++) _mm512_storeu_ps(vb + j * D + d, rows[j]);
                } else {
                    transpose16(rows);
                    for (long i = 0; i < 16; i++) _mm512_storeu_ps(kt + (d + i) * 16, rows[i]);
                }
            }
            for (long i0 = 0; i0 < queries; i0 += 4) {
                unsigned keep[4];
                if (!block_keep(first, last, queries, i0, j0, 16, keep)) continue;
                if (!pass) {        /* scores, and each query's maximum lane by lane */
                    const float *qc[4];
                    for (int c = 0; c < 4; c++) qc[c] = q + (i0 + c < queries ? i0 + c : i0) * D;
                    __m512 even[4], odd[4];
                    for (int c = 0; c < 4; c++) even[c] = odd[c] = _mm512_setzero_ps();
#ifdef DOT_PAIRS
                    /* each score a sum over the pairs (odd value's product first), even pairs
                     * in even, odd ones in odd */
                    for (long p = 0; pairs && p < D / 2; p += 2) {
                        __m512bh k0 = (__m512bh)_mm512_castps_si512(_mm512_loadu_ps(kt + p * 16));
                        __m512bh k1 = (__m512bh)_mm512_castps_si512(_mm512_loadu_ps(kt + (p + 1) * 16));
                        for (int c = 0; c < 4; c++) {
                            const uint32_t *pc = qp + (qc[c] - q) / 2;     /* query c's pairs */
                            even[c] = _mm512_dpbf16_ps(even[c], (__m512bh)_mm512_set1_epi32((int)pc[p]), k0);
                            odd[c] = _mm512_dpbf16_ps(odd[c], (__m512bh)_mm512_set1_epi32((int)pc[p + 1]), k1);
                        }
                    }
#endif
                    for (long d = 0; !pairs && d < D; d += 2) {
                        __m512 k0 = _mm512_loadu_ps(kt + d * 16), k1 = _mm512_loadu_ps(kt + (d + 1) * 16);
                        for (int c = 0; c < 4; c++) {
                            even[c] = _mm512_fmadd_ps(_mm512_set1_ps(qc[c][d]), k0, even[c]);
                            odd[c] = _mm512_fmadd_ps(_mm512_set1_ps(qc[c][d + 1]), k1, odd[c]);
                        }
                    }
                    for (int c = 0; c < 4; c++) {
                        if (!keep[c]) continue;
                        long i = i0 + c;
                        __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), keep[c],
                                                      _mm512_mul_ps(_mm512_add_ps(even[c], odd[c]), _mm512_set1_ps(scale)));
                        _mm512_storeu_ps(scores + i * stride + (j0 - base), s);
                        _mm512_storeu_ps(top + i * 16, _mm512_max_ps(_mm512_loadu_ps(top + i * 16), s));
                    }
                    continue;
                }
                /* weights, then the weighted values; a query outside this block weighs zeros */
                float weights[4][16];
                for (int c = 0; c < 4; c++) {
                    long i = i0 + c;
                    __m512 e = _mm512_setzero_ps();
                    if (keep[c]) {
                        __m512 s = _mm512_loadu_ps(scores + i * stride + (j0 - base));
                        e = _mm512_maskz_mov_ps(keep[c], exp_f32x16(_mm512_sub_ps(s, _mm512_set1_ps(top[i * 16]))));
                        _mm512_storeu_ps(sums + i * 16, _mm512_add_ps(_mm512_loadu_ps(sums + i * 16), e));
                    }
                    _mm512_storeu_ps(weights[c], e);
                }
#ifdef DOT_PAIRS
                if (pairs) {
                    /* the weights rounded to bfloat16, as PyTorch's flash attention rounds them
                     * for its second product: 8 pairs a query, then vdpbf16ps over the value pairs,
                     * 64 values at a time; the weights are read through a pointer the compiler
                     * cannot follow and the value pairs pinned to registers (see below) */
                    uint32_t wp[4][8];
                    for (int c = 0; c < 4; c++) {
                        _mm256_storeu_si256((__m256i *)wp[c], (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(weights[c])));
                    }
                    const uint32_t *wq = wp[0];
                    __asm__("" : "+r"(wq));
                    for (long d0 = 0; d0 < D; d0 += 64) {
                        long slices = D - d0 < 64 ? 1 : 2;
                        __m512 part[4][4];
                        for (int c = 0; c < 4; c++) {
                            for (int k = 0; k < 4; k++) part[c][k] = _mm512_setzero_ps();
                        }
                        for (long p = 0; p < 8; p++) {
                            __m512i v[4];
                            for (int k = 0; k < 4; k++) {
                                v[k] = k < 2 * slices ? _mm512_loadu_si512(vp + ((p * (D / 32) + d0 / 32) * 2 + k) * 16)
                                                      : _mm512_setzero_si512();
                                __asm__("" : "+v"(v[k]));
                            }
                            for (int c = 0; c < 4; c++) {
                                __m512bh w = (__m512bh)_mm512_set1_epi32((int)wq[c * 8 + p]);
                                for (int k = 0; k < 4; k++) part[c][k] = _mm512_dpbf16_ps(part[c][k], w, (__m512bh)v[k]);
                            }
                        }
                        /* summed in the pairs' order, put back in order at the end */
                        for (int c = 0; c < 4 && i0 + c < queries; c++) {
                            for (int k = 0; k < 2 * slices; k++) {
                                float *ai = acc + (i0 + c) * D + d0 + 16 * k;
                                _mm512_storeu_ps(ai, _mm512_add_ps(_mm512_loadu_ps(ai), part[c][k]));
                            }
                        }
                    }
                    continue;
                }
#endif
                /* up to 64 values at a time: the four queries' 16 sums stay in registers over
                 * the block's keys, a key's values loaded once for the four queries. The weights
                 * are read through a pointer the compiler cannot follow and the values pinned to
                 * registers: else it hoisted the 64 broadcasts out of this loop onto the stack and
                 * read two operands from memory for every FMA (one layer at 900 keys, 5 tokens:
                 * 137 -> 95 us) */
                for (long d0 = 0; d0 < D; d0 += 64) {
                    long chunks = D - d0 < 64 ? (D - d0) / 16 : 4;
                    const float *wt = weights[0];
                    __asm__("" : "+r"(wt));
                    __m512 part[4][4];
                    for (int c = 0; c < 4; c++) {
                        for (int k = 0; k < 4; k++) part[c][k] = _mm512_setzero_ps();
                    }
                    for (long j = 0; j < 16; j++) {
                        __m512 v[4];
                        for (int k = 0; k < 4; k++) {
                            v[k] = k < chunks ? _mm512_loadu_ps(vb + j * D + d0 + 16 * k) : _mm512_setzero_ps();
                            __asm__("" : "+v"(v[k]));
                        }
                        for (int c = 0; c < 4; c++) {
                            __m512 w = _mm512_set1_ps(wt[c * 16 + j]);
                            for (int k = 0; k < 4; k++) part[c][k] = _mm512_fmadd_ps(w, v[k], part[c][k]);
                        }
                    }
                    for (int c = 0; c < 4 && i0 + c < queries; c++) {
                        for (int k = 0; k < chunks; k++) {
                            float *ai = acc + (i0 + c) * D + d0 + 16 * k;
                            _mm512_storeu_ps(ai, _mm512_add_ps(_mm512_loadu_ps(ai), part[c][k]));
                        }
                    }
                }
            }
        }
        if (!pass) {                /* each query's maximum over its lanes, in every lane */
            for (long i = 0; i < queries; i++) {
                _mm512_storeu_ps(top + i * 16, _mm512_set1_ps(_mm512_reduce_max_ps(_mm512_loadu_ps(top + i * 16))));
            }
        }
    }
#ifdef DOT_PAIRS
    /* back in order: lane 4L + m of a slice's first (second) 16 sums holds value 8L + m (8L + 4 + m) */
    const __m512i low = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i high = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (long i = 0; pairs && i < queries * D; i += 32) {
        __m512 first = _mm512_loadu_ps(acc + i), second = _mm512_loadu_ps(acc + i + 16);
        _mm512_storeu_ps(acc + i, _mm512_permutex2var_ps(first, low, second));
        _mm512_storeu_ps(acc + i + 16, _mm512_permutex2var_ps(first, high, second));
    }
#endif
    for (long t = 0; t < tokens; t++) {
        for (long r = 0; r < group; r++) {
            long i = t * group + r;
            float total = _mm512_reduce_add_ps(_mm512_loadu_ps(sums + i * 16));
            for (long d = 0; d < D; d++) out[t * out_stride + r * D + d] = STORE(acc[i * D + d] / total);
        }
    }
}
#endif

#ifdef LOAD8
/* attend_blocked on AVX2's 8 lanes, where AVX-512 is absent: blocks of 8 keys at fixed positions
 * (8b .. 8b + 7), widened to float32 and transposed once for the call's queries, a query's 8
 * scores one register of FMAs, four queries sharing each load; the same two passes (scores and
 * maxima lane by lane, then exponentials and weighted values), so a query's result depends on its
 * own position (and window) alone. attend_group, the compiler's loops over one query at a time,
 * spends about 5 of a 4-token verify step's 14 ms at 200 keys of the default model here. D a
 * multiple of 16; scratch as attend_blocked's. */
static void NAME(attend_blocked8)(const T *qk, long qk_stride, const T *cos, const T *sin, const T *keys,
                                  const T *values, const int64_t *positions, const int64_t *map, long tokens,
                                  long window, long group, long D, float scale, float *scratch, T *out,
                                  long out_stride) {
    long queries = tokens * group, lo, hi;
    long first[BLOCK_QUERIES], last[BLOCK_QUERIES];     /* each query's keys */
    query_keys(positions, tokens, group, window, first, last, &lo, &hi);
    long base = lo / 8 * 8, stride = (hi + 1 - base + 7) / 8 * 8;
    /* q [queries, D], acc [queries, D], kt [D, 8], vb [8, D], top and sums [queries, 8],
     * scores [queries, stride] */
    float *q = scratch, *acc = q + queries * D, *kt = acc + queries * D, *vb = kt + 8 * D;
    float *top = vb + 8 * D, *sums = top + queries * 8, *scores = sums + queries * 8;
    NAME(rotate_queries)(qk, qk_stride, cos, sin, tokens, group, D, q);
    for (long i = 0; i < queries * D; i++) acc[i] = 0.0f;
    for (long i = 0; i < queries; i++) {
        _mm256_storeu_ps(top + i * 8, _mm256_set1_ps(-INFINITY));
        _mm256_storeu_ps(sums + i * 8, _mm256_setzero_ps());
    }
    for (long pass = 0; pass < 2; pass++) {
        NAME(prefetch_first)(keys, values, map, base, hi, D, 8, pass);
        for (long j0 = base; j0 <= hi; j0 += 8) {
            long valid = hi - j0 + 1 < 8 ? hi - j0 + 1 : 8;       /* keys past hi may be unwritten */
            NAME(prefetch_ahead)(pass ? values : keys, map, j0, hi, D, 8);
            for (long d = 0; d < D; d += 8) {
                __m256 rows[8];
                for (long j = 0; j < 8; j++) {
                    rows[j] = j >= valid ? _mm256_setzero_ps()
                                         : LOAD8((pass ? values : keys) + key_row(map, j0 + j) * D + d);
                }
                if (pass) {
                    for (long j = 0; j < 8; j++) _mm256_storeu_ps(vb + j * D + d, rows[j]);
                } else {
                    transpose8(rows);
                    for (long i = 0; i < 8; i++) _mm256_storeu_ps(kt + (d + i) * 8, rows[i]);
                }
            }
            for (long i0 = 0; i0 < queries; i0 += 4) {
                unsigned keep[4];
                if (!block_keep(first, last, queries, i0, j0, 8, keep)) continue;
                if (!pass) {        /* scores, and each query's maximum lane by lane */
                    const float *qc[4];
                    for (int c = 0; c < 4; c++) qc[c] = q + (i0 + c < queries ? i0 + c : i0) * D;
                    __m256 even[4], odd[4];
                    for (int c = 0; c < 4; c++) even[c] = odd[c] = _mm256_setzero_ps();
                    for (long d = 0; d < D; d += 2) {
                        __m256 k0 = _mm256_loadu_ps(kt + d * 8), k1 = _mm256_loadu_ps(kt + (d + 1) * 8);
                        for (int c = 0; c < 4; c++) {
                            even[c] = _mm256_fmadd_ps(_mm256_set1_ps(qc[c][d]), k0, even[c]);
                            odd[c] = _mm256_fmadd_ps(_mm256_set1_ps(qc[c][d + 1]), k1, odd[c]);
                        }
                    }
                    for (int c = 0; c < 4; c++) {
                        if (!keep[c]) continue;
                        long i = i0 + c;
                        __m256 s = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY),
                                                    _mm256_mul_ps(_mm256_add_ps(even[c], odd[c]), _mm256_set1_ps(scale)),
                                                    lane_mask8(keep[c]));
                        _mm256_storeu_ps(scores + i * stride + (j0 - base), s);
                        _mm256_storeu_ps(top + i * 8, _mm256_max_ps(_mm256_loadu_ps(top + i * 8), s));
                    }
                    continue;
                }
                /* weights, then the weighted values; a query outside this block weighs zeros */
                float weights[4][8];
                for (int c = 0; c < 4; c++) {
                    long i = i0 + c;
                    __m256 e = _mm256_setzero_ps();
                    if (keep[c]) {
                        __m256 s = _mm256_loadu_ps(scores + i * stride + (j0 - base));
                        e = _mm256_and_ps(lane_mask8(keep[c]), exp_f32x8(_mm256_sub_ps(s, _mm256_set1_ps(top[i * 8]))));
                        _mm256_storeu_ps(sums + i * 8, _mm256_add_ps(_mm256_loadu_ps(sums + i * 8), e));
                    }
                    _mm256_storeu_ps(weights[c], e);
                }
                /* 16 values at a time: the four queries' sums stay in registers over the block's
                 * keys, a key's values loaded once for the four queries */
                for (long d0 = 0; d0 < D; d0 += 16) {
                    __m256 part[4][2];
                    for (int c = 0; c < 4; c++) part[c][0] = part[c][1] = _mm256_setzero_ps();
                    for (long j = 0; j < 8; j++) {
                        __m256 v0 = _mm256_loadu_ps(vb + j * D + d0), v1 = _mm256_loadu_ps(vb + j * D + d0 + 8);
                        for (int c = 0; c < 4; c++) {
                            __m256 w = _mm256_set1_ps(weights[c][j]);
                            part[c][0] = _mm256_fmadd_ps(w, v0, part[c][0]);
                            part[c][1] = _mm256_fmadd_ps(w, v1, part[c][1]);
                        }
                    }
                    for (int c = 0; c < 4 && i0 + c < queries; c++) {
                        float *ai = acc + (i0 + c) * D + d0;
                        _mm256_storeu_ps(ai, _mm256_add_ps(_mm256_loadu_ps(ai), part[c][0]));
                        _mm256_storeu_ps(ai + 8, _mm256_add_ps(_mm256_loadu_ps(ai + 8), part[c][1]));
                    }
                }
            }
        }
        if (!pass) {                /* each query's maximum over its lanes, in every lane */
            for (long i = 0; i < queries; i++) {
                float m = top[i * 8];
                for (int l = 1; l < 8; l++) m = top[i * 8 + l] > m ? top[i * 8 + l] : m;
                _mm256_storeu_ps(top + i * 8, _mm256_set1_ps(m));
            }
        }
    }
    for (long t = 0; t < tokens; t++) {
        for (long r = 0; r < group; r++) {
            long i = t * group + r;
            float total = 0.0f;
            for (int l = 0; l < 8; l++) total += sums[i * 8 + l];
            for (long d = 0; d < D; d++) out[t * out_stride + r * D + d] = STORE(acc[i * D + d] / total);
        }
    }
}
#endif

/* Rotates the T tokens' queries and keys (cos, sin: token t's rows at t * D, the sin signed as
 * rope_tables makes it), writes keys and values into the caches [slots, KVH, L, D] at (slot,
 * position), then attends: each token's query heads over its slot's keys at positions <= its
 * own (and > position - window when window > 0), a key/value head serving NH / KVH query heads,
 * which read each of its keys together. qk: token t's NH query heads then KVH key heads at
 * qk + t * qk_stride; v: its KVH value heads at v + t * v_stride; its slot is slots[t / slot_div].
 * Every token is written before any attends, so a row's later tokens see its earlier ones.
 * Pieces of work are shared among OpenMP threads (built with OpenMP) when the keys read add up
 * to PARALLEL_MIN_KEYS. out [T, NH * D]. Returns 0, -1 when memory for the scores ran out, -2
 * for unsupported sizes.
 *
 * tree (NULL for rows of consecutive tokens): the tokens are nodes of token trees, written one
 * cache entry a node but rotated at their depth, so a node's keys are not the positions below
 * its own. Token t's row, tree + t * tree_stride, is [extent, from, rows...]: the node attends
 * as a token at position extent would (keys at positions <= extent, within the window), reading
 * the key of a position p >= from at cache position rows[p - from] (its ancestors', then its
 * own) and of p < from at p (key_row). Each tree token attends alone, so its result is the one
 * its path's tokens would get as a chain. */
int NAME(rope_attend)(const T *qk, long qk_stride, const T *v, long v_stride, const T *cos, const T *sin,
                      T *k_cache, T *v_cache, const int64_t *slots, long slot_div, const int64_t *positions,
                      long tokens, long NH, long KVH, long D, long L, long window, float scale, T *out,
                      const int64_t *tree, long tree_stride) {
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
        long extent = tree ? tree[t * tree_stride] : positions[t];
        if (extent + 1 > max_keys) max_keys = extent + 1;
        work += (extent + 1) * KVH;
    }
    int blocked = 0;        /* attend_blocked (AVX-512) or attend_blocked8 (AVX2), D a multiple of 16; else attend_group */
#if defined(LOAD16) || defined(LOAD8)
    blocked = D % 16 == 0;
#endif
    /* pieces of work: runs of consecutive tokens of one slot (a row's tokens share their keys),
     * up to `run` of them where attend_blocked serves several at once, each run with each
     * key/value head. A run holds up to a quarter of BLOCK_QUERIES queries, so that a step's few
     * tokens still spread over the threads, and up to BLOCK_QUERIES in calls of more tokens than
     * that (prompt chunks), where more queries share each block's transposed keys: prefill of
     * 660, 750 and 862 tokens 5-7% faster. A token's result does not depend on its run */
    long most = tokens > BLOCK_QUERIES ? BLOCK_QUERIES : BLOCK_QUERIES / 4;
    long run = blocked && group < BLOCK_QUERIES / 4 && !tree ? most / group : 1, runs = 0;
    long *starts = malloc(sizeof(long) * (size_t)(tokens + 1));
    if (!starts) return -1;
    for (long t = 0; t < tokens; runs++) {
        starts[runs] = t;
        long end = t + 1;
        while (end < tokens && end - t < run && slots[end / slot_div] == slots[t / slot_div]) end++;
        t = end;
    }
    starts[runs] = tokens;
    size_t scratch_floats = blocked ? (size_t)(run * group * (2 * D + D / 2 + 32 + max_keys + 16) + 32 * D)
                                    : (size_t)(group * max_keys + 2 * group * D);
    int failed = 0;
#pragma omp parallel if (runs * KVH > 1 && work >= PARALLEL_MIN_KEYS)
    {
        float *scratch = malloc(sizeof(float) * scratch_floats);      /* this thread's */
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
        /* pieces dealt round-robin: a prompt chunk's later runs read more keys (causal), and
         * contiguous halves gave the second thread about three times the first's work (prefill of
         * 700 tokens 0.63 -> 0.56 s, 1000 tokens 0.93 -> 0.87) */
#pragma omp for collapse(2) schedule(static, 1)
        for (long u = 0; u < runs; u++) {
            for (long g = 0; g < KVH; g++) {
                long t = starts[u], base = (slots[t / slot_div] * KVH + g) * L * D;
                const int64_t *extent = tree ? tree + t * tree_stride : positions + t;
                const int64_t *map = tree ? tree + t * tree_stride + 1 : NULL;
                const T *q_heads = qk + t * qk_stride + g * group * D;
                T *o = out + (t * NH + g * group) * D;
                if (!scratch) continue;
#ifdef LOAD16
                if (blocked) {
                    NAME(attend_blocked)(q_heads, qk_stride, cos + t * D, sin + t * D, k_cache + base, v_cache + base,
                                         extent, map, starts[u + 1] - t, window, group, D, scale, scratch, o,
                                         NH * D);
                    continue;
                }
#endif
#ifdef LOAD8
                if (blocked) {
                    NAME(attend_blocked8)(q_heads, qk_stride, cos + t * D, sin + t * D, k_cache + base, v_cache + base,
                                          extent, map, starts[u + 1] - t, window, group, D, scale, scratch, o,
                                          NH * D);
                    continue;
                }
#endif
                NAME(attend_group)(q_heads, cos + t * D, sin + t * D, k_cache + base, v_cache + base, *extent, map,
                                   window, group, D, scale, scratch, o);
            }
        }
        free(scratch);
    }
    free(starts);
    if (failed) return -1;
    return 0;
}
