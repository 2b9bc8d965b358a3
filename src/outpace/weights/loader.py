"""Build a model from a Hugging Face style folder: config.json plus (sharded) safetensors."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors import SafetensorError

from outpace.errors import CorruptModelError, ModelNotFoundError
from outpace.kernels import cpu_linear
from outpace.model.config import ModelConfig
from outpace.model.decoder import DecoderLM
from outpace.model.registry import FAMILIES
from outpace.model.rope import rope_tables
from outpace.model.tensor_parallel import Shard, TensorParallelLM, check_shardable
from outpace.weights import gguf, quantized


def load_model(folder: Path, dtype: torch.dtype, device: str, max_len: int, shard: Shard | None = None,
               weights: str = "auto", requantize: str | None = None) -> DecoderLM:
    """shard: this rank's part of a tensor-parallel model (None: the whole model). weights: how a
    GGUF folder's quantized matrices are held (weights.quantized: "auto" keeps them quantized on
    the CPU); requantize: "Q4_0" holds those that take more bytes a weight in Q4_0 (a draft
    model's, quantized.install)."""
    folder = Path(folder)
    cfg = ModelConfig.from_folder(folder)
    if not any(folder.glob("*.safetensors")):
        raise ModelNotFoundError(f"no *.safetensors weights in {folder}")
    is_quantized = quantized.chosen(folder, weights, device, shard is not None)
    # a GGUF folder's float32 copy of the matrices kept as blocks (its file, or the blocks in memory)
    copy = None if is_quantized else gguf.dequantized_copy(folder)
    taken: set[str] = set()         # weights held by QuantizedLinear layers, not read from the float copy
    install = (lambda m: taken.update(quantized.install(m, folder, requantize))) if is_quantized else None
    model = empty_model(cfg, dtype, device, max_len, shard, before_cast=install)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    files = sorted(folder.glob("*.safetensors"))
    for file in files + ([copy] if copy is not None and copy not in files else []):
        _read(model, params, file, taken, loaded)
    if "lm_head.weight" not in taken:
        model.tie_weights()
    if is_quantized and _missing(model, loaded):
        # a matrix the blocks could not serve (a fused layer with a float part): the float32 copy's
        extra = gguf.dequantized_copy(folder)
        if extra is not None and extra not in files:
            _read(model, params, extra, taken, loaded)
    missing = _missing(model, loaded)
    if missing:
        raise CorruptModelError(f"weights missing from {folder}: {', '.join(missing[:5])}"
                                f"{' ...' if len(missing) > 5 else ''}")
    del params  # packing replaces each linear's weight: the replaced ones must not outlive it
    return ready(model, device)


def _read(model: DecoderLM, params: dict, file: Path | gguf.BlocksAsFloats, taken: set[str], loaded: set[str]) -> None:
    """Copies file's tensors (a safetensors file, or blocks read as floats) into the model's
    parameters (those not in taken), adding their names (with a fused part's index: name#i) to
    loaded."""
    try:
        with safe_open(str(file), framework="pt", device="cpu") if isinstance(file, Path) else file as f:
            for hf_name in f.keys():
                mapped = model.map_weight(hf_name)
                if mapped is None:
                    continue
                if mapped[0] in taken:
                    loaded.add(mapped[0] if mapped[1] is None else f"{mapped[0]}#{mapped[1]}")
                    continue
                tensor = model.read_weight(f, hf_name)
                try:
                    parts = model.convert_weight(hf_name, tensor)
                except RuntimeError:        # a fused tensor that does not split as config.json's sizes do
                    raise CorruptModelError(f"tensor {hf_name} has shape {tuple(tensor.shape)}, which does "
                                            f"not split as config.json implies") from None
                for part_name, part in parts:
                    name, index = model.map_weight(part_name)
                    if name not in params:
                        raise CorruptModelError(f"{file.name}: tensor {hf_name} has no place in {model.cfg.architecture}")
                    _copy_into(model, params[name], name, index, part, hf_name)
                    loaded.add(name if index is None else f"{name}#{index}")
    except SafetensorError as e:
        raise CorruptModelError(f"{file} is not a readable safetensors file: {e}") from None


def empty_model(cfg: ModelConfig, dtype: torch.dtype, device: str, max_len: int,
                shard: Shard | None = None, before_cast=None) -> DecoderLM:
    """The model of cfg (or rank shard's part of it) on device, its weights uninitialised.
    before_cast(model): called while the weights are allocated in float32 but untouched (layers
    it replaces never take memory)."""
    family = FAMILIES[cfg.family]
    if shard is not None:
        check_shardable(cfg, shard.world_size, family)
    with torch.device("meta"):
        model = family(cfg, max_len) if shard is None else TensorParallelLM(cfg, max_len, shard)
    _allocate(model, device)
    if before_cast is not None:
        before_cast(model)
    model.to(dtype)
    # rope tables stay float32 whatever the model dtype; _allocate left them uninitialised
    cos, sin = rope_tables(cfg.head_dim, cfg.rope_theta, max_len, cfg.rope_scaling, cfg.rotary_dim)
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    return model


def _allocate(model: torch.nn.Module, device: str) -> None:
    """Every meta parameter and buffer of model replaced by uninitialised memory on device, shared
    ones staying shared. Module.to_empty does this through torch.empty_like, which on meta tensors
    runs PyTorch's Python reference and imports sympy: about 38 MB and a second of every start."""
    made = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is None or not t.is_meta:
                    continue
                if id(t) not in made:
                    empty = torch.empty(t.shape, dtype=t.dtype, device=device)
                    made[id(t)] = (torch.nn.Parameter(empty, requires_grad=t.requires_grad)
                                   if isinstance(t, torch.nn.Parameter) else empty)
                table[name] = made[id(t)]


def ready(model: DecoderLM, device: str) -> DecoderLM:
    """A model whose weights are in place, for inference (on the CPU, its linears packed)."""
    model.eval().requires_grad_(False)
    if str(device) == "cpu":
        cpu_linear.pack_linears(model)
    return model


def _copy_into(model: DecoderLM, param: torch.nn.Parameter, name: str, shard: int | None,
               tensor: torch.Tensor, hf_name: str) -> None:
    dest = param.data
    if shard is not None:
        sizes = model.shard_sizes(name)
        start = sum(sizes[:shard])
        dest = dest.narrow(0, start, sizes[shard])
    if dest.shape != tensor.shape:
        raise CorruptModelError(f"tensor {hf_name} has shape {tuple(tensor.shape)}, "
                                f"config.json implies {tuple(dest.shape)}")
    dest.copy_(tensor)


def _missing(model: DecoderLM, loaded: set[str]) -> list[str]:
    return [n for n in _expected(model) if n not in loaded]


def _expected(model: DecoderLM) -> list[str]:
    names = []
    for name, _ in model.named_parameters():
        if name == "lm_head.weight" and model.cfg.tie_word_embeddings:
            continue
        try:
            names += [f"{name}#{i}" for i in range(len(model.shard_sizes(name)))]
        except KeyError:
            names.append(name)
    return names
