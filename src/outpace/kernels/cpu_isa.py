"""Instruction-set levels of the CPU kernels: which exist, which this CPU runs, which one is used.

cpu_kernels.c is built once per level with that level's flags (never -march=native), so a
build's code depends on its level alone, and the level is chosen at run time from the flags the
CPU reports: the highest one it has, or OUTPACE_CPU_ISA's cap. `portable` (plain C, which the
compiler may vectorise for the architecture's baseline: SSE2 on x86-64, NEON on aarch64) runs on
every CPU, so a kernel path always exists.

OUTPACE_CPU_ISA=<level> caps the level: the highest level at or below it that this CPU has is
used (a cap above what the CPU has says so once on stderr); a name that is not a level of this
architecture is an InvalidParameterError that lists them. The tests set it to run the kernels
once per level the machine can execute.
"""
from __future__ import annotations

import functools
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

from outpace.errors import InvalidParameterError

ENV = "OUTPACE_CPU_ISA"


@dataclass(frozen=True)
class Level:
    name: str
    flags: tuple[str, ...]      # the compiler's flags beyond cpu_build's common ones
    needs: tuple[str, ...]      # flags /proc/cpuinfo must list for the CPU to run the build


_AVX2 = Level("avx2", ("-mavx2", "-mfma", "-mf16c"), ("avx2", "fma", "f16c"))
# Intel's client CPUs from Alder Lake on have VNNI's int8 products on 8 lanes (AVX-VNNI) but no AVX-512
_AVX2_VNNI = Level("avx2_vnni", _AVX2.flags + ("-mavxvnni",), _AVX2.needs + ("avx_vnni",))
_AVX512 = Level("avx512", _AVX2.flags + ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"),
                _AVX2.needs + ("avx512f", "avx512bw", "avx512vl", "avx512dq"))
# lowest first: a CPU runs the highest level whose flags it has. Each level's CPUs run every level
# before it but avx2_vnni, which AVX-512 CPUs before Sapphire Rapids and Zen 4 lack. avx512_bf16
# takes VNNI's vpdpbusd (int8 products) too: every CPU with AVX-512 BF16 has it (Cooper Lake,
# Sapphire Rapids, Zen 4)
LEVELS: dict[str, tuple[Level, ...]] = {
    "x86_64": (Level("portable", ("-DOUTPACE_PORTABLE",), ()), _AVX2, _AVX2_VNNI, _AVX512,
               Level("avx512_bf16", _AVX512.flags + ("-mavx512bf16", "-mavx512vnni"),
                     _AVX512.needs + ("avx512_bf16", "avx512_vnni"))),
    # Advanced SIMD is part of every ARMv8-A CPU: `neon` differs from `portable` by its intrinsics
    "aarch64": (Level("portable", ("-DOUTPACE_PORTABLE",), ()), Level("neon", (), ())),
}
_OTHER = (Level("portable", ("-DOUTPACE_PORTABLE",), ()),)


def architecture() -> str:
    machine = platform.machine().lower()
    return {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


def levels(arch: str | None = None) -> tuple[Level, ...]:
    """The levels of an architecture (this machine's by default), lowest first."""
    return LEVELS.get(arch or architecture(), _OTHER)


@functools.cache
def _cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (x86 `flags`, aarch64 `Features`); empty
    elsewhere, where only the levels that need no flag run."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_description() -> str:
    """This machine's kind and feature flags, for naming what timings taken on it depend on."""
    return f"{architecture()} {' '.join(sorted(_cpu_flags()))}"


def runnable() -> tuple[Level, ...]:
    """The levels this CPU executes, lowest first (portable always)."""
    return tuple(level for level in levels() if set(level.needs) <= _cpu_flags())


def _capped(cap: str) -> tuple[Level, ...]:
    names = [level.name for level in levels()]
    if cap not in names:
        raise InvalidParameterError(f"{ENV}={cap!r} is not a CPU kernel level of {architecture()}: "
                                    f"use one of {', '.join(names)}, or unset it")
    return tuple(level for level in runnable() if names.index(level.name) <= names.index(cap))


def chosen() -> Level:
    """The level the kernels run at: the highest this CPU has, at most OUTPACE_CPU_ISA's."""
    cap = os.environ.get(ENV, "").strip()
    if not cap:
        return runnable()[-1]
    below = _capped(cap)
    if below[-1].name != cap:
        _warn_lacking(cap, below[-1].name)
    return below[-1]


def testable() -> tuple[str, ...]:
    """The levels a test run proves: every level this CPU executes, at most OUTPACE_CPU_ISA's."""
    cap = os.environ.get(ENV, "").strip()
    return tuple(level.name for level in (_capped(cap) if cap else runnable()))


@functools.cache
def _warn_lacking(cap: str, used: str) -> None:
    missing = [level for level in levels() if level.name == cap][0].needs
    lacking = sorted(set(missing) - _cpu_flags())
    print(f"outpace: {ENV}={cap} but this CPU lacks {' '.join(lacking)}; the CPU kernels run at {used}",
          file=sys.stderr)
