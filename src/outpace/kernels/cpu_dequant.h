/* Rows of a GGUF matrix's blocks dequantized to float32 (or bfloat16, rounded once from it): a
 * quantized embedding's lookups (cpu_linear.QuantizedEmbedding); and float32 rows quantized to
 * Q4_0 (a draft model's matrices requantized, weights/quantized.py). Each value is computed with the
 * float32 operations, in the order, of gguf-py's numpy dequantizers (gguf.quants), and floating
 * point contraction is off for the whole build, so a row is that dequantizer's output bit for bit:
 * a quantized embedding is its float32 copy's rows. */

/* the 256 values of one Q4_K (format W_Q4_K) or Q6_K block */
static void dequant_kquant(const uint8_t *b, int format, float *out) {
    if (format == W_Q4_K) {     /* d, dmin, scales[12] (6-bit scale and minimum a sub-block), q[128] */
        float d = half_to_f32((uint16_t)(b[0] | b[1] << 8)), dmin = half_to_f32((uint16_t)(b[2] | b[3] << 8));
        const uint8_t *s = b + 4, *q = b + 16;
        for (int j = 0; j < 8; j++) {
            int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 15) | ((s[j - 4] >> 2) & 48);
            int m = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 2) & 48);
            float scale = d * (float)sc, minimum = dmin * (float)m;
            /* sub-block j: the low nibbles of bytes 32 (j / 2) .. +32 for even j, the high ones for odd */
            for (int i = 0; i < 32; i++) {
                out[32 * j + i] = scale * (float)((q[32 * (j / 2) + i] >> (4 * (j % 2))) & 15) - minimum;
            }
        }
        return;
    }
    /* Q6_K: ql[128], qh[64], scales[16] (int8 a sub-block of 16), d */
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    float d = half_to_f32((uint16_t)(b[208] | b[209] << 8));
    for (int i = 0; i < 256; i++) {
        int h = i / 128, r = i % 128;
        int q = ((ql[64 * h + r % 64] >> (4 * (r / 64))) & 15) | (((qh[32 * h + r % 32] >> (2 * (r / 32))) & 3) << 4);
        out[i] = (d * (float)sc[i / 16]) * (float)(q - 32);
    }
}

/* the 32 values of one block of a 32-input format */
static void dequant_block32(const uint8_t *b, int format, float *out) {
    float d = half_to_f32((uint16_t)(b[0] | b[1] << 8));
    if (format == W_Q8_0) {
        for (int i = 0; i < 32; i++) out[i] = (float)(int8_t)b[2 + i] * d;
        return;
    }
    if (format == W_Q4_1) {
        float m = half_to_f32((uint16_t)(b[2] | b[3] << 8));
        for (int i = 0; i < 32; i++) out[i] = d * (float)((b[4 + i % 16] >> (4 * (i / 16))) & 15) + m;
        return;
    }
    if (format == W_Q4_0) {
        for (int i = 0; i < 32; i++) out[i] = d * (float)(((b[2 + i % 16] >> (4 * (i / 16))) & 15) - 8);
        return;
    }
    /* W_Q5_0: qh (uint32, little-endian: input i's fifth bit in bit i), q[16] */
    uint32_t qh = (uint32_t)b[2] | (uint32_t)b[3] << 8 | (uint32_t)b[4] << 16 | (uint32_t)b[5] << 24;
    for (int i = 0; i < 32; i++) {
        int q = ((b[6 + i % 16] >> (4 * (i / 16))) & 15) | (int)((qh >> i) & 1) << 4;
        out[i] = d * (float)(q - 16);
    }
}

/* rows ids[0..n) of blocks [rows][row_bytes] in format into out [n][K] (K = row_bytes / block bytes
 * * block inputs), float32 or (to_bf16) bfloat16. Returns 0, -2 for a format or a row length it
 * cannot take. */
int dequantize_rows(const uint8_t *blocks, long row_bytes, int format, const int64_t *ids, long n, int to_bf16,
                    void *out) {
    long size = file_block_bytes(format);
    if (!size || row_bytes % size) return -2;
    int inputs = format == W_Q4_K || format == W_Q6_K ? 256 : 32;
    long K = row_bytes / size * inputs;
#pragma omp parallel for schedule(static) if (n * K >= (1 << 18))
    for (long r = 0; r < n; r++) {
        const uint8_t *row = blocks + ids[r] * row_bytes;
        float values[256];
        for (long g = 0; g < row_bytes / size; g++) {
            if (inputs == 256) dequant_kquant(row + g * size, format, values);
            else dequant_block32(row + g * size, format, values);
            if (to_bf16) {
                for (int i = 0; i < inputs; i++) ((bf16 *)out)[r * K + g * inputs + i] = f32_to_bf16(values[i]);
            } else {
                memcpy((float *)out + r * K + g * inputs, values, sizeof(float) * inputs);
            }
        }
    }
    return 0;
}

/* float32 rows x [rows][K] (K a multiple of 32) as Q4_0 blocks [rows][K / 32 * 18], the bytes of
 * gguf-py's numpy quantizer (and ggml's reference one): per 32 inputs d = the value of largest
 * magnitude (the first such) / -8, stored in float16, and each input as min(15, trunc(x / d + 8.5))
 * (x * (1 / d) in float32), input i's nibble in byte i % 16, low half for i < 16. Returns 0, -2
 * for a K that is not whole blocks. */
int quantize_q4_0(const float *x, long rows, long K, uint8_t *out) {
    if (K % 32) return -2;
    long blocks = K / 32;
#pragma omp parallel for schedule(static) if (rows * K >= (1 << 18))
    for (long r = 0; r < rows; r++) {
        for (long g = 0; g < blocks; g++) {
            const float *v = x + r * K + g * 32;
            uint8_t *b = out + (r * blocks + g) * 18;
            float amax = 0.0f, max = 0.0f;
            for (int i = 0; i < 32; i++) {
                if (fabsf(v[i]) > amax) {
                    amax = fabsf(v[i]);
                    max = v[i];
                }
            }
            float d = max / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            uint16_t h = f32_to_half(d);
            b[0] = (uint8_t)(h & 0xff);
            b[1] = (uint8_t)(h >> 8);
            for (int i = 0; i < 16; i++) {
                float lo = truncf(v[i] * id + 8.5f), hi = truncf(v[16 + i] * id + 8.5f);
                b[2 + i] = (uint8_t)((lo < 15.0f ? (int)lo : 15) | (hi < 15.0f ? (int)hi : 15) << 4);
            }
        }
    }
    return 0;
}
