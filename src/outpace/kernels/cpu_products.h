/* Matrix products for a few rows: out [M, N] = x [M, K] @ W^T (+ bias), over weights packed once
 * at load (cpu_kernels.pack_weight), at every level (cpu_vec.h's registers).
 *
 * Packed weights: blocks of 16 output columns (the last padded with zero columns), block b at
 * b * 16 * K weights, in one of the weight formats below. A tile of TILE_VECS * VL columns and up
 * to TILE_ROWS rows keeps its sums in registers over all of K, so each weight is read from memory
 * once per call (later row tiles of a call read it from L2); tiles of columns are shared among
 * OpenMP threads. Each row's sums take one order whatever M is, so a row's result never depends on
 * the rows beside it; a dense format's order is the inputs' (0, 1, 2, ...), each product added
 * to its column's float32 sum with one rounding where the level fuses multiply and add (a bf16
 * weight times a bf16 input is exact in float32, so bf16 products are alike at every level), the
 * vdpbf16ps path apart (below).
 *
 * GGUF's quantized formats compute on int8 inputs (tile_int8: blocks of 32 inputs, Q8_0, Q4_1,
 * Q4_0, Q5_0; tile_kquant: the k-quants' super-blocks of 256, Q4_K, Q6_K): linear quantizes each
 * row of x once a call, per block of 32 inputs, as GGUF's Q8_0 does, in float32 at every level:
 *     d = max |x_i| / 127 (one rounding), q_i = x_i / d rounded half to even (|q_i| <= 127; all 0
 *     where d is 0; where the block holds a NaN or infinity, d = NaN and q = 0), s = sum q_i, and
 *     s_lo the sum of its first 16 q_i;
 * and a row's sum over a column is, input block after input block in the inputs' order (acc
 * from +0):
 *     acc = fma(d_w * d, (float)isum, acc)             isum = sum q_w,i q_i - o * s, exact int32
 *     acc = fma(m_w, d * (float)s, acc)                Q4_1 only (w = d_w q_w + m_w)
 * o the weight's offset (Q4_0: 8, Q5_0: 16, else 0; w = d_w (q_w - o)). The k-quants' sub-block
 * scales join inside the block: Q4_K's sub-block of 32 inputs is one input block (w = (d_w sc)
 * q_w - dmin_w m, q_w in 0..15, sc and m 6-bit integers, d_w and dmin_w the super-block's float16s):
 *     acc = fma((d_w * sc) * d, (float)isum, acc)      isum = sum q_w,i q_i, exact int32
 *     acc = fma(-(dmin_w * m), d * (float)s, acc)
 * and Q6_K's sub-blocks of 16 inputs (w = (d_w sc) (q_w - 32), q_w in 0..63, sc an int8 scale),
 * two an input block, its first 16 inputs (s_16 = s_lo) then its last (s_16 = s - s_lo):
 *     acc = fma(d_w * d, (float)isum, acc)      isum = sc (sum q_w,i q_i - 32 s_16), exact int32, < 2^24
 * Integer sums are exact whatever the instruction, and each float op is one IEEE rounding in that
 * fixed order, so a row's result is the same bits at every level and whatever rows share the
 * call; it differs from the float32 product over the dequantized weight by the inputs'
 * quantization (|x_i - d q_i| <= d / 2).
 *
 * A weight format is an entry of WeightFormat, a packer in cpu_kernels.py and a tile function
 * here with tile_dense's arguments; linear's switch sends each call to its format's tiles.
 */

enum WeightFormat {
    W_F32 = 0,      /* [K / 2][2][16] float32 a block: inputs 2p and 2p + 1, then the 16 columns */
    W_BF16 = 1,     /* [K / 2][16][2] bfloat16 a block: per column, inputs 2p and 2p + 1 */
    /* GGUF's blocks of 32 inputs (K a multiple of 32), regrouped per 16 columns
     * (cpu_kernels.pack_quantized): a block of columns is K / 32 groups, one per 32 inputs, each
     * float16 scales d[16] (Q4_1: then minima m[16]), then the quantized weights in runs of 4
     * inputs, a run [16 columns][4 bytes] (64 bytes: one register of 16 int32 lanes), byte j of a
     * column's 4 its input 4t + j of run t. Nibble formats hold two inputs a byte: the low nibble
     * of run t's byte j is input 4t + j, the high nibble input 16 + 4t + j. */
    W_Q8_0 = 2,     /* 544 bytes: d[16], then q[8 runs][16][4] int8; w = d * q */
    W_Q4_1 = 3,     /* 320 bytes: d[16], m[16], then q[4 runs][16][4] nibbles; w = d * q + m */
    W_Q4_0 = 4,     /* 288 bytes: d[16], then q[4 runs][16][4] nibbles; w = d * (q - 8) */
    W_Q5_0 = 5,     /* 352 bytes: d[16], then fifth bits high[4 runs][2] uint64 (bit 4c + j: column c's
                     * input 4t + j, then 16 + 4t + j), then q[4 runs][16][4] nibbles (the low 4
                     * bits); w = d * (q - 16) */
    /* GGUF's k-quants, super-blocks of 256 inputs (K a multiple of 256), each column's block of the
     * file regrouped per 16 columns (cpu_kernels.pack_quantized): a block of columns is K / 256
     * groups, one per 256 inputs, each the blocks' parts below: float16 values side by side, scale
     * bytes transposed (byte k of column c at [k][c]), quantized bytes in runs of 4 as the formats
     * of 32 inputs hold them (run u [16 columns][4 bytes]: the column's bytes 4u .. 4u + 3) */
    W_Q4_K = 6,     /* 2304 bytes: d[16], dmin[16] float16, scales[12][16] (GGUF's 6-bit scale sc and
                     * minimum m of each 32 inputs), q[32 runs][16][4]: inputs 64g + i (low nibble) and
                     * 64g + 32 + i (high) in byte 32g + i; w = (d * sc) * q - dmin * m */
    W_Q6_K = 7,     /* 3360 bytes: d[16] float16, scales[16][16] int8 (one a 16 inputs), then the 6-bit
                     * values q in 16 quads of 3 runs, quad u the inputs 16u .. 16u + 15 (sub-block u):
                     * run r (0, 1, 2) holds input 16u + 4r + j's q in bits 0-5 of byte j, and bits 6-7
                     * of run r's byte j hold bits 2r, 2r + 1 of input 16u + 12 + j's q;
                     * w = (d * scale) * (q - 32) */
};
#define Q8_0_GROUP_BYTES 544
#define Q4_1_GROUP_BYTES 320
#define Q4_0_GROUP_BYTES 288
#define Q5_0_GROUP_BYTES 352
static inline long group_bytes_of(int format) {
    return format == W_Q8_0 ? Q8_0_GROUP_BYTES : format == W_Q4_1 ? Q4_1_GROUP_BYTES
           : format == W_Q4_0 ? Q4_0_GROUP_BYTES : Q5_0_GROUP_BYTES;
}

_Static_assert(16 % VL == 0 && TILE_VECS * VL % 16 == 0, "a tile holds whole blocks of 16 columns");
_Static_assert(TILE_ROWS <= 12, "tiles_dense's cases reach 12 rows");
_Static_assert(QUANT_ROWS <= 6 && QUANT_ROWS <= TILE_ROWS, "tiles_int8's and tiles_kquant's cases reach 6 rows");
#ifndef Q6_K_ROWS
#define Q6_K_ROWS QUANT_ROWS
#endif
_Static_assert(Q6_K_ROWS <= QUANT_ROWS, "tiles_kquant's cases reach QUANT_ROWS rows");
#define TILE_COLS (TILE_VECS * VL)
#define Q4_K_GROUP_BYTES 2304
#define Q6_K_GROUP_BYTES 3360
static inline long kquant_group_bytes(int format) { return format == W_Q4_K ? Q4_K_GROUP_BYTES : Q6_K_GROUP_BYTES; }

/* A tile's sums [rows][TILE_COLS] plus the bias (float32, NULL: none) into out [rows, N] from
 * its first column, float32 when wide_out, else rounded to bfloat16; columns from `cols` on are
 * not stored. Called once a tile, out of line: the tiles' loops stay small to compile. */
static __attribute__((noinline)) void store_sums(const float sums[TILE_ROWS][TILE_COLS], long rows, long cols,
                                                 const float *bias, void *out, int wide_out, long N) {
    for (long m = 0; m < rows; m++) {
        for (long c = 0; c < cols; c++) {
            float s = bias ? sums[m][c] + bias[c] : sums[m][c];
            if (wide_out) ((float *)out)[m * N + c] = s;
            else ((bf16 *)out)[m * N + c] = f32_to_bf16(s);
        }
    }
}

/* the registers of sums acc[rows][vecs] to store_sums (loops over constants, unrolled: the sums
 * stay in registers until here) */
static inline __attribute__((always_inline)) void store_acc(VF acc[TILE_ROWS][TILE_VECS], long rows, int vecs,
                                                            const float *bias, long n_valid, void *out,
                                                            int wide_out, long N) {
    float sums[TILE_ROWS][TILE_COLS];
#pragma GCC unroll 16
    for (int m = 0; m < TILE_ROWS; m++) {
#pragma GCC unroll 16
        for (int v = 0; v < TILE_VECS; v++) {
            if (m < rows && v < vecs) vf_store(sums[m] + v * VL, acc[m][v]);
        }
    }
    store_sums(sums, rows, vecs * VL < n_valid ? vecs * VL : n_valid, bias, out, wide_out, N);
}

/* W_F32 (wide) or W_BF16 weights, float32 inputs x [rows, K]: per pair of inputs, each block's
 * 16 columns of both inputs' weights are loaded (bfloat16 ones widened in registers) and
 * multiplied with the row's two inputs broadcast. */
static inline __attribute__((always_inline)) void tile_dense(const float *x, long K, const char *w, int wide,
                                                             long rows, int vecs, const float *bias, long n_valid,
                                                             void *out, int wide_out, long N) {
    long pairs = K / 2, pair_bytes = wide ? 128 : 64, block_bytes = pairs * pair_bytes;
    VF acc[TILE_ROWS][TILE_VECS];
#pragma GCC unroll 16
    for (int m = 0; m < TILE_ROWS; m++) {
#pragma GCC unroll 16
        for (int v = 0; v < TILE_VECS; v++) acc[m][v] = vf_zero();
    }
    for (long p = 0; p < pairs; p++) {
        VF even[TILE_VECS], odd[TILE_VECS];
#pragma GCC unroll 16
        for (int v = 0; v < TILE_VECS; v++) {
            if (v >= vecs) continue;
            int c = v * VL % 16;                            /* its first column in its block */
            const char *at = w + v * VL / 16 * block_bytes + p * pair_bytes;
            if (c == 0) {
                __builtin_prefetch(at + PREFETCH_BYTES, 0, 2);
                if (wide) __builtin_prefetch(at + PREFETCH_BYTES + 64, 0, 2);
            }
            if (wide) {
                even[v] = vf_load((const float *)at + c);
                odd[v] = vf_load((const float *)at + 16 + c);
            } else {
                vf_widen_pairs((const bf16 *)at + 2 * c, &even[v], &odd[v]);
            }
        }
#pragma GCC unroll 16
        for (int m = 0; m < TILE_ROWS; m++) {
            if (m >= rows) continue;
            VF x0 = vf_set1(x[m * K + 2 * p]), x1 = vf_set1(x[m * K + 2 * p + 1]);
#pragma GCC unroll 16
            for (int v = 0; v < TILE_VECS; v++) {
                if (v >= vecs) continue;
                acc[m][v] = vf_fma(x0, even[v], acc[m][v]);
                acc[m][v] = vf_fma(x1, odd[v], acc[m][v]);
            }
        }
    }
    store_acc(acc, rows, vecs, bias, n_valid, out, wide_out, N);
}

/* A call's rows as int8 blocks (quantize_rows), row m's block j at [m * K + 32 j] and
 * [m * K / 32 + j] */
typedef struct {
    const int8_t *q;        /* [rows][K] */
    const float *d;         /* [rows][K / 32] the blocks' scales */
    const int32_t *sum;     /* [rows][K / 32] sum of the block's q */
    const float *d_sum;     /* [rows][K / 32] d * (float)sum, Q4_1's and Q4_K's minimum term */
    const int32_t *half_sum;    /* [rows][K / 32] sum of the block's first 16 q (Q6_K's sub-blocks) */
} QuantRows;

/* x [M, K] (float32 when wide, else bfloat16) into `into`'s arrays, as the top of this file says.
 * Written for the compiler to vectorise each block's loops (max |x| as the integer maximum of the
 * values' bits without their sign: the same order as floats', NaN above infinity above the rest;
 * IEEE division and rounding lane by lane), so every level computes the same bits. Rows are
 * shared among OpenMP threads for prompt chunks. */
static void quantize_rows(const void *x, int wide, long M, long K, QuantRows into) {
    long groups = K / 32;
#pragma omp parallel for schedule(static) if (M * K >= PARALLEL_MIN_VALUES)
    for (long g = 0; g < M * groups; g++) {
        float v[32];
        if (wide) memcpy(v, (const float *)x + g * 32, sizeof v);
        else for (int i = 0; i < 32; i++) v[i] = bf16_to_f32(((const bf16 *)x)[g * 32 + i]);
        uint32_t top = 0;
        for (int i = 0; i < 32; i++) {
            uint32_t bits;
            memcpy(&bits, v + i, sizeof bits);
            bits &= 0x7fffffffu;
            top = bits > top ? bits : top;
        }
        float amax, d;
        memcpy(&amax, &top, sizeof amax);
        int finite = top < 0x7f800000u;
        d = finite ? amax / 127.0f : NAN;
        int8_t *q = (int8_t *)into.q + g * 32;
        int32_t sum = 0, half_sum = 0;
        if (finite && d > 0.0f) {
            int32_t qi[32];     /* summed as int32 lanes: a sum over the int8 stores takes a byte extract each */
            for (int i = 0; i < 32; i++) qi[i] = (int32_t)rintf(v[i] / d);
            for (int i = 0; i < 32; i++) q[i] = (int8_t)qi[i];
            for (int i = 0; i < 16; i++) half_sum += qi[i];
            sum = half_sum;
            for (int i = 16; i < 32; i++) sum += qi[i];
        } else {
            memset(q, 0, 32);
        }
        ((float *)into.d)[g] = d;
        ((int32_t *)into.sum)[g] = sum;
        ((int32_t *)into.half_sum)[g] = half_sum;
        ((float *)into.d_sum)[g] = d * (float)sum;
    }
}

/* a tile's integer sums isum[rows][vecs] held in registers here (cpu_vec.h's vi_keep), after each
 * run of 4 inputs */
#define KEEP_SUMS(isum, rows, vecs) \
    _Pragma("GCC unroll 16") for (int m_ = 0; m_ < TILE_ROWS; m_++) \
        _Pragma("GCC unroll 16") for (int v_ = 0; v_ < TILE_VECS; v_++) \
            if (m_ < (rows) && v_ < (vecs)) vi_keep(&(isum)[m_][v_]);

/* one run of 4 inputs: each row's 4 inputs (at in + m * K) broadcast as one int32 and their
 * products with the run's weights q summed into the row's sums, vi_sum16_u8's 16-bit ones (sum16;
 * unsigned weights) or vi_dot_s8's int32 ones */
static inline __attribute__((always_inline)) void run_products(VI sums[TILE_ROWS][TILE_VECS], const VI q[TILE_VECS],
                                                               const int8_t *in, long K, int sum16, long rows,
                                                               int vecs) {
#pragma GCC unroll 16
    for (int m = 0; m < TILE_ROWS; m++) {
        if (m >= rows) continue;
        int32_t x4;
        memcpy(&x4, in + m * K, sizeof x4);
#pragma GCC unroll 16
        for (int v = 0; v < TILE_VECS; v++) {
            if (v < vecs) sums[m][v] = sum16 ? vi_sum16_u8(sums[m][v], q[v], x4) : vi_dot_s8(sums[m][v], q[v], x4);
        }
    }
    KEEP_SUMS(sums, rows, vecs)
}

/* W_Q8_0, W_Q4_1, W_Q4_0 or W_Q5_0 weights over rows quantized to int8: per group of 32 inputs,
 * the runs of 4 inputs' weights are loaded (nibbles split, Q5_0's fifth bits set) and each row's 4
 * inputs broadcast as one int32, their products summed in int32 lanes (vi_dot_*); then each
 * block's sums join the float32 sums as the top of this file says. */
static inline __attribute__((always_inline)) void tile_int8(QuantRows xq, long K, const char *w, int format,
                                                            long rows, int vecs, const float *bias, long n_valid,
                                                            void *out, int wide_out, long N) {
    long groups = K / 32, group_bytes = group_bytes_of(format);
    long block_bytes = groups * group_bytes;
    /* o of the top of this file, plus vi_dot_s8's offset for Q8_0 */
    int offset = format == W_Q4_0 ? 8 : format == W_Q5_0 ? 16 : format == W_Q8_0 ? DOT_S8_OFFSET : 0;
    VF acc[TILE_ROWS][TILE_VECS];
#pragma GCC unroll 16
    for (int m = 0; m < TILE_ROWS; m++) {
#pragma GCC unroll 16
        for (int v = 0; v < TILE_VECS; v++) acc[m][v] = vf_zero();
    }
    for (long j = 0; j < groups; j++) {
        VI isum[TILE_ROWS][TILE_VECS];
        const char *at[TILE_VECS];
        int c[TILE_VECS];                                   /* a register's first column in its block */
#pragma GCC unroll 16
        for (int v = 0; v < TILE_VECS; v++) {
            if (v >= vecs) continue;
            c[v] = v * VL % 16;
            at[v] = w + v * VL / 16 * block_bytes + j * group_bytes;
            if (c[v] == 0 && block_bytes < PREFETCH_STREAMS_UNDER) {
                for (long line = 0; line < group_bytes; line += 64) __builtin_prefetch(at[v] + PREFETCH_BYTES + line, 0, 2);
            }
#pragma GCC unroll 16
            for (int m = 0; m < TILE_ROWS; m++) isum[m][v] = vi_zero();
        }
        const int8_t *in = xq.q + 32 * j;
        if (format == W_Q8_0) {
            for (int t = 0; t < 8; t++) {
                VI q[TILE_VECS];
#pragma GCC unroll 16
                for (int v = 0; v < TILE_VECS; v++) {
                    if (v < vecs) q[v] = vi_load(at[v] + 32 + 64 * t + 4 * c[v]);
                }
                run_products(isum, q, in + 4 * t, K, 0, rows, vecs);
            }
        } else {
            long start = format == W_Q4_1 ? 64 : format == W_Q5_0 ? 96 : 32;
            for (int t = 0; t < 4; t++) {
                VI low[TILE_VECS], high[TILE_VECS];
#pragma GCC unroll 16
                for (int v = 0; v < TILE_VECS; v++) {
                    if (v >= vecs) continue;
                    VI q = vi_load(at[v] + start + 64 * t + 4 * c[v]);
                    low[v] = vi_low_nibbles(q);
                    high[v] = vi_high_nibbles(q);
                    if (format == W_Q5_0) {
                        uint64_t fifth[2];
                        memcpy(fifth, at[v] + 32 + 16 * t, sizeof fifth);
                        low[v] = vi_fifth_bits(low[v], fifth[0] >> 4 * c[v]);
                        high[v] = vi_fifth_bits(high[v], fifth[1] >> 4 * c[v]);
                    }
                }
#pragma GCC unroll 16
                for (int m = 0; m < TILE_ROWS; m++) {
                    if (m >= rows) continue;
                    int32_t x_low, x_high;
                    memcpy(&x_low, in + m * K + 4 * t, sizeof x_low);
                    memcpy(&x_high, in + m * K + 16 + 4 * t, sizeof x_high);
#pragma GCC unroll 16
                    for (int v = 0; v < TILE_VECS; v++) {
                        if (v >= vecs) continue;
                        isum[m][v] = vi_dot_u8(isum[m][v], low[v], x_low);
                        isum[m][v] = vi_dot_u8(isum[m][v], high[v], x_high);
                    }
                }
                KEEP_SUMS(isum, rows, vecs)
            }
        }
        VF scale[TILE_VECS], minimum[TILE_VECS];
#pragma GCC unroll 16
        for (int v = 0; v < TILE_VECS; v++) {
            if (v >= vecs) continue;
            scale[v] = vf_load_half((const uint16_t *)at[v] + c[v]);
            if (format == W_Q4_1) minimum[v] = vf_load_half((const uint16_t *)at[v] + 16 + c[v]);
        }
#pragma GCC unroll 16
        for (int m = 0; m < TILE_ROWS; m++) {
            if (m >= rows) continue;
            long b = m * groups + j;
            VF d = vf_set1(xq.d[b]);
            VI shift = vi_set1(offset * xq.sum[b]);
#pragma GCC unroll 16
            for (int v = 0; v < TILE_VECS; v++) {
                if (v >= vecs) continue;
                VI exact = offset ? vi_sub(isum[m][v], shift) : isum[m][v];
                acc[m][v] = vf_fmadd(vf_mul(scale[v], d), vf_of_vi(exact), acc[m][v]);
                if (format == W_Q4_1) acc[m][v] = vf_fmadd(minimum[v], vf_set1(xq.d_sum[b]), acc[m][v]);
            }
        }
    }
    store_acc(acc, rows, vecs, bias, n_valid, out, wide_out, N);
}

/* GGUF's 6-bit scale sc and minimum m of each sub-block j (inputs 32j .. 32j + 31) of a block of 16
 * columns whose 12 scale bytes b[16k + c] (k = 0..11) start at b, as bytes: into[0][j][c] = sc,
 * into[1][j][c] = m (the first four sub-blocks' whole in a byte, the last four's split into 4 and
 * 2 bits). One pass over all 16 columns the compiler vectorises: taking each sub-block's bits
 * apart in float lanes had taken up to a third of a one-row product's time (down 8960 -> 1536 on
 * an AMD EPYC). */
static inline __attribute__((always_inline)) void q4_k_unpack(const uint8_t *b, uint8_t into[2][8][16]) {
    for (int j = 0; j < 4; j++) {
        for (int c = 0; c < 16; c++) {
            into[0][j][c] = b[16 * j + c] & 63;
            into[1][j][c] = b[16 * (j + 4) + c] & 63;
            into[0][j + 4][c] = (b[16 * (j + 8) + c] & 15) | (uint8_t)(b[16 * j + c] >> 6 << 4);
            into[1][j + 4][c] = (b[16 * (j + 8) + c] >> 4) | (uint8_t)(b[16 * (j + 4) + c] >> 6 << 4);
        }
    }
}

/* W_Q4_K's scale (d * sc) and negated minimum (-(dmin * m)) of sub-block j of the columns from c of
 * a block q4_k_unpack took apart, with d and -dmin: each integer exact as a float, then one
 * rounding each ((-dmin) * m = -(dmin * m), bit for bit). */
static inline __attribute__((always_inline)) void q4_k_scales(const uint8_t unpacked[2][8][16], int c, int j, VF d,
                                                              VF neg_dmin, VF *scale, VF *low) {
    *scale = vf_mul(d, vf_widen_bits(unpacked[0][j] + c, 0, 63));
    *low = vf_mul(neg_dmin, vf_widen_bits(unpacked[1][j] + c, 0, 63));
}

/* A tile's W_Q4_K scales and negated minima, as tile_kquant computes them, into [K / 32][2][TILE_COLS]
 * (block b's scales of the tile's columns, then its minima): once a tile for a call whose rows take
 * several row tiles, which then read them instead of unpacking each (with SUM16, 64-row Q4_K
 * products 1.17-1.19x faster on an AMD EPYC) */
static void q4_k_tile_scales(const char *w, long K, int vecs, float *into) {
    long groups = K / 256, block_bytes = groups * Q4_K_GROUP_BYTES;
    for (long g = 0; g < groups; g++) {
        uint8_t unpacked[2][8][16];         /* v's block of 16 columns, unpacked at the block's first register */
        for (int v = 0; v < vecs; v++) {
            int c = v * VL % 16;
            const char *at = w + v * VL / 16 * block_bytes + g * Q4_K_GROUP_BYTES;
            VF d = vf_load_half((const uint16_t *)at + c);
            VF neg_dmin = vf_mul(vf_load_half((const uint16_t *)at + 16 + c), vf_set1(-1.0f));
            if (c == 0) q4_k_unpack((const uint8_t *)at + 64, unpacked);
            for (int j = 0; j < 8; j++) {
                VF scale, low;
                q4_k_scales(unpacked, c, j, d, neg_dmin, &scale, &low);
                float *block = into + (8 * g + j) * 2 * TILE_COLS + v * VL;
                vf_store(block, scale);
                vf_store(block + TILE_COLS, low);
            }
        }
    }
}

/* run t of a W_Q4_K sub-block j (inputs 32 j + 4 t .. + 3 and their weights: the tile's run 8 (j / 2)
 * + t, nibble j % 2): its products into the rows' 16-bit sums isum (vi_sum16_u8) */
static inline __attribute__((always_inline)) void q4_k_run(VI isum[TILE_ROWS][TILE_VECS], const char *at[TILE_VECS],
                                                           const int c[TILE_VECS], const int8_t *in, long K, int j,
                                                           int t, long rows, int vecs) {
    VI q[TILE_VECS];
#pragma GCC unroll 16
    for (int v = 0; v < TILE_VECS; v++) {
        if (v < vecs) q[v] = vi_byte_bits(vi_load(at[v] + 256 + 64 * (8 * (j / 2) + t) + 4 * c[v]), 4 * (j % 2), 15);
    }
    run_products(isum, q, in + 4 * t, K, 1, rows, vecs);
}

/* W_Q4_K or W_Q6_K weights over rows quantized to int8: per block of 32 inputs (Q4_K's sub-block,
 * Q6_K's two sub-blocks of 16), the runs of 4 inputs' weights are loaded (nibbles split, Q6_K's
 * fourth run joined from the top bits of its quad's three), each row's 4 inputs broadcast as one
 * int32 and their products summed in int32 lanes (vi_dot_u8's products: the values are unsigned,
 * at most 63; in 16-bit sums over SUM16_RUNS runs, then widened); then each block joins the
 * float32 sums as the top of this file says. */
static inline __attribute__((always_inline)) void tile_kquant(QuantRows xq, long K, const char *w, int format,
                                                              const float *scales, long rows, int vecs,
                                                              const float *bias, long n_valid, void *out,
                                                              int wide_out, long N) {
    long groups = K / 256, blocks = K / 32, group_bytes = kquant_group_bytes(format), block_bytes = groups * group_bytes;
    VF acc[TILE_ROWS][TILE_VECS];
#pragma GCC unroll 16
    for (int m = 0; m < TILE_ROWS; m++) {
#pragma GCC unroll 16
        for (int v = 0; v < TILE_VECS; v++) acc[m][v] = vf_zero();
    }
    for (long g = 0; g < groups; g++) {
        const char *at[TILE_VECS];
        int c[TILE_VECS];                                   /* a register's first column in its block */
        VF d[TILE_VECS], neg_dmin[TILE_VECS];
        uint8_t unpacked[TILE_COLS / 16][2][8][16];         /* Q4_K's, per block of 16 columns (q4_k_unpack) */
#pragma GCC unroll 16
        for (int v = 0; v < TILE_VECS; v++) {
            if (v >= vecs) continue;
            c[v] = v * VL % 16;
            at[v] = w + v * VL / 16 * block_bytes + g * group_bytes;
            if (c[v] == 0 && block_bytes < PREFETCH_STREAMS_UNDER) {
                for (long line = 0; line < group_bytes; line += 64) __builtin_prefetch(at[v] + PREFETCH_BYTES + line, 0, 2);
            }
            d[v] = vf_load_half((const uint16_t *)at[v] + c[v]);
            if (format == W_Q4_K) neg_dmin[v] = vf_mul(vf_load_half((const uint16_t *)at[v] + 16 + c[v]), vf_set1(-1.0f));
            if (format == W_Q4_K && !scales && c[v] == 0) q4_k_unpack((const uint8_t *)at[v] + 64, unpacked[v * VL / 16]);
        }
        for (int j = 0; j < 8; j++) {           /* the group's block j of 32 inputs: the rows' block 8g + j */
            long b = 8 * g + j;
            const int8_t *in = xq.q + 32 * b;
            VI isum[TILE_ROWS][TILE_VECS];
            if (format == W_Q4_K) {             /* sub-block j: runs 8 (j / 2) + t, nibble j % 2 */
#pragma GCC unroll 16
                for (int m = 0; m < TILE_ROWS; m++) {
#pragma GCC unroll 16
                    for (int v = 0; v < TILE_VECS; v++) isum[m][v] = vi_zero();
                }
                _Static_assert(SUM16_RUNS(15) >= 8, "a 16-bit sum takes a Q4_K sub-block's 8 runs");
                if (rows >= UNROLL_RUNS_FROM) {
#pragma GCC unroll 8
                    for (int t = 0; t < 8; t++) q4_k_run(isum, at, c, in, K, j, t, rows, vecs);
                } else {
                    for (int t = 0; t < 8; t++) q4_k_run(isum, at, c, in, K, j, t, rows, vecs);
                }
#pragma GCC unroll 16
                for (int m = 0; m < TILE_ROWS; m++) {
#pragma GCC unroll 16
                    for (int v = 0; v < TILE_VECS; v++) isum[m][v] = vi_add_sum16(vi_zero(), isum[m][v]);
                }
                VF scale[TILE_VECS], low[TILE_VECS];
#pragma GCC unroll 16
                for (int v = 0; v < TILE_VECS; v++) {
                    if (v >= vecs) continue;
                    if (scales) {
                        scale[v] = vf_load(scales + 2 * b * TILE_COLS + v * VL);
                        low[v] = vf_load(scales + (2 * b + 1) * TILE_COLS + v * VL);
                    } else {
                        q4_k_scales(unpacked[v * VL / 16], c[v], j, d[v], neg_dmin[v], &scale[v], &low[v]);
                    }
                }
#pragma GCC unroll 16
                for (int m = 0; m < TILE_ROWS; m++) {
                    if (m >= rows) continue;
                    VF dx = vf_set1(xq.d[m * blocks + b]), dx_sum = vf_set1(xq.d_sum[m * blocks + b]);
#pragma GCC unroll 16
                    for (int v = 0; v < TILE_VECS; v++) {
                        if (v >= vecs) continue;
                        acc[m][v] = vf_fmadd(vf_mul(scale[v], dx), vf_of_vi(isum[m][v]), acc[m][v]);
                        acc[m][v] = vf_fmadd(low[v], dx_sum, acc[m][v]);
                    }
                }
                continue;
            }
            /* Q6_K: sub-block 2j + half is quad 2j + half: its first three runs in the bits 0-5
             * of runs 0-2, the fourth joined from their bits 6-7 */
            for (int half = 0; half < 2; half++) {
#pragma GCC unroll 16
                for (int m = 0; m < TILE_ROWS; m++) {
#pragma GCC unroll 16
                    for (int v = 0; v < TILE_VECS; v++) isum[m][v] = vi_zero();
                }
                VI q[4][TILE_VECS];
#pragma GCC unroll 16
                for (int v = 0; v < TILE_VECS; v++) {
                    if (v >= vecs) continue;
                    const char *quad = at[v] + 288 + 192 * (2 * j + half) + 4 * c[v];
                    VI r0 = vi_load(quad), r1 = vi_load(quad + 64), r2 = vi_load(quad + 128);
                    q[0][v] = vi_byte_bits(r0, 0, 63);
                    q[1][v] = vi_byte_bits(r1, 0, 63);
                    q[2][v] = vi_byte_bits(r2, 0, 63);
                    q[3][v] = vi_or(vi_or(vi_byte_bits(r0, 6, 3), vi_byte_bits(r1, 4, 12)), vi_byte_bits(r2, 2, 48));
                }
                int per_sum = SUM16_RUNS(63);       /* runs a 16-bit sum takes */
                VI s16[TILE_ROWS][TILE_VECS];
#pragma GCC unroll 16
                for (int m = 0; m < TILE_ROWS; m++) {
#pragma GCC unroll 16
                    for (int v = 0; v < TILE_VECS; v++) s16[m][v] = vi_zero();
                }
#pragma GCC unroll 4
                for (int t = 0; t < 4; t++) {
                    run_products(s16, q[t], in + 16 * half + 4 * t, K, 1, rows, vecs);
                    if ((t + 1) % per_sum && t < 3) continue;
#pragma GCC unroll 16
                    for (int m = 0; m < TILE_ROWS; m++) {
#pragma GCC unroll 16
                        for (int v = 0; v < TILE_VECS; v++) {
                            isum[m][v] = vi_add_sum16(isum[m][v], s16[m][v]);
                            s16[m][v] = vi_zero();
                        }
                    }
                }
                VI scale[TILE_VECS];
#pragma GCC unroll 16
                for (int v = 0; v < TILE_VECS; v++) {
                    if (v < vecs) scale[v] = vi_widen_i8((const int8_t *)at[v] + 32 + 16 * (2 * j + half) + c[v]);
                }
#pragma GCC unroll 16
                for (int m = 0; m < TILE_ROWS; m++) {
                    if (m >= rows) continue;
                    int32_t s = xq.half_sum[m * blocks + b];     /* the block's first 16 inputs' sum */
                    VI offset = vi_set1(32 * (half ? xq.sum[m * blocks + b] - s : s));
                    VF dx = vf_set1(xq.d[m * blocks + b]);
#pragma GCC unroll 16
                    for (int v = 0; v < TILE_VECS; v++) {
                        if (v >= vecs) continue;
                        VI part = vi_mul(vi_sub(isum[m][v], offset), scale[v]);
                        acc[m][v] = vf_fmadd(vf_mul(d[v], dx), vf_of_vi(part), acc[m][v]);
                    }
                }
            }
        }
    }
    store_acc(acc, rows, vecs, bias, n_valid, out, wide_out, N);
}

#ifdef __AVX512BF16__
/* W_BF16 weights and bfloat16 inputs with vdpbf16ps: a lane of a pair's load holds one column's
 * weights of inputs 2p and 2p + 1, the row's two inputs are broadcast as one 32-bit value, and one
 * instruction adds both products to the column's float32 sum (the odd input's product first,
 * each rounded into it): half the instructions of two FMAs, and no widening. */
static inline __attribute__((always_inline)) void tile_dot_bf16(const bf16 *x, long K, const char *w, long rows,
                                                                int vecs, const float *bias, long n_valid,
                                                                bf16 *out, long N) {
    long pairs = K / 2, block_bytes = pairs * 64;
    __m512 acc[TILE_ROWS][TILE_VECS];
#pragma GCC unroll 16
    for (int m = 0; m < TILE_ROWS; m++) {
#pragma GCC unroll 16
        for (int v = 0; v < TILE_VECS; v++) acc[m][v] = _mm512_setzero_ps();
    }
    for (long p = 0; p < pairs; p++) {
        __m512bh wv[TILE_VECS];
#pragma GCC unroll 16
        for (int v = 0; v < TILE_VECS; v++) {
            if (v >= vecs) continue;
            const char *at = w + v * block_bytes + p * 64;
            __builtin_prefetch(at + PREFETCH_BYTES, 0, 2);
            wv[v] = (__m512bh)_mm512_loadu_si512(at);
        }
#pragma GCC unroll 16
        for (int m = 0; m < TILE_ROWS; m++) {
            if (m >= rows) continue;
            int32_t both;
            memcpy(&both, x + m * K + 2 * p, sizeof both);
            __m512bh xp = (__m512bh)_mm512_set1_epi32(both);
#pragma GCC unroll 16
            for (int v = 0; v < TILE_VECS; v++) {
                if (v < vecs) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], xp, wv[v]);
            }
        }
    }
    store_acc(acc, rows, vecs, bias, n_valid, out, 0, N);
}
#endif

/* each tile shape (rows, whole or partial tile, format) as its own loop, its sums in registers */
#define DENSE(R, V) if (wide) tile_dense(x, K, w, 1, R, V, bias, n_valid, out, wide_out, N); \
                    else tile_dense(x, K, w, 0, R, V, bias, n_valid, out, wide_out, N);
#define DENSE_CASE(R) case R: if (R > TILE_ROWS) break;    /* never: rows <= TILE_ROWS */ \
                      if (TILE_COLS == 16 || vecs == TILE_VECS) { DENSE(R, TILE_VECS) } else { DENSE(R, vecs) } break;

static void tiles_dense(const float *x, long K, const char *w, int wide, long rows, int vecs, const float *bias,
                        long n_valid, void *out, int wide_out, long N) {
    switch (rows) {
        DENSE_CASE(1) DENSE_CASE(2) DENSE_CASE(3) DENSE_CASE(4) DENSE_CASE(5) DENSE_CASE(6)
        DENSE_CASE(7) DENSE_CASE(8) DENSE_CASE(9) DENSE_CASE(10) DENSE_CASE(11) DENSE_CASE(12)
    }
}

#define QUANT(R, V) if (format == W_Q8_0) tile_int8(xq, K, w, W_Q8_0, R, V, bias, n_valid, out, wide_out, N); \
                    else if (format == W_Q4_1) tile_int8(xq, K, w, W_Q4_1, R, V, bias, n_valid, out, wide_out, N); \
                    else if (format == W_Q4_0) tile_int8(xq, K, w, W_Q4_0, R, V, bias, n_valid, out, wide_out, N); \
                    else tile_int8(xq, K, w, W_Q5_0, R, V, bias, n_valid, out, wide_out, N);
#define QUANT_CASE(R) case R: if (R > QUANT_ROWS) break; \
                      if (TILE_COLS == 16 || vecs == TILE_VECS) { QUANT(R, TILE_VECS) } else { QUANT(R, vecs) } break;

static void tiles_int8(QuantRows xq, long K, const char *w, int format, long rows, int vecs, const float *bias,
                       long n_valid, void *out, int wide_out, long N) {
    switch (rows) {
        QUANT_CASE(1) QUANT_CASE(2) QUANT_CASE(3) QUANT_CASE(4) QUANT_CASE(5) QUANT_CASE(6)
    }
}

#define KQUANT(R, V) if (format == W_Q4_K) tile_kquant(xq, K, w, W_Q4_K, scales, R, V, bias, n_valid, out, wide_out, N); \
                     else tile_kquant(xq, K, w, W_Q6_K, NULL, R, V, bias, n_valid, out, wide_out, N);
#define KQUANT_CASE(R) case R: if (R > QUANT_ROWS) break; \
                       if (TILE_COLS == 16 || vecs == TILE_VECS) { KQUANT(R, TILE_VECS) } else { KQUANT(R, vecs) } break;

static void tiles_kquant(QuantRows xq, long K, const char *w, int format, const float *scales, long rows, int vecs,
                         const float *bias, long n_valid, void *out, int wide_out, long N) {
    switch (rows) {
        KQUANT_CASE(1) KQUANT_CASE(2) KQUANT_CASE(3) KQUANT_CASE(4) KQUANT_CASE(5) KQUANT_CASE(6)
    }
}

#ifdef __AVX512BF16__
#define DOT(R, V) tile_dot_bf16(x, K, w, R, V, bias, n_valid, out, N);
#define DOT_CASE(R) case R: if (vecs == TILE_VECS) { DOT(R, TILE_VECS) } else { DOT(R, vecs) } break;

static void tiles_dot_bf16(const bf16 *x, long K, const char *w, long rows, int vecs, const float *bias,
                           long n_valid, bf16 *out, long N) {
    switch (rows) {
        DOT_CASE(1) DOT_CASE(2) DOT_CASE(3) DOT_CASE(4) DOT_CASE(5) DOT_CASE(6)
        DOT_CASE(7) DOT_CASE(8) DOT_CASE(9) DOT_CASE(10) DOT_CASE(11) DOT_CASE(12)
    }
}
#endif

/* 1 where bfloat16 inputs over W_BF16 weights run on vdpbf16ps (tile_dot_bf16), else 0 */
int linear_bf16_dot(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

/* out [M, N] = x [M, K] @ W^T + bias, W packed in `format`, K even (a multiple of 32 for GGUF's
 * formats, of 256 for its k-quants); x and out float32 when wide_io, else bfloat16; bias float32 or
 * NULL; out's rows out_stride values apart (>= N: a part of a wider result). Returns 0, -1 when
 * memory for x quantized to int8 (GGUF's formats) or widened to float32 (bfloat16 x, other formats
 * but vdpbf16ps') ran out, -2 for an unknown format or a K it cannot take. */
int linear(const void *x, int wide_io, long M, long K, const void *w, int format, long N, const float *bias,
           void *out, long out_stride) {
    int quant = format == W_Q8_0 || format == W_Q4_1 || format == W_Q4_0 || format == W_Q5_0;
    int kquant = format == W_Q4_K || format == W_Q6_K;
    if ((format != W_F32 && format != W_BF16 && !quant && !kquant) || K % (kquant ? 256 : quant ? 32 : 2)) return -2;
    long tiles = (N + TILE_COLS - 1) / TILE_COLS, padded = (N + 15) / 16 * 16;
    long most_rows = format == W_Q6_K ? Q6_K_ROWS : quant || kquant ? QUANT_ROWS : TILE_ROWS;
    long parts = (M + most_rows - 1) / most_rows, per_part = (M + parts - 1) / parts;
    long column_bytes = format == W_F32 ? 4 * K : format == W_BF16 ? 2 * K      /* a block's bytes / 16 */
                        : kquant ? K / 256 * kquant_group_bytes(format) / 16 : K / 32 * group_bytes_of(format) / 16;
    long out_size = wide_io ? 4 : 2;
    int dot = 0;
#ifdef __AVX512BF16__
    dot = !wide_io && format == W_BF16;
#endif
    const float *x_f32 = x;
    void *scratch = NULL;
    QuantRows xq = {0};
    if (quant || kquant) {  /* q, then d, sum, d_sum and half_sum: 4-byte values after M * K bytes (K % 32 == 0) */
        long blocks = M * K / 32;
        scratch = malloc((size_t)(M * K + 16 * blocks));
        if (!scratch) return -1;
        xq.q = scratch;
        xq.d = (const float *)((char *)scratch + M * K);
        xq.sum = (const int32_t *)(xq.d + blocks);
        xq.d_sum = (const float *)(xq.sum + blocks);
        xq.half_sum = (const int32_t *)(xq.d_sum + blocks);
        quantize_rows(x, wide_io, M, K, xq);
    } else if (!wide_io && !dot) {
        float *widened = malloc(sizeof(float) * (size_t)(M * K));
        if (!widened) return -1;
        for (long i = 0; i < M * K; i++) widened[i] = bf16_to_f32(((const bf16 *)x)[i]);
        x_f32 = scratch = widened;
    }
#pragma omp parallel if (tiles > 1)
    {
    /* a thread's Q4_K tile scales (NULL: the tiles unpack their own) where rows take several row tiles */
    float *scales = format == W_Q4_K && parts > 1 ? malloc(sizeof(float) * (size_t)(K / 32 * 2 * TILE_COLS)) : NULL;
#pragma omp for schedule(static)
    for (long t = 0; t < tiles; t++) {
        long col = t * TILE_COLS;
        int vecs = (int)((padded - col < TILE_COLS ? padded - col : TILE_COLS) / VL);
        const char *w_t = (const char *)w + col * column_bytes;
        const float *bias_t = bias ? bias + col : NULL;
        if (scales) q4_k_tile_scales(w_t, K, vecs, scales);
        for (long m0 = 0; m0 < M; m0 += per_part) {
            long rows = M - m0 < per_part ? M - m0 : per_part;
            void *out_t = (char *)out + (m0 * out_stride + col) * out_size;
#ifdef __AVX512BF16__
            if (dot) {
                tiles_dot_bf16((const bf16 *)x + m0 * K, K, w_t, rows, vecs, bias_t, N - col, out_t, out_stride);
                continue;
            }
#endif
            if (quant || kquant) {
                long b = m0 * K / 32;
                QuantRows part = {xq.q + m0 * K, xq.d + b, xq.sum + b, xq.d_sum + b, xq.half_sum + b};
                if (quant) tiles_int8(part, K, w_t, format, rows, vecs, bias_t, N - col, out_t, wide_io, out_stride);
                else tiles_kquant(part, K, w_t, format, scales, rows, vecs, bias_t, N - col, out_t, wide_io,
                                  out_stride);
            } else {
                tiles_dense(x_f32 + m0 * K, K, w_t, format == W_F32, rows, vecs, bias_t, N - col, out_t, wide_io,
                            out_stride);
            }
        }
    }
    free(scales);
    }
    free(scratch);
    return 0;
}

