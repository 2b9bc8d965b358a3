"""Times the CPU kernels' products at each instruction-set level against MKL's float32 F.linear.

The default model's shapes (in -> out: attention output 576 -> 576, gate_up 576 -> 3072, down
1536 -> 576, LM head 576 -> 49152), for 1, 4, 9 and 16 rows, the weights read from memory as in a
decode step (each call takes the next of copies that together exceed the last-level cache).
Methods run interleaved, round after round, and each figure is the median of all their calls'
times (on a shared machine a call that another process preempted is an outlier there, where it
would inflate a round's total).

    PYTHONPATH=src python3 benchmarks/cpu_products.py [--levels avx2,avx512_bf16] [--rounds 7] [--stream-mb 96]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from outpace.kernels import cpu_isa, cpu_kernels

SHAPES = {"o 576->576": (576, 576), "gate_up 576->3072": (576, 3072), "down 1536->576": (1536, 576),
          "lm_head 576->49152": (576, 49152)}


def _copies(k: int, n: int, stream_bytes: int) -> int:
    return max(2, -(-stream_bytes // (k * n * 4)))


def _at_level(level: str):
    os.environ[cpu_isa.ENV] = level
    cpu_kernels.reload()
    assert cpu_kernels.level() == level, cpu_kernels.level()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--levels", default=",".join(l for l in cpu_isa.testable() if l != "portable"))
    parser.add_argument("--rows", default="1,4,9,16")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--stream-mb", type=int, default=96,
                        help="float32 weights of a shape in all, a few times the last-level cache")
    args = parser.parse_args()
    levels = args.levels.split(",")
    print(f"threads {torch.get_num_threads()}; {cpu_isa.cpu_description()}")
    for name, (k, n) in SHAPES.items():
        copies = _copies(k, n, args.stream_mb << 20)
        weights = [torch.randn(n, k) * 0.05 for _ in range(copies)]
        packed = {dtype: [cpu_kernels.pack_weight(w.to(dtype)) for w in weights]
                  for dtype in (torch.float32, torch.bfloat16)}
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, k)
            methods = {"mkl fp32": lambda i: F.linear(x, weights[i])}
            for level in levels:
                for dtype, tag in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
                    xin = x.to(dtype) if dtype == torch.bfloat16 else x
                    fmt = cpu_kernels.WEIGHT_FORMATS[dtype]
                    methods[f"{level} {tag}"] = (level, lambda i, xin=xin, fmt=fmt, dtype=dtype:
                                                 cpu_kernels.linear(xin, packed[dtype][i], fmt, None, n))
            times = {m: [] for m in methods}
            for _ in range(args.rounds):
                for method, call in methods.items():
                    if isinstance(call, tuple):
                        _at_level(call[0])
                        call = call[1]
                    call(0)
                    for i in range(copies):
                        start = time.perf_counter()
                        call(i)
                        times[method].append(time.perf_counter() - start)
            line = []
            for method, ts in times.items():
                t = statistics.median(ts)
                nbytes = k * n * (2 if method.endswith("bf16") else 4)
                line.append(f"{method} {t * 1e6:8.1f} us {nbytes / t / 1e9:5.1f} GB/s")
            print(f"{name:20s} rows {rows:2d} | " + " | ".join(line), flush=True)


if __name__ == "__main__":
    main()
