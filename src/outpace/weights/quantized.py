"""A GGUF model's quantized matrices kept in their GGUF types on the CPU (`weights="quantized"`).

A converted GGUF folder holds each quantized matrix as the file's blocks in
quantized/model.safetensors, and a float32 copy (weights.gguf: at conversion for those the kernels
cannot take, else written when a load first needs it). Here a model's linear layers whose blocks
have CPU kernels (cpu_kernels.QUANT_FORMATS) become QuantizedLinear layers over those blocks
before any float weight is allocated for them, so memory holds about the GGUF's bytes for them; a
fused layer (qkv, gate_up) takes its parts' rows in order, one QuantizedLinear when they share one
type, else a QuantizedParts of one a part. The embedding looks its rows up in its blocks
(QuantizedEmbedding), and a tied LM head computes on them; the norms, matrices of types without
kernels and those whose inputs are not whole blocks of their type keep float weights in the
model's dtype.

`weights`: "quantized" or "auto" (quantized where it can be: a GGUF folder, on the CPU, the kernels
loaded, one rank), or "bf16" / "fp32" (the float copy, EngineConfig makes them the model's dtype).

A draft model may hold its matrices in fewer bits than its file's (`requantize`): on the CPU a
draft is bound by the bytes it reads a token, and its weights' rounding changes its drafts alone,
never the target's output. The first such load writes the requantized blocks beside the file's
(quantized/q4_0.safetensors, requantized_copy), and later loads read them.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_from_byte_shape, quant_shape_to_byte_shape
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from outpace.errors import InvalidParameterError
from outpace.kernels import cpu_kernels
from outpace.kernels.cpu_linear import QuantizedEmbedding, QuantizedLinear, QuantizedParts
from outpace.weights.gguf import QTYPES_KEY, QUANTIZED_FOLDER, write_safetensors
from outpace.weights.write_once import write_once

_SIZES = {qtype.name: sizes for qtype, sizes in GGML_QUANT_SIZES.items()}     # (weights, bytes) a block


def blocks_file(folder: Path) -> Path:
    return Path(folder) / QUANTIZED_FOLDER / "model.safetensors"


def chosen(folder: Path, weights: str, device: str, sharded: bool) -> bool:
    """Whether a model loads its quantized matrices quantized; a request for that which cannot be
    met says why on stderr (the float copy is loaded instead)."""
    if weights not in ("auto", "quantized"):
        return False
    if not blocks_file(folder).is_file():
        if weights == "quantized":
            raise InvalidParameterError(f"weights quantized needs a GGUF model (a .gguf file or a known name); "
                                        f"{folder} holds float weights only: use weights auto, bf16 or fp32")
        return False
    why = ("the quantized kernels run on the CPU" if str(device) != "cpu" else
           "tensor-parallel ranks read float weights" if sharded else
           "the CPU kernels are off" if not cpu_kernels.has_library() else None)
    if why is not None:
        print(f"outpace: GGUF weights dequantized ({why}); they take 2-4x the file's memory", file=sys.stderr)
    return why is None


def install(model: nn.Module, folder: Path, requantize: str | None = None) -> set[str]:
    """Replaces model's linear layers (on the CPU, their float weights allocated but untouched, as
    loader.empty_model calls it) with QuantizedLinear (or QuantizedParts) layers over the folder's
    blocks wherever every part has kernels and the inputs are whole blocks of each part's type, and
    its embedding with a QuantizedEmbedding where its type allows. requantize "Q4_0": a matrix
    whose type takes more bytes a weight is held in Q4_0 instead (requantized_copy's blocks).
    Returns the weight names (model.map_weight's) they took; says on stderr which matrices stay
    float, why, and what that costs."""
    if requantize not in (None, "Q4_0"):
        raise InvalidParameterError(f"requantize takes Q4_0 alone, got {requantize!r}")
    with safe_open(str(blocks_file(folder)), framework="pt", device="cpu") as f:
        qtypes: dict[str, str] = json.loads(f.metadata()[QTYPES_KEY])
        parts: dict[str, dict[int | None, str]] = {}            # our weight name -> shard index -> HF name
        for hf_name in qtypes:
            mapped = model.map_weight(hf_name)
            if mapped is not None:
                parts.setdefault(mapped[0], {})[mapped[1]] = hf_name
        if model.cfg.tie_word_embeddings and "model.embed_tokens.weight" in qtypes:
            parts["lm_head.weight"] = {None: "model.embed_tokens.weight"}
        taken, dequantized = set(), {}                          # why -> HF names of blocks left to the float copy
        linears = []                                            # (name, linear, its parts' HF names in row order)
        for name, by_index in parts.items():
            linear = model.get_submodule(name.rpartition(".")[0])
            if isinstance(linear, nn.Embedding) and None in by_index and name.endswith(".weight"):
                qtype = qtypes[by_index[None]]
                if cpu_kernels.unserved([qtype], linear.embedding_dim) is None:     # lookups dequantize rows of the blocks
                    # a copy: the file's tensor keeps the whole file mapped, its read pages resident
                    embedding = QuantizedEmbedding(f.get_tensor(by_index[None]).clone(), qtype, linear.embedding_dim)
                    _replace(model, name, embedding)
                    taken.add(name)
                continue
            if not isinstance(linear, nn.Linear) or name.endswith(".bias"):
                continue
            hf_names = [by_index[i] for i in sorted(by_index, key=lambda i: i or 0)]      # the parts' rows in order
            why = cpu_kernels.unserved([qtypes[n] for n in hf_names], linear.in_features)
            if why is not None:
                dequantized.setdefault(why, []).extend(hf_names)
            elif sum(f.get_slice(n).get_shape()[0] for n in hf_names) == linear.out_features:
                linears.append((name, linear, hf_names))        # else a part is not quantized: the float copy serves
        wanted = {n: qtypes[n] for _, linear, hf_names in linears for n in hf_names
                  if requantize is not None and is_requantized(qtypes[n], linear.in_features, requantize)}
        copy = requantized_copy(folder, f, wanted, requantize) if wanted else {}

        def held(hf_name: str) -> tuple[torch.Tensor, str]:
            """A matrix's blocks and type as its layer holds them: the requantized copy's, else the
            file's (requantized here where the copy could not be written)."""
            if hf_name in copy:
                return copy[hf_name]
            blocks = f.get_tensor(hf_name)
            return requantized(blocks, qtypes[hf_name], requantize) if hf_name in wanted else (blocks, qtypes[hf_name])

        for name, linear, hf_names in linears:
            blocks, types = zip(*map(held, hf_names))
            shape = (linear.in_features, linear.out_features, linear.bias is not None)
            _replace(model, name, QuantizedLinear(torch.cat(blocks), types[0], *shape) if len(set(types)) == 1
                     else QuantizedParts(list(zip(blocks, types)), *shape))
            taken.add(name)
        for why, names in dequantized.items():
            _warn(why, names, qtypes, {n: f.get_slice(n).get_shape() for n in names})
    return taken


def _replace(model: nn.Module, name: str, layer: nn.Module) -> None:
    """Puts layer where weight `name`'s module is."""
    parent, _, child = name.rpartition(".")[0].rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, layer)


def is_requantized(qtype: str, in_features: int, to: str) -> bool:
    """Whether requantized changes a matrix: its type takes more bytes a weight than `to`, and
    its inputs are whole blocks of `to`."""
    return (_SIZES[qtype][1] / _SIZES[qtype][0] > _SIZES[to][1] / _SIZES[to][0]
            and in_features % _SIZES[to][0] == 0)


def requantized(blocks: torch.Tensor, qtype: str, to: str, rows: int = 4096) -> tuple[torch.Tensor, str]:
    """A matrix's blocks of type qtype in type `to` ("Q4_0") where is_requantized, else as they
    are: dequantized exactly, then quantized as gguf-py quantizes, `rows` rows at a time (a float32
    copy of a whole LM head is half a GB)."""
    K = quant_shape_from_byte_shape(blocks.shape, GGMLQuantizationType[qtype])[-1]
    if not is_requantized(qtype, K, to):
        return blocks, qtype
    out = torch.empty(quant_shape_to_byte_shape((blocks.shape[0], K), GGMLQuantizationType[to]), dtype=torch.uint8)
    for start in range(0, blocks.shape[0], rows):
        ids = torch.arange(start, min(start + rows, blocks.shape[0]))
        values = cpu_kernels.dequantize_rows(blocks, qtype, ids, torch.float32)
        out[start:start + rows] = cpu_kernels.quantize_q4_0(values)
    return out, to


def requantized_copy(folder: Path, f, qtypes: dict[str, str], to: str) -> dict[str, tuple[torch.Tensor, str]]:
    """The matrices qtypes names (HF name -> type, each one is_requantized) as requantized blocks
    of type `to`, by HF name: from <folder>/quantized/<to>.safetensors (uint8 [rows, bytes a row],
    their types in its metadata, as model.safetensors beside it), which the first call writes from
    f (the folder's blocks file, open). Where it cannot be written (stderr says so), none."""
    # kept as long as the folder: a change to quantize_q4_0's bytes must bump gguf.FORMAT, so that
    # folders convert, and their copies are written, again
    path = folder / QUANTIZED_FOLDER / f"{to.lower()}.safetensors"
    # each matrix's [rows, bytes a row] in its type, as [rows, K] weights, as [rows, bytes a row] in `to`
    specs = [(n, quant_shape_to_byte_shape(quant_shape_from_byte_shape(f.get_slice(n).get_shape(),
                                                                       GGMLQuantizationType[qtypes[n]]),
                                           GGMLQuantizationType[to])) for n in qtypes]

    def write(work: Path) -> None:
        arrays = (requantized(f.get_tensor(n), qtypes[n], to)[0].numpy()
                  for n in tqdm(qtypes, desc=f"outpace: {to} copy of {folder.name}", unit="tensor",
                                file=sys.stderr, disable=None))
        write_safetensors(work, specs, arrays, np.uint8, {QTYPES_KEY: json.dumps(dict.fromkeys(qtypes, to))})
    need = sum(math.prod(shape) for _, shape in specs)
    if not path.is_file() and not write_once(path, need, write, f"{to} copy of {folder.name}'s matrices",
                                             "they are requantized in memory at every start instead"):
        return {}
    with safe_open(str(path), framework="pt", device="cpu") as copy:     # tensors stay mapped once it closes
        types = json.loads(copy.metadata()[QTYPES_KEY])
        return {n: (copy.get_tensor(n), types[n]) for n in copy.keys()}


def _warn(why: str, names: list[str], qtypes: dict[str, str], shapes: dict[str, list[int]]) -> None:
    """One stderr line: which blocks stay float, why, and what that costs."""
    file_bytes = sum(rows * row_bytes for rows, row_bytes in shapes.values())
    weights = sum(rows * row_bytes // _SIZES[qtypes[n]][1] * _SIZES[qtypes[n]][0]
                  for n, (rows, row_bytes) in shapes.items())
    print(f"outpace: {why}: {len(names)} matrices dequantized to the model's dtype, {2 * weights / 1e6:.1f} MB in "
          f"bfloat16 ({4 * weights / 1e6:.1f} in float32) where the file holds {file_bytes / 1e6:.1f} MB",
          file=sys.stderr)
