"""The CPU kernels' instruction-set levels: which one runs, how each is built and cached, what a
bfloat16 model does without the kernels, and the aarch64 builds (cross-compiled, and run under
qemu-user against the x86 portable build where qemu is present)."""
import shutil
import subprocess

import numpy as np
import pytest
import torch

from outpace.errors import InvalidParameterError
from outpace.kernels import cpu_build, cpu_isa, cpu_kernels, cpu_linear
from gguf_blocks import quantize

AVX2_CPU = frozenset("sse2 avx avx2 fma f16c bmi2".split())
AVX512_CPU = AVX2_CPU | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
CROSS = "aarch64-linux-gnu-gcc"
HAS_CC = cpu_build.compiler() is not None and shutil.which(cpu_build.compiler()) is not None


@pytest.fixture
def x86_cpu(monkeypatch):
    """Pretend to be an x86-64 CPU with the given flags: fake(flags)."""
    def fake(flags):
        monkeypatch.setattr(cpu_isa, "architecture", lambda: "x86_64")
        monkeypatch.setattr(cpu_isa, "_cpu_flags", lambda: frozenset(flags))
    return fake


def test_highest_level_the_cpu_has_is_chosen(x86_cpu, monkeypatch):
    monkeypatch.delenv(cpu_isa.ENV, raising=False)
    for flags, level in ((set(), "portable"), (AVX2_CPU, "avx2"), (AVX2_CPU | {"avx512f"}, "avx2"),
                         (AVX2_CPU | {"avx_vnni"}, "avx2_vnni"), (AVX2_CPU | {"avx512_vnni"}, "avx2"),
                         (AVX512_CPU, "avx512"), (AVX512_CPU | {"avx_vnni"}, "avx512"),
                         (AVX512_CPU | {"avx512_bf16"}, "avx512"),
                         (AVX512_CPU | {"avx512_bf16", "avx512_vnni"}, "avx512_bf16")):
        x86_cpu(flags)
        assert cpu_isa.chosen().name == level
        assert cpu_isa.testable()[0] == "portable" and cpu_isa.testable()[-1] == level
    x86_cpu(AVX512_CPU | {"avx_vnni"})     # AVX-VNNI beside AVX-512: every level is tested
    assert cpu_isa.testable() == ("portable", "avx2", "avx2_vnni", "avx512")


def test_env_caps_the_level(x86_cpu, monkeypatch, capsys):
    x86_cpu(AVX512_CPU)
    for cap, level in (("portable", "portable"), ("avx2", "avx2"), ("avx512", "avx512")):
        monkeypatch.setenv(cpu_isa.ENV, cap)
        assert cpu_isa.chosen().name == level and cpu_isa.testable()[-1] == level
    assert capsys.readouterr().err == ""
    monkeypatch.setenv(cpu_isa.ENV, "avx512_bf16")        # above what the CPU has: said once, capped
    assert cpu_isa.chosen().name == "avx512"
    assert "lacks avx512_bf16" in capsys.readouterr().err
    monkeypatch.setenv(cpu_isa.ENV, "avx2_vnni")          # a level an AVX-512 CPU may lack
    assert cpu_isa.chosen().name == "avx2"
    assert "lacks avx_vnni" in capsys.readouterr().err
    for wrong in ("avx3", "neon", "AVX2"):
        monkeypatch.setenv(cpu_isa.ENV, wrong)
        with pytest.raises(InvalidParameterError, match="portable, avx2, avx2_vnni, avx512, avx512_bf16"):
            cpu_isa.chosen()


def test_aarch64_always_has_neon(monkeypatch):
    monkeypatch.delenv(cpu_isa.ENV, raising=False)
    monkeypatch.setattr(cpu_isa, "architecture", lambda: "aarch64")
    monkeypatch.setattr(cpu_isa, "_cpu_flags", lambda: frozenset())
    assert [level.name for level in cpu_isa.runnable()] == ["portable", "neon"]
    monkeypatch.setattr(cpu_isa, "architecture", lambda: "riscv64")
    assert [level.name for level in cpu_isa.runnable()] == ["portable"]


def test_auto_dtype_follows_the_level(monkeypatch):
    for level, bf16 in (("portable", False), ("avx2", True), ("avx2_vnni", True), ("avx512", True),
                        ("avx512_bf16", True)):
        monkeypatch.setattr(cpu_kernels, "level", lambda level=level: level)
        assert cpu_linear.prefers_bfloat16() is bf16
    monkeypatch.setattr(cpu_kernels, "level", lambda: None)
    for works in (False, True):
        monkeypatch.setattr(cpu_linear, "_onednn_bf16_works", lambda works=works: works)
        assert cpu_linear.prefers_bfloat16() is works


@pytest.mark.skipif(not HAS_CC, reason="no C compiler: the kernels cannot build here")
def test_each_level_is_cached_apart_and_rebuilt_when_stale(tmp_path, monkeypatch):
    """A level's library is named by its sources and flags: a build keeps that level's most
    recently used builds (two checkouts run alternately rebuild nothing) and deletes older ones,
    and leaves the other levels' alone."""
    import os

    monkeypatch.setenv("OUTPACE_HOME", str(tmp_path))
    portable, avx2 = cpu_isa.levels("x86_64")[:2]
    folder = tmp_path / "kernels"
    folder.mkdir()
    older = [folder / f"cpu_kernels-portable-{i:016x}.so" for i in range(cpu_build.KEEP_BUILDS)]
    other = folder / "cpu_kernels-avx2-0123456789abcdef.so"
    for age, path in enumerate([*older, other]):
        path.write_bytes(b"")
        os.utime(path, (1e9 - age, 1e9 - age))         # older[0] the most recently used
    built = cpu_build.build(portable)
    assert built.exists() and built.name.startswith("cpu_kernels-portable-")
    assert [p.exists() for p in older] == [True] * (cpu_build.KEEP_BUILDS - 1) + [False] and other.exists()
    assert cpu_build.build(portable) == built                       # cached: not rebuilt
    assert cpu_build.library_path(avx2, "cc") != cpu_build.library_path(portable, "cc")


def test_another_checkouts_kernels_are_named_by_their_own_headers(tmp_path):
    """A copy of the kernels whose header differs from this checkout's (another checkout, as
    benchmarks/kernels_ab.py compares them) gets its own build, not this checkout's cached one."""
    copy = tmp_path / "kernels"
    shutil.copytree(cpu_build.FOLDER, copy, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    portable = cpu_isa.levels("x86_64")[0]
    assert cpu_build.library_path(portable, "cc", copy / "cpu_kernels.c") == cpu_build.library_path(portable, "cc")
    header = copy / "cpu_vec.h"
    header.write_text(header.read_text() + "\n/* another checkout */\n")
    assert cpu_build.library_path(portable, "cc", copy / "cpu_kernels.c") != cpu_build.library_path(portable, "cc")


@pytest.mark.skipif(not HAS_CC, reason="no C compiler: the kernels cannot build here")
def test_kernel_calls_go_to_the_library_in_use_and_back():
    """cpu_kernels.using sends every kernel call to the library given, and only within."""
    if not cpu_kernels.has_library():
        pytest.skip("the kernels are off here")
    calls = []
    lib = cpu_kernels.library_of()

    class Counting:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(lib, name)

    x = torch.randn(3, 64)
    with cpu_kernels.using(Counting()):
        cpu_kernels.add_rms_norm(x, None, torch.ones(64), 1e-6)
    assert calls == ["add_rms_norm_f32"]
    cpu_kernels.add_rms_norm(x, None, torch.ones(64), 1e-6)
    assert calls == ["add_rms_norm_f32"]


def test_a_failed_build_says_why_and_falls_back(tmp_path, monkeypatch, capsys):
    """A compiler that fails (here `false`) leaves the kernels off with one line on stderr, and
    float32 steps run PyTorch's ops."""
    monkeypatch.setenv("CC", shutil.which("false") or "false")
    monkeypatch.setenv("OUTPACE_HOME", str(tmp_path))
    cpu_kernels.reload()
    try:
        assert cpu_kernels.level() is None
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "CPU kernels off" in err and "failed" in err
    finally:
        cpu_kernels.reload()


def test_bf16_without_kernels_or_onednn_is_refused(tmp_path, monkeypatch, default_model_dir):
    """Where neither the kernels nor oneDNN's bfloat16 products run, a bfloat16 model is an error
    that says what to do, from load_model and from LLM alike, never a traceback from PyTorch."""
    from outpace import LLM
    from outpace.errors import OutpaceError
    from outpace.weights.loader import load_model
    from tiny import make_tiny
    make_tiny("llama", tmp_path, tokenizer_from=default_model_dir)
    monkeypatch.setattr(cpu_linear, "_onednn_bf16_works", lambda: False)
    monkeypatch.setenv("OUTPACE_CPU_KERNELS", "0")
    cpu_kernels.reload()
    try:
        with pytest.raises(InvalidParameterError, match="unset it.*--dtype float32"):
            load_model(tmp_path, torch.bfloat16, "cpu", max_len=64)
        with pytest.raises(OutpaceError, match="OUTPACE_CPU_KERNELS=0"):
            LLM(str(tmp_path), spec="none", dtype="bfloat16", device="cpu", max_num_seqs=1, max_model_len=64)
        assert load_model(tmp_path, torch.float32, "cpu", max_len=64) is not None
        monkeypatch.delenv("OUTPACE_CPU_KERNELS")
        monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
        monkeypatch.setenv("OUTPACE_HOME", str(tmp_path / "home"))
        cpu_kernels.reload()
        with pytest.raises(InvalidParameterError, match="install gcc"):
            load_model(tmp_path, torch.bfloat16, "cpu", max_len=64)
    finally:
        cpu_kernels.reload()


needs_cross = pytest.mark.skipif(shutil.which(CROSS) is None,
                                 reason=f"no aarch64 cross compiler ({CROSS}: apt-get install gcc-aarch64-linux-gnu)")


@needs_cross
@pytest.mark.parametrize("level", [level.name for level in cpu_isa.levels("aarch64")])
def test_aarch64_levels_compile(level, tmp_path):
    """Every aarch64 level's library compiles with the cross compiler, into an AArch64 ELF."""
    out = tmp_path / f"{level}.so"
    cpu_build.compile_library(next(lv for lv in cpu_isa.levels("aarch64") if lv.name == level), out, CROSS)
    header = out.read_bytes()[:20]
    assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == 183     # EM_AARCH64


def _run_aarch64(program, x, packed, fmt, bias, n):
    m, k = x.shape
    head = np.array([m, k, n, fmt, int(x.dtype == torch.float32), int(bias is not None)], dtype=np.int64)
    data = head.tobytes() + x.contiguous().view(torch.uint8).numpy().tobytes() + \
        packed.contiguous().view(torch.uint8).numpy().tobytes() + (b"" if bias is None else bias.numpy().tobytes())
    done = subprocess.run(["qemu-aarch64", str(program)], input=data, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return torch.frombuffer(bytearray(done.stdout), dtype=x.dtype).reshape(m, n)


@needs_cross
@pytest.mark.skipif(shutil.which("qemu-aarch64") is None, reason="no qemu-user (apt-get install qemu-user)")
@pytest.mark.skipif(not HAS_CC or cpu_isa.architecture() != "x86_64", reason="the reference is this x86 CPU's portable build")
@pytest.mark.parametrize("level", [level.name for level in cpu_isa.levels("aarch64")])
def test_aarch64_products_equal_the_portable_build(level, tmp_path, monkeypatch):
    """The aarch64 build's products, run under qemu-user, against this machine's portable build:
    bfloat16 inputs over bfloat16 weights bit for bit (exact products summed in the inputs'
    order at every level), float32 ones to float32 rounding (NEON fuses multiply and add); GGUF's
    formats bit for bit (int8 inputs: integer sums, one float order at every level)."""
    aarch64 = next(lv for lv in cpu_isa.levels("aarch64") if lv.name == level)
    program = tmp_path / "linear"
    done = subprocess.run([CROSS, *cpu_build.COMMON_FLAGS[:2], *aarch64.flags, "-static", "-o", str(program),
                           str(cpu_build.FOLDER.parents[2] / "tests" / "aarch64_linear.c"), "-lm"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    monkeypatch.setenv(cpu_isa.ENV, "portable")
    cpu_kernels.reload()
    try:
        g = torch.Generator().manual_seed(11)
        for m, k, n in ((1, 64, 37), (5, 96, 160), (13, 128, 48)):
            for dtype in (torch.bfloat16, torch.float32):
                weight, bias = torch.randn(n, k, generator=g).to(dtype), torch.randn(n, generator=g)
                packed, fmt = cpu_kernels.pack_weight(weight), cpu_kernels.WEIGHT_FORMATS[dtype]
                for x_dtype in (torch.bfloat16, torch.float32):
                    x = torch.randn(m, k, generator=g).to(x_dtype)
                    got = _run_aarch64(program, x, packed, fmt, bias, n)
                    expected = cpu_kernels.linear(x, packed, fmt, bias, n)
                    if dtype == x_dtype == torch.bfloat16:
                        assert torch.equal(got, expected)
                    else:       # fused or not: float32 sums differ in their last bits, a bf16 out by a step
                        step = 2 ** -7 if x_dtype == torch.bfloat16 else 1e-5
                        torch.testing.assert_close(got.float(), expected.float(), rtol=step, atol=step)
        for qtype, fmt in cpu_kernels.QUANT_FORMATS.items():     # GGUF blocks (512 inputs: whole k-quant blocks)
            weight = np.random.default_rng(fmt).standard_normal((80, 512)).astype(np.float32)
            blocks = torch.from_numpy(quantize(weight, qtype))
            packed, x = cpu_kernels.pack_quantized(blocks, qtype), torch.randn(5, 512, generator=g)
            got, expected = _run_aarch64(program, x, packed, fmt, None, 80), cpu_kernels.linear(x, packed, fmt, None, 80)
            assert torch.equal(got, expected), qtype
    finally:
        cpu_kernels.reload()
