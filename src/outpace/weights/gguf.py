"""GGUF files -> Hugging Face style model folders, converted once into the outpace cache.

    <home>/models/<stem>-<key>/   config.json, tokenizer.json, tokenizer_config.json,
                                  generation_config.json,
                                  quantized/model.safetensors (the quantized matrices' GGUF blocks),
                                  quantized/q4_0.safetensors (a draft's matrices of types of more
                                    bytes a weight, requantized to Q4_0: written when a load first
                                    needs them, weights.quantized)
                                  model.safetensors (float32, Hugging Face names: every tensor but
                                    the matrices the CPU computes on as blocks),
                                  dequantized.safetensors (float32: those matrices, written when a
                                    load first needs them)

The quantized matrices are kept as the file holds them (uint8 [rows, bytes a row], their GGUF types
in the header's metadata, weights.quantized), so a CPU model computes on them (--weights
quantized). A matrix in a type the CPU kernels take gets its float32 copy only when a load needs
it (a GPU, tensor-parallel ranks, --weights bf16|fp32: `dequantized_copy`): a CPU user's folder
then holds about the GGUF's bytes, where a full float32 copy would take 7 times the file for
Qwen2.5-1.5B's Q4_K_M.

<home> is $OUTPACE_HOME or ~/.cache/outpace. <key> hashes the GGUF's path, size and mtime and the
converter's FORMAT, so an unchanged file converts once and a changed file (or converter) again; a
folder an older converter made of the same file is removed then. A folder is written under a
temporary name and renamed into place: if it exists, it is whole (so are the files written
later, under temporary names too: weights.write_once).

The header is parsed here (the format is small, and gguf.GGUFReader spends seconds building a
numpy view per vocabulary string); tensors are dequantized with gguf.quants.dequantize.
"""
from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import shutil
import struct
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quant_shape_from_byte_shape, quant_shape_to_byte_shape
from safetensors import safe_open
from tqdm import tqdm

from outpace.errors import CorruptModelError, ModelNotFoundError, OutpaceError, UnsupportedModelError
from outpace.kernels import cpu_kernels
from outpace.paths import outpace_home
from outpace.weights.tokenizer import tokenizer_from_gguf
from outpace.weights.write_once import write_once

_REQUIRED = object()
FORMAT = 4  # bump when the converted folder changes, so old conversions are redone
QUANTIZED_FOLDER, QTYPES_KEY = "quantized", "qtypes"      # the GGUF blocks' file, and its metadata's key
# model.safetensors' metadata key: the matrices whose float32 copy waits for DEQUANTIZED_FILE
LATER_KEY, DEQUANTIZED_FILE = "dequantized_later", "dequantized.safetensors"
FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64"})

# GGUF architecture -> (Hugging Face class, model_type). llama.cpp files Mistral under llama.
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def convert_gguf(path: str | Path) -> Path:
    """The converted folder for a GGUF file, converting it on the first call only."""
    source = Path(path).expanduser().resolve()
    if not source.is_file():
        raise ModelNotFoundError(f"no GGUF file at {source}; check the path.")
    folder = _folder(source, FORMAT)
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(folder)
    work = Path(tempfile.mkdtemp(prefix=f".tmp-{folder.name}-", dir=folder.parent))
    work.chmod(0o755)
    try:
        _convert(GGUFFile(source), work)
        os.replace(work, folder)
    except OSError:
        if not (folder / "config.json").is_file():  # not a concurrent conversion that won
            raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for old in range(1, FORMAT):        # this file's conversions by older converters: never read again
        shutil.rmtree(_folder(source, old), ignore_errors=True)
    return folder


def _folder(source: Path, version: int) -> Path:
    """Where converter FORMAT version keeps the conversion of the GGUF file at source."""
    stat = source.stat()
    key = hashlib.sha256(f"{version}\0{source}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return outpace_home() / "models" / f"{source.stem}-{key}"


def dequantized_copy(folder: Path) -> Path | BlocksAsFloats | None:
    """The float32 copy of the matrices a converted folder keeps as blocks only (LATER_KEY),
    dequantized from those blocks and written on the first call (one writer at a time: tensor-
    parallel ranks load together); where it cannot be written (a full disk, a read-only folder:
    stderr says so), the blocks read as floats in memory instead. None where the folder left none
    out (a GGUF of float tensors, a Hugging Face folder)."""
    folder = Path(folder)
    path, floats = folder / DEQUANTIZED_FILE, folder / "model.safetensors"
    if path.is_file() or not floats.is_file() or not (folder / QUANTIZED_FOLDER).is_dir():
        return path if path.is_file() else None
    with safe_open(str(floats), framework="np") as f:
        later = json.loads((f.metadata() or {}).get(LATER_KEY, "[]"))
    if not later:
        return None
    blocks = str(folder / QUANTIZED_FOLDER / "model.safetensors")
    with safe_open(blocks, framework="pt") as f:
        qtypes = json.loads(f.metadata()[QTYPES_KEY])
        types = {name: GGMLQuantizationType[qtypes[name]] for name in later}
        specs = [(name, quant_shape_from_byte_shape(f.get_slice(name).get_shape(), types[name])) for name in later]

        def write(work: Path) -> None:
            arrays = (_dequantized(f.get_tensor(name), types[name])
                      for name in tqdm(later, desc=f"outpace: float32 copy of {folder.name}", unit="tensor",
                                       file=sys.stderr, disable=None))
            write_safetensors(work, specs, arrays)
        if write_once(path, sum(4 * math.prod(shape) for _, shape in specs), write,
                      f"float32 copy of {folder.name}'s quantized matrices",
                      "they are dequantized in memory at every start instead"):
            return path
    return BlocksAsFloats(blocks, types)


class BlocksAsFloats:
    """Matrices of a blocks file read as float32 in memory, as a safetensors file of them would
    give them (keys, get_tensor, get_slice; a context manager, as safe_open)."""

    name = "quantized/model.safetensors, dequantized in memory"

    def __init__(self, blocks: str, types: dict[str, GGMLQuantizationType]):
        self.blocks, self.types = blocks, types

    def __enter__(self) -> BlocksAsFloats:
        self._open = safe_open(self.blocks, framework="pt")
        self._file = self._open.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._open.__exit__(*exc)

    def keys(self) -> list[str]:
        return list(self.types)

    def get_tensor(self, name: str) -> torch.Tensor:
        return torch.from_numpy(_dequantized(self._file.get_tensor(name), self.types[name]))

    def get_slice(self, name: str) -> _Slice:
        return _Slice(self.get_tensor(name))


class _Slice:
    """A tensor read as safetensors' slices are: its shape, and its parts by index."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index) -> torch.Tensor:
        return self.tensor[index]


def _dequantized(blocks: torch.Tensor, qtype: GGMLQuantizationType) -> np.ndarray:
    """A matrix's blocks [rows, bytes a row] as float32, by the CPU kernels' dequantizer where
    they are built (gguf's numpy dequantizer bit for bit, several times faster), else by gguf's."""
    if cpu_kernels.has_library():
        return cpu_kernels.dequantize_rows(blocks, qtype.name, torch.arange(blocks.shape[0]), torch.float32).numpy()
    return dequantize(blocks.numpy(), qtype)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order: rows first (GGUF stores the reverse)
    qtype: GGMLQuantizationType
    offset: int  # absolute, in the file
    num_bytes: int


class GGUFFile:
    """A GGUF file's metadata and tensor directory; tensors stay in the file until `load`."""

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            self.size = os.fstat(f.fileno()).st_size
            if self.size < 24 or f.read(4) != b"GGUF":
                raise CorruptModelError(f"{path} is not a GGUF file (no GGUF magic); pass a .gguf model file.")
            self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self.meta, self.tensors = self._parse()
        except (struct.error, ValueError, IndexError, OverflowError, KeyError) as error:
            raise CorruptModelError(f"{path} is truncated or corrupt ({type(error).__name__}: {error}); "
                                    "download the file again.") from None

    def load(self, info: TensorInfo) -> np.ndarray:
        """The tensor as float32, in numpy order."""
        raw = np.frombuffer(self._buf, np.uint8, info.num_bytes, info.offset)
        return dequantize(raw.reshape(quant_shape_to_byte_shape(info.shape, info.qtype)), info.qtype)

    def blocks(self, info: TensorInfo) -> np.ndarray:
        """A matrix's raw GGUF blocks as uint8 [rows, bytes a row], in the file's memory."""
        return np.frombuffer(self._buf, np.uint8, info.num_bytes, info.offset).reshape(info.shape[0], -1)

    def _parse(self) -> tuple[dict[str, Any], list[TensorInfo]]:
        self._pos = 4
        version = self._scalar("<I")
        if version not in (2, 3):
            raise CorruptModelError(f"{self.path} has GGUF version {version}; outpace reads versions 2 and 3 "
                                    "(little-endian). Convert the model again with a current llama.cpp.")
        num_tensors, num_kv = self._scalar("<Q"), self._scalar("<Q")
        meta = {}
        for _ in range(num_kv):
            key = self._string()
            meta[key] = self._value(self._scalar("<I"))
        entries = []
        for _ in range(num_tensors):
            name, num_dims = self._string(), self._scalar("<I")
            if num_dims > 4:  # GGML_MAX_DIMS
                raise ValueError(f"tensor {name!r} claims {num_dims} dimensions")
            dims = [self._scalar("<Q") for _ in range(num_dims)]
            entries.append((name, tuple(reversed(dims)), GGMLQuantizationType(self._scalar("<I")), self._scalar("<Q")))
        alignment = meta.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0:
            raise ValueError(f"general.alignment is {alignment!r}")
        start = -(-self._pos // alignment) * alignment
        tensors = []
        for name, shape, qtype, offset in entries:
            block_size, type_size = GGML_QUANT_SIZES[qtype]
            if shape and shape[-1] % block_size:
                raise ValueError(f"tensor {name!r} rows of {shape[-1]} are not whole {qtype.name} blocks")
            num_bytes = math.prod(shape) // block_size * type_size
            if start + offset + num_bytes > self.size:
                raise ValueError(f"tensor {name} ends at byte {start + offset + num_bytes}, the file at {self.size}")
            tensors.append(TensorInfo(name, shape, qtype, start + offset, num_bytes))
        return meta, tensors

    # Value types 0..12: u8 i8 u16 i16 u32 i32 f32 bool string array u64 i64 f64.
    _FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}

    def _scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._scalar("<Q")
        if self._pos + length > self.size:
            raise ValueError(f"a string of {length} bytes runs past the end of the file")
        self._pos += length
        return self._buf[self._pos - length:self._pos].decode("utf-8", errors="replace")

    def _value(self, kind: int) -> Any:
        if kind == 8:
            return self._string()
        if kind != 9:
            return self._scalar(self._FORMATS[kind])
        item_kind, count = self._scalar("<I"), self._scalar("<Q")
        if count > self.size - self._pos:  # every item takes at least one byte
            raise ValueError(f"an array of {count} items runs past the end of the file")
        if item_kind == 8:  # vocabularies: tens of thousands of strings, so no per-item method calls
            items, pos, buf, length = [], self._pos, self._buf, struct.Struct("<Q").unpack_from
            for _ in range(count):
                end = pos + 8 + length(buf, pos)[0]
                items.append(buf[pos + 8:end].decode("utf-8", errors="replace"))
                pos = end
            if pos > self.size:
                raise ValueError("a string array runs past the end of the file")
            self._pos = pos
            return items
        if item_kind in self._FORMATS:
            items = np.frombuffer(self._buf, self._FORMATS[item_kind], count, self._pos)
            self._pos += items.nbytes
            return items.tolist()
        return [self._value(item_kind) for _ in range(count)]


def hf_tensor_name(name: str) -> str:
    """llama.cpp's tensor name -> Hugging Face's: blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight."""
    base, _, suffix = name.rpartition(".")
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{suffix}"
    if base in TOP_NAMES:
        return f"{TOP_NAMES[base]}.{suffix}"
    raise UnsupportedModelError(f"GGUF tensor {name!r} has no Hugging Face counterpart in outpace's "
                                f"{sorted(ARCHITECTURES)} models; this file holds a variant outpace cannot run.")


def rotary_permute(weight: np.ndarray, num_heads: int, inverse: bool = False) -> np.ndarray:
    """llama.cpp's row order for q/k in llama files (each head's rotary halves interleaved), or back.

    Hugging Face rows of one head: [x0 .. x_{d/2-1} | y0 .. y_{d/2-1}]; llama.cpp: [x0 y0 x1 y1 ...].
    """
    pairs = (num_heads, weight.shape[0] // num_heads // 2, 2) if inverse else (num_heads, 2, -1)
    return weight.reshape(*pairs, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def hf_config(meta: dict[str, Any], tensors: list[TensorInfo], rope_factors: np.ndarray | None = None) -> dict:
    """config.json for the model; rope_factors is the file's rope_freqs.weight, if it has one."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(f"GGUF architecture {arch!r} is not supported; outpace runs "
                                    f"{sorted(ARCHITECTURES)}. Pick a model of one of those families.")
    shapes = {t.name: t.shape for t in tensors}
    for name in ("token_embd.weight", "blk.0.attn_q.weight"):
        if name not in shapes:
            raise CorruptModelError(f"GGUF file has no {name} tensor; the file is incomplete, download it again.")

    def get(key: str, default: Any = _REQUIRED) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is _REQUIRED:
            raise CorruptModelError(f"GGUF metadata lacks {arch}.{key}; the file is incomplete, download it again.")
        if isinstance(value, list):  # per-layer values: only uniform ones are supported
            if len(set(value)) != 1:
                raise UnsupportedModelError(f"{arch}.{key} varies per layer ({value}); outpace needs uniform layers.")
            value = value[0]
        return value

    num_heads = get("attention.head_count")
    head_dim = get("attention.key_length", shapes["blk.0.attn_q.weight"][0] // num_heads)
    config = {
        "architectures": [ARCHITECTURES[arch][0]], "model_type": ARCHITECTURES[arch][1],
        "hidden_size": get("embedding_length"), "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"), "num_attention_heads": num_heads,
        "num_key_value_heads": get("attention.head_count_kv", num_heads), "head_dim": head_dim,
        "hidden_act": "silu", "rms_norm_eps": get("attention.layer_norm_rms_epsilon"),
        "rope_theta": get("rope.freq_base", 10000.0), "rope_scaling": _rope_scaling(get, rope_factors, head_dim),
        "max_position_embeddings": get("context_length"), "vocab_size": shapes["token_embd.weight"][0],
        "tie_word_embeddings": "output.weight" not in shapes, "torch_dtype": "float32",
    }
    if arch != "qwen2":  # Qwen2 always has q/k/v biases; the others say so
        config["attention_bias"] = "blk.0.attn_q.bias" in shapes
    for name in ("bos", "eos", "padding"):
        if f"tokenizer.ggml.{name}_token_id" in meta:
            config[f"{name.replace('padding', 'pad')}_token_id"] = meta[f"tokenizer.ggml.{name}_token_id"]
    return config


def _rope_scaling(get, rope_factors: np.ndarray | None, head_dim: int) -> dict | None:
    if rope_factors is not None:
        return _llama3_scaling(rope_factors, head_dim, get("rope.freq_base", 10000.0))
    kind = get("rope.scaling.type", "none")
    if kind == "linear":
        return {"rope_type": "linear", "factor": get("rope.scaling.factor")}
    if kind == "yarn":
        return {"rope_type": "yarn", "factor": get("rope.scaling.factor"),
                "original_max_position_embeddings": get("rope.scaling.original_context_length")}
    if kind != "none":
        raise UnsupportedModelError(f"rope scaling {kind!r} is not supported; outpace knows linear, yarn and llama3.")
    return None


def llama3_rope_factors(head_dim: int, theta: float, factor: float, low: float = 1.0, high: float = 4.0,
                        original: int = 8192) -> np.ndarray:
    """The per-frequency divisors llama.cpp stores as rope_freqs.weight for Llama 3.1+ scaling: 1 for
    wavelengths under original/high, `factor` above original/low, a smooth blend between."""
    wavelength = 2 * np.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    smooth = (original / wavelength - low) / (high - low)
    blend = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelength < original / high, 1.0, np.where(wavelength > original / low, factor, blend))


def _llama3_scaling(factors: np.ndarray, head_dim: int, theta: float) -> dict:
    # Only the factor differs between Llama 3.1 (8) and 3.2 (32); the rest is Meta's published recipe.
    scaling = {"rope_type": "llama3", "factor": float(factors.max()), "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    expected = llama3_rope_factors(head_dim, theta, scaling["factor"])
    if factors.shape != expected.shape or not np.allclose(factors, expected, rtol=1e-4):
        raise UnsupportedModelError("rope_freqs.weight does not follow Llama 3 rope scaling; outpace cannot run it.")
    return scaling


def _convert(gguf: GGUFFile, folder: Path) -> None:
    meta, by_name = gguf.meta, {t.name: t for t in gguf.tensors}
    rope_factors = gguf.load(by_name.pop("rope_freqs.weight")) if "rope_freqs.weight" in by_name else None
    try:
        config = hf_config(meta, list(by_name.values()), rope_factors)
        backend, tokenizer_config = tokenizer_from_gguf(meta)
    except OutpaceError:
        raise
    except Exception as error:  # metadata of the wrong type, or a vocabulary the tokenizers library rejects
        raise CorruptModelError(f"{gguf.path} has inconsistent metadata ({error}); download the file again.") from None
    tokenizer_config["model_max_length"] = config["max_position_embeddings"]
    eos_ids = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                 "tokenizer.ggml.eom_token_id") if k in meta]
    generation = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": sorted(set(eos_ids)) or None,
                  "pad_token_id": config.get("pad_token_id")}
    for name, content in (("config.json", config), ("tokenizer_config.json", tokenizer_config),
                          ("generation_config.json", generation)):
        (folder / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    backend.save(str(folder / "tokenizer.json"))

    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    is_permuted = meta["general.architecture"] == "llama"

    # the float32 copy now of every tensor but the matrices the CPU kernels read as blocks
    now = [t for t in by_name.values() if _float_now(t)]

    def tensors() -> Iterator[np.ndarray]:
        for info in tqdm(now, desc=f"outpace: converting {gguf.path.name}", unit="tensor",
                         file=sys.stderr, disable=None):
            weight = gguf.load(info)
            role = info.name.split(".")[-2]
            if is_permuted and role in heads:
                weight = rotary_permute(weight, heads[role], inverse=True)
            yield weight

    later = [hf_tensor_name(t.name) for t in by_name.values() if not _float_now(t)]
    write_safetensors(folder / "model.safetensors", [(hf_tensor_name(t.name), t.shape) for t in now], tensors(),
                      metadata={LATER_KEY: json.dumps(later)} if later else None)

    quantized = [t for t in by_name.values() if len(t.shape) == 2 and t.qtype.name not in FLOAT_TYPES]

    def blocks() -> Iterator[np.ndarray]:
        for info in quantized:      # rows permuted as the float32 copy's: a row's blocks move whole
            raw, role = gguf.blocks(info), info.name.split(".")[-2]
            yield rotary_permute(raw, heads[role], inverse=True) if is_permuted and role in heads else raw

    (folder / QUANTIZED_FOLDER).mkdir()
    write_safetensors(folder / QUANTIZED_FOLDER / "model.safetensors",
                      [(hf_tensor_name(t.name), (t.shape[0], t.num_bytes // t.shape[0])) for t in quantized], blocks(),
                      np.uint8, {QTYPES_KEY: json.dumps({hf_tensor_name(t.name): t.qtype.name for t in quantized})})


def _float_now(info: TensorInfo) -> bool:
    """Whether conversion writes a tensor's float32 copy: all but a matrix in a type the CPU
    kernels take, with whole blocks a row, whose blocks a CPU model reads instead
    (weights.quantized: products, and the embedding's rows)."""
    return (info.qtype.name in FLOAT_TYPES or len(info.shape) != 2
            or cpu_kernels.unserved([info.qtype.name], info.shape[1]) is not None)


def write_safetensors(path: Path, specs: list[tuple[str, tuple[int, ...]]], arrays: Iterator[np.ndarray],
                      dtype: type = np.float32, metadata: dict[str, str] | None = None) -> None:
    """Streams float32 (or uint8) tensors into a safetensors file: header first (shapes are known),
    then each tensor as it is produced, so at most two dequantized tensors are in memory at a time."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    item, kind = np.dtype(dtype).itemsize, {np.float32: "F32", np.uint8: "U8"}[dtype]
    offset = 0
    for name, shape in specs:
        end = offset + item * int(np.prod(shape, dtype=np.int64))
        header[name] = {"dtype": kind, "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
    # One writer thread: the disk write of tensor i (GIL released) overlaps the dequantization of i+1.
    with open(path, "wb") as f, ThreadPoolExecutor(max_workers=1) as writer:
        f.write(struct.pack("<Q", len(blob)) + blob)
        pending = None
        for (name, shape), array in zip(specs, arrays, strict=True):
            assert array.shape == shape, (name, array.shape, shape)
            if pending is not None:
                pending.result()
            pending = writer.submit(f.write, np.ascontiguousarray(array, dtype=dtype).data)
        if pending is not None:
            pending.result()


def _remove_stale(folder: Path, max_age_s: float = 3600.0) -> None:
    """Temp folders of conversions that died (a live one finishes in well under an hour)."""
    for stale in folder.parent.glob(f".tmp-{folder.name}-*"):
        try:
            if time.time() - stale.stat().st_mtime > max_age_s:
                shutil.rmtree(stale, ignore_errors=True)
        except OSError:  # removed meanwhile by another process
            pass


# ---- test files -------------------------------------------------------------------------------
