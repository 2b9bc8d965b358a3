"""Builds a kernel source (cpu_kernels.c, recurrent_kernels.c) for one instruction-set level into
outpace's cache, once.

A level's library is `outpace_home()/kernels/<source's stem>-<level>-<key>.so`, the key a hash of
the sources, the compiler and the flags: a change to any of them builds anew. A level keeps its
KEEP_BUILDS most recently used builds (two checkouts of outpace run alternately, as
benchmarks/ab_revisions.py does, would otherwise rebuild at every switch) and deletes older
ones. One compile of one translation unit per level (about a second), with OpenMP where the
compiler has it (the libgomp PyTorch has already loaded), else single-threaded.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from outpace.kernels.cpu_isa import Level
from outpace.paths import outpace_home

FOLDER = Path(__file__).parent
SOURCE = FOLDER / "cpu_kernels.c"
# every level: optimised, no contraction of a * b + c into one rounding where the C does not ask
# for it (kernels and their scalar tails compute alike)
COMMON_FLAGS = ("-O3", "-ffp-contract=off", "-shared", "-fPIC")
KEEP_BUILDS = 4


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def library_path(level: Level, cc: str, source: Path = SOURCE) -> Path:
    """Where `source`'s build at this level goes: named by the source, the headers beside it (another
    checkout's kernels get their own), the compiler and the level's flags."""
    digest = hashlib.sha256()
    headers = sorted(source.parent.glob("cpu_*.h"))
    for part in (*(p.read_bytes() for p in (source, *headers)), cc.encode(), " ".join(level.flags).encode()):
        digest.update(part + b"\0")
    return outpace_home() / "kernels" / f"{source.stem}-{level.name}-{digest.hexdigest()[:16]}.so"


def compile_library(level: Level, out: Path, cc: str, openmp: bool = True, source: Path = SOURCE) -> None:
    """Compiles `source` at `level` into `out` (cc may be a cross compiler); OSError with the
    compiler's message when it fails."""
    command = [cc, *COMMON_FLAGS, *level.flags, "-o", str(out), str(source), "-lm"]
    done = subprocess.run(command + ["-fopenmp"], capture_output=True, text=True) if openmp else None
    if done is None or done.returncode != 0:
        done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:        # one line: the compiler's first error, else its last line
        lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
        why = next((line for line in lines if "error" in line), lines[-1])
        raise OSError(f"{' '.join(command)} failed: {why.strip()[:300]}")


def build(level: Level, source: Path = SOURCE) -> Path:
    """`source`'s library at this level, compiled on first use; OSError when no compiler builds it."""
    cc = compiler()
    if cc is None:
        raise OSError("no C compiler found (install gcc, or set CC)")
    library = library_path(level, cc, source)
    if library.exists():
        try:
            library.touch()     # recently used: kept before the level's older builds
        except OSError:         # a cache this process may read but not write
            pass
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
        partial = Path(tmp) / library.name
        compile_library(level, partial, cc, source=source)
        os.replace(partial, library)
    builds = sorted(library.parent.glob(f"{source.stem}-{level.name}-*.so"), key=_used, reverse=True)
    for stale in builds[KEEP_BUILDS:]:
        stale.unlink(missing_ok=True)
    return library


def _used(build: Path) -> float:
    """When a build was last built or loaded (0 for one another process deleted meanwhile)."""
    try:
        return build.stat().st_mtime
    except OSError:
        return 0.0
