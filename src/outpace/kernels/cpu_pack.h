/* GGUF's quantized blocks regrouped into cpu_products.h's packed layouts (cpu_kernels.pack_quantized):
 * bits are moved, never converted, so a packed weight is the file's size. Every level packs
 * alike. Loading a model packs each of its matrices once; in C that is a copy at memory speed
 * (PyTorch's gathers and transposes of the same bytes take about 5 s for Qwen2.5-Coder-1.5B's 1.1 GB). */

/* a GGUF block's bytes (one column's block of its inputs) */
static long file_block_bytes(int format) {
    switch (format) {
        case W_Q8_0: return 34;     /* d, q[32] */
        case W_Q4_1: return 20;     /* d, m, q[16] */
        case W_Q4_0: return 18;     /* d, q[16] */
        case W_Q5_0: return 22;     /* d, qh (uint32: input i's fifth bit in bit i), q[16] */
        case W_Q4_K: return 144;    /* d, dmin, scales[12], q[128] */
        case W_Q6_K: return 210;    /* ql[128], qh[64], scales[16], d */
        default: return 0;
    }
}

/* the packed group's bytes of the 16 columns' blocks at col[c] (cpu_products.h's WeightFormat) */
static void pack_group(const uint8_t *const col[16], int format, uint8_t *o) {
    if (format == W_Q4_K || format == W_Q6_K) {
        const int q4 = format == W_Q4_K;
        /* float16 values side by side: Q4_K's d then dmin, Q6_K's d */
        for (int c = 0; c < 16; c++) {
            memcpy(o + 2 * c, col[c] + (q4 ? 0 : 208), 2);
            if (q4) memcpy(o + 32 + 2 * c, col[c] + 2, 2);
        }
        /* scale bytes transposed: byte k of column c at [k][c] */
        uint8_t *scales = o + (q4 ? 64 : 32);
        for (int k = 0; k < (q4 ? 12 : 16); k++) {
            for (int c = 0; c < 16; c++) scales[16 * k + c] = col[c][(q4 ? 4 : 192) + k];
        }
        if (q4) {               /* runs of 4 of the 128 quantized bytes: run u [16 columns][4 bytes] */
            uint8_t *runs = o + 64 + 192;
            for (int u = 0; u < 32; u++) {
                for (int c = 0; c < 16; c++) memcpy(runs + 64 * u + 4 * c, col[c] + 16 + 4 * u, 4);
            }
            return;
        }
        /* Q6_K: each column's 256 6-bit values q (low 4 bits from ql, high 2 from qh; inputs
         * 128h + r: ql byte 64h + r % 64, nibble r / 64; qh byte 32h + r % 32, bits 2 (r / 32) on),
         * then quads: run r < 3 of quad u holds input 16u + 4r + j in bits 0-5 of byte j and
         * bits 2r, 2r + 1 of input 16u + 12 + j in bits 6-7 */
        uint8_t *quads = o + 32 + 256;
        for (int c = 0; c < 16; c++) {
            uint8_t q[256];
            const uint8_t *ql = col[c], *qh = col[c] + 128;
            for (int i = 0; i < 256; i++) {
                int h = i / 128, r = i % 128;
                q[i] = (uint8_t)(((ql[64 * h + r % 64] >> (4 * (r / 64))) & 15) |
                                 (((qh[32 * h + r % 32] >> (2 * (r / 32))) & 3) << 4));
            }
            for (int u = 0; u < 16; u++) {
                for (int r = 0; r < 3; r++) {
                    for (int j = 0; j < 4; j++) {
                        quads[((u * 3 + r) * 16 + c) * 4 + j] =
                            (uint8_t)(q[16 * u + 4 * r + j] | ((q[16 * u + 12 + j] >> (2 * r)) & 3) << 6);
                    }
                }
            }
        }
        return;
    }
    /* blocks of 32 inputs: d[16] (Q4_1: then m[16]), Q5_0's fifth bits, then the quantized bytes
     * in runs of 4 */
    for (int c = 0; c < 16; c++) {
        memcpy(o + 2 * c, col[c], 2);
        if (format == W_Q4_1) memcpy(o + 32 + 2 * c, col[c] + 2, 2);
    }
    long start = format == W_Q4_1 ? 64 : format == W_Q5_0 ? 96 : 32;       /* the runs, packed */
    long from = format == W_Q4_1 ? 4 : format == W_Q5_0 ? 6 : 2;           /* the quantized bytes, in a block */
    /* Q5_0's fifth bits: per run t, two uint64, bit 4c + j column c's fifth bit of input 4t + j,
     * then of input 16 + 4t + j */
    if (format == W_Q5_0) {
        uint64_t masks[4][2] = {{0}};
        for (int c = 0; c < 16; c++) {
            uint32_t qh;
            memcpy(&qh, col[c] + 2, 4);
            for (int half = 0; half < 2; half++) {
                for (int t = 0; t < 4; t++) {
                    for (int j = 0; j < 4; j++) {
                        masks[t][half] |= (uint64_t)((qh >> (16 * half + 4 * t + j)) & 1) << (4 * c + j);
                    }
                }
            }
        }
        memcpy(o + 32, masks, sizeof masks);
    }
    int runs = format == W_Q8_0 ? 8 : 4;
    for (int t = 0; t < runs; t++) {
        for (int c = 0; c < 16; c++) memcpy(o + start + 64 * t + 4 * c, col[c] + from + 4 * t, 4);
    }
}

/* rows [N][row_bytes] of a GGUF matrix's blocks (its N output columns, each K / block inputs
 * blocks) into `out`: blocks of 16 columns (the last padded with zero blocks), each K / block
 * inputs groups. Returns 0, -2 for a format or a row length it cannot take. */
int pack_blocks(const uint8_t *rows, long N, long row_bytes, int format, uint8_t *out) {
    static const uint8_t zeros[256];
    long size = file_block_bytes(format);
    if (!size || row_bytes % size) return -2;
    long groups = row_bytes / size;
    long group_bytes = format == W_Q4_K || format == W_Q6_K ? kquant_group_bytes(format) : group_bytes_of(format);
    long blocks = (N + 15) / 16;
#pragma omp parallel for schedule(static) if (blocks * groups * group_bytes >= (1 << 20))
    for (long b = 0; b < blocks; b++) {
        for (long g = 0; g < groups; g++) {
            const uint8_t *col[16];
            for (int c = 0; c < 16; c++) col[c] = 16 * b + c < N ? rows + (16 * b + c) * row_bytes + g * size : zeros;
            pack_group(col, format, out + (b * groups + g) * group_bytes);
        }
    }
    return 0;
}
