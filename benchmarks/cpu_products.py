"""Times the CPU kernels' products at each instruction-set level against MKL's float32 F.linear.

The default model's shapes (in -> out: qkv 576 -> 960, attention output 576 -> 576, gate_up
576 -> 3072, down 1536 -> 576, LM head 576 -> 49152) and Qwen2.5-1.5B's gate (1536 -> 8960), down
(8960 -> 1536) and q (1536 -> 1536), for a few rows (1: decode; 2-16: verify), over weights in
float32, bfloat16 and GGUF's Q4_1 and Q8_0 (the default model's layers and LM head), or Q4_K and
Q6_K (random blocks: the time does not depend on the values), the inputs bfloat16 except for
float32 weights. The weights are read from memory as in a decode
step: each call takes the next of copies that together exceed the last-level cache. Methods run
interleaved, round after round, and each figure is the median of all their calls' times (on a
shared machine a call that another process preempted is an outlier there, where it would inflate
a round's total).

--baseline SRC adds another checkout's quantized products (its src folder: its cpu_kernels.c
compiled at each level, and its packer) as `base Q4_1` / `base Q8_0` ..., interleaved with these.

    PYTHONPATH=src python3 benchmarks/cpu_products.py [--levels avx2,avx512_bf16] [--rows 1,4,9,16]
        [--formats bf16,Q4_1] [--rounds 7] [--stream-mb 96] [--baseline ../main/src]
"""
from __future__ import annotations

import argparse
import ctypes
import importlib.util
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from outpace.kernels import cpu_build, cpu_isa, cpu_kernels

SHAPES = {"qkv 576->960": (576, 960), "o 576->576": (576, 576), "gate_up 576->3072": (576, 3072),
          "down 1536->576": (1536, 576), "lm_head 576->49152": (576, 49152), "gate 1536->8960": (1536, 8960),
          "down 8960->1536": (8960, 1536), "q 1536->1536": (1536, 1536)}
BYTES_PER_WEIGHT = {"fp32": 4.0, "bf16": 2.0, "Q4_1": 20 / 32, "Q4_0": 18 / 32, "Q5_0": 22 / 32, "Q8_0": 34 / 32,
                    "Q4_K": 144 / 256, "Q6_K": 210 / 256}
# a k-quant block's bytes and its float16 scales' offsets (Q4_K: d, dmin; Q6_K: d)
KQUANT_BLOCKS = {"Q4_K": (144, (0, 2)), "Q6_K": (210, (208,))}


def _blocks(fmt: str, weight: torch.Tensor) -> torch.Tensor:
    """GGUF blocks of a weight's shape: gguf's quantizer, or random bits with small float16 scales
    for the k-quants (gguf's Python cannot quantize to them)."""
    if fmt not in KQUANT_BLOCKS:
        return torch.from_numpy(quantize(weight.numpy(), GGMLQuantizationType[fmt]))
    size, halves = KQUANT_BLOCKS[fmt]
    n, k = weight.shape
    raw = torch.randint(0, 256, (n, k // 256, size), dtype=torch.uint8)
    for at in halves:
        raw[..., at:at + 2] = (torch.rand(n, k // 256, 1) * 1e-3).half().view(torch.uint8)
    return raw.reshape(n, -1)


def _at_level(level: str):
    os.environ[cpu_isa.ENV] = level
    cpu_kernels.reload()
    assert cpu_kernels.level() == level, cpu_kernels.level()


class Baseline:
    """Another checkout's quantized kernels: its library per level and its packer."""

    def __init__(self, src: Path, levels: list[str], scratch: Path):
        source = src / "outpace" / "kernels" / "cpu_kernels.c"
        spec = importlib.util.spec_from_file_location("baseline_cpu_kernels", source.with_suffix(".py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        self.pack, self.formats = module.pack_quantized, module.QUANT_FORMATS
        self.libraries = {}
        for level in cpu_isa.runnable():
            if level.name in levels:
                out = scratch / f"baseline-{level.name}.so"
                cpu_build.compile_library(level, out, cpu_build.compiler(), source=source)
                self.libraries[level.name] = lib = ctypes.CDLL(str(out))
                p, i = ctypes.c_void_p, ctypes.c_long
                # the output's row stride last (a checkout whose linear takes none ignores it)
                lib.linear.argtypes = [p, ctypes.c_int, i, i, p, ctypes.c_int, i, p, p, i]
                lib.linear.restype = ctypes.c_int

    def linear(self, level: str, x: torch.Tensor, packed: torch.Tensor, fmt: int, n: int) -> torch.Tensor:
        out = x.new_empty(x.shape[0], n)
        failed = self.libraries[level].linear(x.data_ptr(), x.dtype == torch.float32, x.shape[0], x.shape[1],
                                              packed.data_ptr(), fmt, n, None, out.data_ptr(), n)
        assert failed == 0, failed
        return out


def _weights(fmt: str, k: int, n: int, stream_bytes: int, baseline: Baseline | None):
    """{method tag: copies of the packed weight}, as many copies as stream_bytes takes (at least 2)."""
    copies = max(2, -(-stream_bytes // int(k * n * BYTES_PER_WEIGHT[fmt])))
    weight = torch.randn(n, k) * 0.05
    if fmt in ("fp32", "bf16"):
        one = {fmt: cpu_kernels.pack_weight(weight.to(torch.float32 if fmt == "fp32" else torch.bfloat16))}
    else:
        blocks = _blocks(fmt, weight)
        one = {fmt: cpu_kernels.pack_quantized(blocks, fmt)}
        if baseline is not None:
            one[f"base {fmt}"] = baseline.pack(blocks, fmt)
    # the methods' copies allocated in turn: a set allocated before another streamed about 5% slower here
    sets = {tag: [] for tag in one}
    for _ in range(copies):
        for tag, packed in one.items():
            sets[tag].append(packed.clone())
    return sets


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--levels", default=",".join(l for l in cpu_isa.testable() if l != "portable"))
    parser.add_argument("--rows", default="1,2,4,9,12,16")
    parser.add_argument("--formats", default="fp32,bf16,Q4_1,Q8_0")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="names of SHAPES, comma-separated")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--stream-mb", type=int, default=96,
                        help="weights of a shape and format in all, a few times the last-level cache")
    parser.add_argument("--baseline", type=Path, help="another checkout's src folder: its quantized products too")
    parser.add_argument("--no-mkl", action="store_true", help="leave out MKL's float32 F.linear")
    args = parser.parse_args()
    levels, formats = args.levels.split(","), args.formats.split(",")
    print(f"threads {torch.get_num_threads()}; {cpu_isa.cpu_description()}")
    with tempfile.TemporaryDirectory() as scratch:
        baseline = Baseline(args.baseline, levels, Path(scratch)) if args.baseline else None
        for name in args.shapes.split(","):
            k, n = SHAPES[name]
            packed = {}
            for fmt in formats:
                if fmt in KQUANT_BLOCKS and k % 256:
                    print(f"{name}: {fmt} left out (its super-blocks need inputs a multiple of 256)")
                    continue
                packed |= _weights(fmt, k, n, args.stream_mb << 20, baseline)
            dense = [torch.randn(n, k) * 0.05 for _ in range(len(packed.get("fp32", [0, 0])))]
            for rows in map(int, args.rows.split(",")):
                x = torch.randn(rows, k)
                methods = {} if args.no_mkl else {"mkl fp32": (None, dense, lambda w: F.linear(x, w))}
                for level in levels:
                    for tag, copies in packed.items():
                        fmt = tag.split()[-1]
                        xin = x if fmt == "fp32" else x.to(torch.bfloat16)
                        code = cpu_kernels.WEIGHT_FORMATS.get({"fp32": torch.float32, "bf16": torch.bfloat16}.get(fmt))
                        if tag.startswith("base"):
                            call = (lambda w, xin=xin, level=level, fmt=fmt:
                                    baseline.linear(level, xin, w, baseline.formats[fmt], n))
                        else:
                            code = cpu_kernels.QUANT_FORMATS[fmt] if code is None else code
                            call = lambda w, xin=xin, code=code: cpu_kernels.linear(xin, w, code, None, n)
                        methods[f"{level} {tag}"] = (level, copies, call)
                times = {m: [] for m in methods}
                for _ in range(args.rounds):
                    for method, (level, copies, call) in methods.items():
                        if level is not None:
                            _at_level(level)
                        call(copies[0])
                        for w in copies:
                            start = time.perf_counter()
                            call(w)
                            times[method].append(time.perf_counter() - start)
                line = []
                for method, ts in times.items():
                    t = statistics.median(ts)
                    nbytes = k * n * BYTES_PER_WEIGHT[method.split()[-1]]
                    line.append(f"{method} {t * 1e6:8.1f} us {nbytes / t / 1e9:5.1f} GB/s")
                print(f"{name:20s} rows {rows:2d} | " + " | ".join(line), flush=True)


if __name__ == "__main__":
    main()
