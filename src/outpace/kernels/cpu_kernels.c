/* The ops of a CPU decode or verify step, one call each (see cpu_kernels.py).
 *
 * One translation unit, built once per instruction-set level with that level's flags
 * (cpu_isa.py): the matrix products (cpu_products.h over cpu_vec.h's registers) exist at every
 * level; the activation kernels (cpu_kernels_dtype.h) have explicit AVX-512 paths (LOAD16,
 * cpu_avx512.h) and AVX2 ones (LOAD8, cpu_avx2.h), and elsewhere plain loops the compiler
 * vectorises for the level.
 *
 * Each function runs one op over T token rows, row by row, so a row's result never depends on
 * how many rows the call holds. Every activation kernel exists for float32 and bfloat16
 * (suffix _f32, _bf16: cpu_kernels_dtype.h, included once per dtype); bfloat16 ones compute in
 * float32 and round where PyTorch's bfloat16 ops round (after every op), so they follow the
 * reference's arithmetic step by step. Attention's dot products and softmax sums are the
 * exception: they accumulate in float32 in an order of their own, as PyTorch's kernels do.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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
 * fewer cost less than waking the threads. Within a step the threads are still spinning from the
 * products: the default model's decode step at 100-151 tokens of context is 1.03-1.07x faster on
 * two threads than from 512 keys (AMD EPYC, Zen 3) */
#define PARALLEL_MIN_KEYS 64
/* the kernels that work row by row (norms, SwiGLU, rotation, argmax) share rows among threads where
 * there are two or more and PARALLEL_MIN_VALUES values in all, and quantize_rows its blocks from
 * that many values: within a step the threads still spin from the products, so a verify of the
 * default model's 2-5 tokens is 1.02-1.05x faster than from 65536 values (AMD EPYC, Zen 3) */
#define PARALLEL_MIN_VALUES 2048
#define PARALLEL_ROWS(rows, values) ((rows) > 1 && (rows) * (values) >= PARALLEL_MIN_VALUES)

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

#include "cpu_avx512.h"
#include "cpu_avx2.h"

/* The cache row holding the key of position p: p itself, or, for a token tree's node (map: its
 * row of rope_attend's tree past the extent), the row map gives positions from map[0] on. */
static inline long key_row(const int64_t *map, long p) {
    return map == NULL || p < map[0] ? p : map[1 + p - map[0]];
}

/* The keys of a call's queries, token t's `group` query heads being queries t * group ..: query i
 * attends to positions first[i] .. last[i] (its token's position, within the window); lo and hi
 * bound them all (the blocked attention kernels') */
static inline void query_keys(const int64_t *positions, long tokens, long group, long window, long *first,
                              long *last, long *lo, long *hi) {
    *lo = positions[0];
    *hi = 0;
    for (long t = 0; t < tokens; t++) {
        long pos = positions[t], from = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
        *lo = from < *lo ? from : *lo;
        *hi = pos > *hi ? pos : *hi;
        for (long r = 0; r < group; r++) {
            first[t * group + r] = from;
            last[t * group + r] = pos;
        }
    }
}

/* keep[c]: which of the `width` (at most 16) keys from position j0 query i0 + c attends to, a bit
 * a key (0 past the queries); whether any of the four attends to one */
static inline int block_keep(const long *first, const long *last, long queries, long i0, long j0, long width,
                             unsigned keep[4]) {
    int any = 0;
    for (int c = 0; c < 4; c++) {
        long i = i0 + c;
        keep[c] = 0;
        if (i < queries && j0 <= last[i] && j0 + width - 1 >= first[i]) {
            long from = first[i] > j0 ? first[i] - j0 : 0, to = last[i] - j0 < width - 1 ? last[i] - j0 : width - 1;
            keep[c] = ((1u << (to + 1)) - 1u) & ~((1u << from) - 1u);
        }
        any |= keep[c] != 0;
    }
    return any;
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
#define STORE16(p, v) _mm512_storeu_ps(p, v)
#define ROUND16(v) (v)
#endif
#ifdef AVX2_PATHS
#define LOAD8(p) _mm256_loadu_ps(p)
#define STORE8(p, v) _mm256_storeu_ps(p, v)
#define ROUND8(v) (v)
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
#undef LOAD8
#undef STORE8
#undef ROUND8

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
#ifdef AVX2_PATHS
#define LOAD8(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define STORE8(p, v) _mm_storeu_si128((__m128i *)(p), round_to_bf16x8(v))
#define ROUND8(v) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(round_to_bf16x8(v)), 16))
#endif
#ifdef __AVX512BF16__
#define DOT_PAIRS       /* attention scores as vdpbf16ps over pairs of bfloat16 values */
#endif
#include "cpu_kernels_dtype.h"

#include "cpu_vec.h"
#include "cpu_products.h"
#include "cpu_pack.h"
#include "cpu_dequant.h"

/* out[r] = the index of row r's largest value in x [rows, cols] float32, as torch.argmax picks it:
 * the first of equal values, and the first NaN where a row has one. Rows are shared among OpenMP
 * threads. PyTorch's own took about 40 us a row of the default model's 49152 logits on a Zen 4,
 * this one about 13. */
void argmax_f32(const float *x, long rows, long cols, int64_t *out) {
#pragma omp parallel for if (PARALLEL_ROWS(rows, cols)) schedule(static)
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

/* A decoder layer's product: up to MAX_PARTS runs of output columns, each one packed weight (one
 * GGUF type where a fused matrix mixes types), written side by side into one result. */
#define MAX_PARTS 3
typedef struct {
    long parts;
    const void *weight[MAX_PARTS];
    long format[MAX_PARTS];
    long columns[MAX_PARTS];
    const float *bias[MAX_PARTS];
} Product;

/* One layer of decoder_stack: its norms' weights (in the activations' dtype) and its products */
typedef struct {
    const void *input_norm, *post_norm;
    Product qkv, o, gate_up, down;
} StackLayer;

static int product(const Product *p, const void *x, int wide, long M, long K, void *out, long N) {
    long col = 0;
    for (long i = 0; i < p->parts; i++) {
        int failed = linear(x, wide, M, K, p->weight[i], (int)p->format[i], p->columns[i], p->bias[i],
                            (char *)out + col * (wide ? 4 : 2), N);
        if (failed) return failed;
        col += p->columns[i];
    }
    return 0;
}

static void add_norm(int wide, const void *h, const void *delta, const void *weight, void *h_out, void *x_out,
                     long rows, long dim, float eps) {
    if (wide) add_rms_norm_f32(h, delta, weight, h_out, x_out, rows, dim, eps);
    else add_rms_norm_bf16(h, delta, weight, h_out, x_out, rows, dim, eps);
}

/* out[0..n) = a + b, as a PyTorch add of the activations' dtype rounds */
static void add_rounded(int wide, const void *a, const void *b, void *out, long n) {
    for (long k = 0; k < n; k++) {
        if (wide) ((float *)out)[k] = ((const float *)a)[k] + ((const float *)b)[k];
        else ((bf16 *)out)[k] = f32_to_bf16(bf16_to_f32(((const bf16 *)a)[k]) + bf16_to_f32(((const bf16 *)b)[k]));
    }
}

/* values of attend_mlp's work for `tokens` rows: qkv, the heads' outputs, the normed stream, gate_up
 * and the activation, in that order */
static long layer_work(long tokens, long hidden, long inter, long NH, long KVH, long D) {
    return tokens * ((NH + 2 * KVH) * D + NH * D + hidden + 3 * inter);
}

/* where the normed stream starts in attend_mlp's work (values of `size` bytes) */
static char *work_normed(char *work, long tokens, long NH, long KVH, long D, long size) {
    return work + tokens * ((NH + 2 * KVH) * D + NH * D) * size;
}

/* A decoder layer from its attention's input x [tokens, K] on (decoder_stack's layers, head_layer):
 * q, k and v, their rotation, cache writes and attention (rope_attend's arguments), the output
 * product into delta, h = stream + delta and its post norm, then the SwiGLU MLP's output into
 * delta: the layer's output stream is h + delta. x may be work's normed stream, which the qkv
 * product reads before the post norm writes it. */
static int attend_mlp(const StackLayer *ly, int wide, const void *x, long K, const void *stream, void *h, void *delta,
                      char *work, long tokens, long hidden, long inter, float eps, long NH, long KVH, long D, long L,
                      long window, float scale, void *kc, void *vc, const void *cos, const void *sin,
                      const int64_t *slots, long slot_div, const int64_t *positions, const int64_t *tree,
                      long tree_stride) {
    long size = wide ? 4 : 2, width = (NH + 2 * KVH) * D;
    char *qkv = work, *attn = qkv + tokens * width * size, *normed = work_normed(work, tokens, NH, KVH, D, size);
    char *gate_up = normed + tokens * hidden * size, *act = gate_up + tokens * 2 * inter * size;
    const char *v = qkv + (NH + KVH) * D * size;
    int failed = product(&ly->qkv, x, wide, tokens, K, qkv, width);
    if (!failed)
        failed = wide ? rope_attend_f32((const float *)qkv, width, (const float *)v, width, cos, sin, kc, vc, slots,
                                        slot_div, positions, tokens, NH, KVH, D, L, window, scale, (float *)attn, tree,
                                        tree_stride)
                      : rope_attend_bf16((const bf16 *)qkv, width, (const bf16 *)v, width, cos, sin, kc, vc, slots,
                                         slot_div, positions, tokens, NH, KVH, D, L, window, scale, (bf16 *)attn, tree,
                                         tree_stride);
    if (failed || (failed = product(&ly->o, attn, wide, tokens, NH * D, delta, hidden))) return failed;
    add_norm(wide, stream, delta, ly->post_norm, h, normed, tokens, hidden, eps);
    if ((failed = product(&ly->gate_up, normed, wide, tokens, hidden, gate_up, 2 * inter))) return failed;
    if (wide) silu_mul_f32((const float *)gate_up, (float *)act, tokens, inter);
    else silu_mul_bf16((const bf16 *)gate_up, (bf16 *)act, tokens, inter);
    return product(&ly->down, act, wide, tokens, inter, delta, hidden);
}

/* Every layer of a decoder (layers.DecoderLayer: pre-norm attention without query/key norms, a
 * SwiGLU MLP) over T tokens in one call, each op the same kernel the layer's Python forward calls,
 * in the same order, so the result is bit for bit the per-layer one. A decode step of the default
 * model makes about 250 such calls; made from Python, each paid interpreter and ctypes work and
 * the products' threads went idle between them (docs/DESIGN.md, "CPU steps").
 *
 * h [T, hidden]: the embedded tokens, replaced by the residual stream before the last layer's MLP
 * output; delta [T, hidden]: that output (the stream is h + delta, which the final norm adds).
 * Caches [layers, slots, KVH, L, D]; cos, sin, slots, slot_div, positions, window as rope_attend
 * takes them, tree and tree_stride too (NULL: no token trees). keep [layers]: where layer i's
 * output stream h + delta goes in kept [T, kept layers, hidden], or -1. wide: float32
 * activations, else bfloat16. Returns 0, -1 when memory ran out, -2 for sizes a kernel cannot
 * take. */
int decoder_stack(const StackLayer *layers, long n_layers, int wide, void *h, void *delta, long tokens, long hidden,
                  long inter, float eps, long NH, long KVH, long D, long L, long window, float scale, void *k_cache,
                  void *v_cache, long cache_stride, const void *cos, const void *sin, const int64_t *slots,
                  long slot_div, const int64_t *positions, const int64_t *tree, long tree_stride, const int64_t *keep,
                  long n_kept, void *kept) {
    long size = wide ? 4 : 2;
    char *work = malloc((size_t)(layer_work(tokens, hidden, inter, NH, KVH, D) * size));
    if (!work) return -1;
    char *x = work_normed(work, tokens, NH, KVH, D, size);
    int failed = 0;
    for (long i = 0; i < n_layers && !failed; i++) {
        const StackLayer *ly = layers + i;
        char *kc = (char *)k_cache + i * cache_stride * size, *vc = (char *)v_cache + i * cache_stride * size;
        add_norm(wide, h, i ? delta : NULL, ly->input_norm, h, x, tokens, hidden, eps);
        failed = attend_mlp(ly, wide, x, hidden, h, h, delta, work, tokens, hidden, inter, eps, NH, KVH, D, L, window,
                            scale, kc, vc, cos, sin, slots, slot_div, positions, tree, tree_stride);
        for (long t = 0; t < tokens && !failed && keep[i] >= 0; t++)     /* the stream after the layer */
            add_rounded(wide, (char *)h + t * hidden * size, (char *)delta + t * hidden * size,
                        (char *)kept + (t * n_kept + keep[i]) * hidden * size, hidden);
    }
    free(work);
    return failed;
}

/* An EAGLE-3 head (model/eagle3.py) as head_layer and head_chain take it: its decoder layer (whose
 * input_norm is the embedding's norm and whose qkv reads both normed inputs side by side, 2 *
 * hidden wide), the feature's norm, the final norm, the LM head over the draft vocabulary, the
 * draft ids' offsets to the target's, and the embedding of the target's ids: dense rows in the
 * activations' dtype (embed_format -1) or a GGUF matrix's blocks (dequantize_rows' formats). */
typedef struct {
    StackLayer layer;
    const void *feature_norm, *final_norm;
    Product lm_head;
    long draft_vocab;
    const int64_t *d2t;
    const void *embed;
    long embed_format, embed_row_bytes;
    const void *cos, *sin;      /* rotary tables [positions, D] in the activations' dtype */
} PairHead;

static int embed_rows(const PairHead *hd, int wide, const int64_t *ids, long n, long hidden, void *out) {
    if (hd->embed_format < 0) {
        long size = wide ? 4 : 2;
        for (long t = 0; t < n; t++) memcpy((char *)out + t * hidden * size, (const char *)hd->embed + ids[t] * hidden * size,
                                            (size_t)(hidden * size));
        return 0;
    }
    return dequantize_rows(hd->embed, hd->embed_row_bytes, (int)hd->embed_format, ids, n, !wide, out);
}

/* The head's layer over T pairs (feature [T, hidden], the target's token ids [T]) at positions
 * (rows of slot_div pairs a slot, as rope_attend takes them), each attending to its slot's
 * entries up to its own position: out [T, hidden] the layer's outputs. The ops and their order
 * are those of DraftHead.project and finish over the CPU kernels (the head drafter's Python
 * path), so the bits are too. Returns 0, -1 when memory ran out, -2 for sizes a kernel cannot
 * take. */
int head_layer(const PairHead *hd, int wide, const void *feature, const int64_t *ids, long tokens, long hidden,
               long inter, float eps, long NH, long KVH, long D, long L, float scale, void *k_cache, void *v_cache,
               const int64_t *slots, long slot_div, const int64_t *positions, void *out) {
    long size = wide ? 4 : 2, row = hidden * size;
    const StackLayer *ly = &hd->layer;
    /* emb, pair (2 rows), delta, h: hidden wide; cos, sin; then attend_mlp's work */
    char *scratch = malloc((size_t)((tokens * (5 * hidden + 2 * D) + layer_work(tokens, hidden, inter, NH, KVH, D)) * size));
    if (!scratch) return -1;
    char *emb = scratch, *pair = emb + tokens * row, *delta = pair + 2 * tokens * row, *h = delta + tokens * row;
    char *cos = h + tokens * row, *sin = cos + tokens * D * size, *work = sin + tokens * D * size;
    char *normed = work_normed(work, tokens, NH, KVH, D, size);
    int failed = embed_rows(hd, wide, ids, tokens, hidden, emb);
    for (long t = 0; t < tokens && !failed; t++) {
        memcpy(cos + t * D * size, (const char *)hd->cos + positions[t] * D * size, (size_t)(D * size));
        memcpy(sin + t * D * size, (const char *)hd->sin + positions[t] * D * size, (size_t)(D * size));
    }
    if (!failed) {      /* [norm(embedding), norm(feature)] a pair */
        add_norm(wide, emb, NULL, ly->input_norm, NULL, normed, tokens, hidden, eps);
        for (long t = 0; t < tokens; t++) memcpy(pair + 2 * t * row, normed + t * row, (size_t)row);
        add_norm(wide, feature, NULL, hd->feature_norm, NULL, normed, tokens, hidden, eps);
        for (long t = 0; t < tokens; t++) memcpy(pair + (2 * t + 1) * row, normed + t * row, (size_t)row);
        failed = attend_mlp(ly, wide, pair, 2 * hidden, feature, h, delta, work, tokens, hidden, inter, eps, NH, KVH, D,
                            L, 0, scale, k_cache, v_cache, cos, sin, slots, slot_div, positions, NULL, 0);
    }
    if (!failed) add_rounded(wide, h, delta, out, tokens * hidden);     /* h + the MLP's output */
    free(scratch);
    return failed;
}

/* The largest softmax probability of a row of n logits x whose maximum is top: 1 / sum exp(x - top),
 * summed in LANES partial sums (a loop the compiler vectorises) */
static float top_probability(const float *x, long n, float top) {
    float part[LANES] = {0}, total = 0.0f;
    long j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int l = 0; l < LANES; l++) part[l] += exp_f32(x[j + l] - top);
    for (; j < n; j++) total += exp_f32(x[j] - top);
    for (int l = 0; l < LANES; l++) total += part[l];
    return 1.0f / total;
}

/* The head's greedy chains of `depth` drafts for R rows (slots [R], their last tokens at positions
 * starts [R]), from each row's stored output out [R, hidden] (overwritten): draft d is the argmax
 * of the LM head over the final norm of the output before it (DraftHead.logits: the logits in the
 * activations' dtype, then float32), as the target's id; drafts past the first are fed back with
 * that output at position start + d - 1 (head_layer), writing the head's cache there. chain [R,
 * depth] int64. lengths [R]: where p_min > 0, a row's drafts before the first whose probability
 * (its logits' softmax maximum) is below p_min, else depth; the chains stop once every row's has
 * (their later entries are left unwritten). Returns as head_layer does. */
int head_chain(const PairHead *hd, int wide, void *out, long R, long depth, long hidden, long inter, float eps,
               long NH, long KVH, long D, long L, float scale, void *k_cache, void *v_cache, const int64_t *slots,
               const int64_t *starts, float p_min, int64_t *chain, int64_t *lengths) {
    long size = wide ? 4 : 2, V = hd->draft_vocab;
    int64_t *ids = malloc((size_t)(R * (16 + 4 * V + (hidden + V) * size)));
    if (!ids) return -1;
    int64_t *positions = ids + R;
    float *wide_logits = (float *)(positions + R);
    char *normed = (char *)(wide_logits + R * V), *logits = normed + R * hidden * size;
    int failed = 0;
    long open = R;      /* rows whose drafts are all above p_min so far */
    for (long r = 0; r < R; r++) lengths[r] = depth;
    for (long d = 0; d < depth && open && !failed; d++) {
        add_norm(wide, out, NULL, hd->final_norm, NULL, normed, R, hidden, eps);
        if ((failed = product(&hd->lm_head, normed, wide, R, hidden, logits, V))) break;
        for (long k = 0; k < R * V && !wide; k++) wide_logits[k] = bf16_to_f32(((bf16 *)logits)[k]);
        const float *rows = wide ? (const float *)logits : wide_logits;
        argmax_f32(rows, R, V, ids);
        for (long r = 0; r < R; r++) {
            if (p_min > 0.0f && lengths[r] == depth && top_probability(rows + r * V, V, rows[r * V + ids[r]]) < p_min) {
                lengths[r] = d;
                open--;
            }
            ids[r] += hd->d2t[ids[r]];
            chain[r * depth + d] = ids[r];
            positions[r] = starts[r] + d;
        }
        if (d + 1 < depth && open)
            failed = head_layer(hd, wide, out, ids, R, hidden, inter, eps, NH, KVH, D, L, scale, k_cache, v_cache,
                                slots, 1, positions, out);
    }
    free(ids);
    return failed;
}
