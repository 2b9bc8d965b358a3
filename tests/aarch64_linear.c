/* tests/test_cpu_aarch64.py's harness: the CPU kernels built into a program for aarch64 (run under
 * qemu-user). Reads from stdin, as int64 values, M K N format wide_io has_bias, then x [M, K]
 * (float32 when wide_io, else bfloat16), the packed weights (cpu_kernels.pack_weight or
 * pack_quantized, in the format's bytes), the bias [N] float32 when has_bias; writes linear's out [M, N] to stdout. */
#include "../src/outpace/kernels/cpu_kernels.c"

#include <stdio.h>

static void *read_all(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p || fread(p, 1, bytes, stdin) != bytes) exit(2);
    return p;
}

int main(void) {
    int64_t head[6];
    if (fread(head, sizeof head, 1, stdin) != 1) return 2;
    long M = head[0], K = head[1], N = head[2], padded = (N + 15) / 16 * 16;
    int format = (int)head[3], wide_io = (int)head[4];
    size_t io = wide_io ? 4 : 2;
    size_t weight = format == W_F32 ? 4 * K : format == W_BF16 ? 2 * K
                    : format == W_Q4_K || format == W_Q6_K ? K / 256 * kquant_group_bytes(format) / 16
                    : K / 32 * group_bytes_of(format) / 16;
    void *x = read_all(M * K * io), *w = read_all(padded * weight);
    float *bias = head[5] ? read_all(N * 4) : NULL;
    void *out = malloc(M * N * io);
    if (!out || linear(x, wide_io, M, K, w, format, N, bias, out, N)) return 3;
    fwrite(out, io, M * N, stdout);
    return 0;
}
