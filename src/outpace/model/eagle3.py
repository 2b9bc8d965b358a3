"""The EAGLE-3 head (Li et al., 2025) and the checkpoint layout published heads use.

Three target layers' outputs (a low, a middle and a high one) are concatenated and fused by `fc`
(3 Ht -> H). The decoder layer's attention and its residual read a pair differently: the
attention reads [input_norm(embedding), hidden_norm(feature)] (2H wide: q, k and v project from
2H), the residual is the feature itself. Layout of a head folder:

  config.json        hidden_size, intermediate_size, num_attention_heads, num_key_value_heads,
                     head_dim, rms_norm_eps, rope_theta, rope_scaling, vocab_size (the target's),
                     draft_vocab_size, target_hidden_size; the layers it reads under
                     eagle_aux_hidden_state_layer_ids (top level or in eagle_config), numbered as
                     vLLM and SGLang do: id j is the input of layer j (the output of layer j - 1);
                     without them the target's layers 2, L // 2 and L - 3 in that numbering.
  *.safetensors      fc.weight; midlayer.self_attn.{q,k,v,o}_proj.weight;
                     midlayer.mlp.{gate,up,down}_proj.weight; midlayer.input_layernorm.weight,
                     midlayer.hidden_norm.weight, midlayer.post_attention_layernorm.weight;
                     norm.weight; lm_head.weight [draft_vocab_size, H]; d2t [draft_vocab_size]
                     int64 (target id = draft id + d2t[draft id]); t2d [vocab_size] bool (which
                     target ids the draft vocabulary holds); optionally embed_tokens.weight (else
                     the target's embedding is shared).

outpace's own extension, which heads it ships use to stay small: lm_head.weight may be int8 beside
lm_head.weight_scale [draft_vocab_size] float32, a row's weights being its int8 values times its
scale (save_eagle3_head's lm_head_int8).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from outpace.errors import CorruptModelError, IncompatibleModelsError, ModelNotFoundError
from outpace.kernels import cpu_kernels
from outpace.kernels.cpu_linear import QuantizedEmbedding, kernel_parts
from outpace.kernels.fused import linear, rms_norm_cat
from outpace.model.config import ModelConfig
from outpace.model.draft_head import DraftHead, HeadConfig
from outpace.model.layers import MLP, RMSNorm

# checkpoint name -> (our parameter, shard of a fused one: gate_up = [gate; up])
WEIGHTS = {
    "fc.weight": ("fc.weight", None),
    "midlayer.self_attn.q_proj.weight": ("q.weight", None),
    "midlayer.self_attn.k_proj.weight": ("k.weight", None),
    "midlayer.self_attn.v_proj.weight": ("v.weight", None),
    "midlayer.self_attn.o_proj.weight": ("o.weight", None),
    "midlayer.mlp.gate_proj.weight": ("mlp.gate_up.weight", 0),
    "midlayer.mlp.up_proj.weight": ("mlp.gate_up.weight", 1),
    "midlayer.mlp.down_proj.weight": ("mlp.down.weight", None),
    "midlayer.input_layernorm.weight": ("input_norm.weight", None),
    "midlayer.hidden_norm.weight": ("hidden_norm.weight", None),
    "midlayer.post_attention_layernorm.weight": ("post_norm.weight", None),
    "norm.weight": ("norm.weight", None),
    "lm_head.weight": ("lm_head.weight", None),
    "d2t": ("d2t", None),
}
OPTIONAL = {"embed_tokens.weight", "t2d", "lm_head.weight_scale"}


class Eagle3Head(DraftHead):
    def __init__(self, cfg: HeadConfig, max_positions: int):
        super().__init__(cfg, 2 * cfg.hidden_size, max_positions)
        self.fc = nn.Linear(len(cfg.target_layers) * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden.flatten(-2), self.fc)                       # [..., 3, Ht] -> [..., H]

    def attention_input(self, feature, embed):
        if feature.is_cuda:     # one kernel inside CUDA graphs
            return feature, rms_norm_cat(embed, self.input_norm.weight, feature, self.hidden_norm.weight,
                                         self.input_norm.eps)
        return feature, torch.cat([self.normed(self.input_norm, embed), self.normed(self.hidden_norm, feature)], dim=-1)

    def cpu_pair_head(self, embed: nn.Module, dtype: torch.dtype) -> cpu_kernels.PairHead | None:
        if not self.kernels or self.qkv is None or self.q_norm is not None:
            return None
        norms = (self.input_norm, self.post_norm, self.hidden_norm, self.norm)
        products = [kernel_parts(m) for m in (self.qkv, self.o, self.mlp.gate_up, self.mlp.down, self.lm_head)]
        if (any(type(n) is not RMSNorm for n in norms) or type(self.mlp) is not MLP
                or any(p is None or len(p) > cpu_kernels.MAX_PARTS for p in products)):
            return None
        if type(embed) is QuantizedEmbedding and embed.like.dtype == dtype:
            table = (embed.blocks, embed.qtype)
        elif type(embed) is nn.Embedding and embed.weight.dtype == dtype:
            table = (embed.weight.detach().contiguous(), None)
        else:
            return None
        input_norm, post_norm, hidden_norm, norm = (n.weight.detach().to(dtype).contiguous() for n in norms)
        cos, sin = (t.to(dtype).contiguous() for t in (self.rope_cos, self.rope_sin))
        return cpu_kernels.PairHead((input_norm, post_norm, *products[:4]), hidden_norm, norm, products[4],
                                    self.d2t.contiguous(), table, cos, sin, self.cfg.rms_norm_eps, self.cfg.num_heads,
                                    self.cfg.intermediate_size)


def default_layers(num_layers: int) -> tuple[int, ...]:
    """The target layers a head reads when its config names none: the outputs of layers 1,
    L // 2 - 1 and L - 4 (EAGLE-3's choice), or on a target too shallow for three distinct ones
    there, of the first, the middle and the last layer."""
    layers = (1, num_layers // 2 - 1, num_layers - 4)
    if layers[0] < layers[1] < layers[2]:
        return layers
    if num_layers < 3:
        raise IncompatibleModelsError(f"an EAGLE-3 head reads three target layers; the target has {num_layers}")
    return 0, (num_layers - 1) // 2, num_layers - 1


def head_config(raw: dict, target: ModelConfig) -> HeadConfig:
    """A head's config.json read and checked against the target it drafts for."""
    try:
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        rope = dict(raw.get("rope_parameters") or {})
        eagle = raw.get("eagle_config") or {}
        ids = raw.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
        cfg = HeadConfig(
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rope_scaling=raw.get("rope_scaling") or None,
            vocab_size=int(raw["vocab_size"]),
            draft_vocab_size=int(raw.get("draft_vocab_size") or raw["vocab_size"]),
            target_hidden_size=int(raw.get("target_hidden_size") or hidden),
            target_layers=tuple(int(i) - 1 for i in ids) if ids else default_layers(target.num_layers),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptModelError(f"the head's config.json is missing or has a bad field: {e}") from None
    what = "use a head trained for this target (outpace train-head makes one)"
    if cfg.vocab_size != target.vocab_size:
        raise IncompatibleModelsError(f"the head drafts for a vocabulary of {cfg.vocab_size} tokens, the target "
                                      f"has {target.vocab_size}: {what}")
    if cfg.target_hidden_size != target.hidden_size:
        raise IncompatibleModelsError(f"the head reads hidden states of size {cfg.target_hidden_size}, the "
                                      f"target's are {target.hidden_size}: {what}")
    layers = cfg.target_layers
    if len(layers) != 3 or list(layers) != sorted(set(layers)) or layers[0] < 0 or layers[-1] >= target.num_layers:
        raise IncompatibleModelsError(f"the head reads target layers {[i + 1 for i in layers]} (inputs of "
                                      f"those layers); the target has {target.num_layers}: {what}")
    return cfg


def load_eagle3_head(folder: Path, target: ModelConfig, dtype: torch.dtype, device, max_positions: int) -> Eagle3Head:
    """The head in `folder` (config.json and *.safetensors in the layout above), checked against
    the target; raises a clear error for a head that does not fit it."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ModelNotFoundError(f"no config.json in {folder}: give the folder of an EAGLE-3 head")
    try:
        raw = json.loads((folder / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise CorruptModelError(f"{folder / 'config.json'} is not valid JSON: {e}") from None
    tensors = _read_tensors(folder)
    cfg = head_config(raw, target)
    head = Eagle3Head(cfg, max_positions).to(dtype)
    params = dict(head.named_parameters()) | dict(head.named_buffers())
    missing = [name for name in WEIGHTS if name not in tensors]
    if missing:
        raise CorruptModelError(f"weights missing from {folder}: {', '.join(missing[:5])}")
    _dequantize_lm_head(tensors, folder)
    with torch.no_grad():
        for name, (ours, shard) in WEIGHTS.items():
            dest = params[ours]
            if shard is not None:
                dest = dest.narrow(0, shard * cfg.intermediate_size, cfg.intermediate_size)
            tensor = tensors[name]
            if dest.shape != tensor.shape:
                raise CorruptModelError(f"tensor {name} has shape {tuple(tensor.shape)}, the head's config.json "
                                        f"implies {tuple(dest.shape)}")
            dest.copy_(tensor)
        if "embed_tokens.weight" in tensors:
            head.embed = nn.Embedding.from_pretrained(tensors["embed_tokens.weight"].to(dtype))
    _check_vocab_map(head, tensors.get("t2d"), folder)
    if head.embed is None and cfg.hidden_size != target.hidden_size:
        raise IncompatibleModelsError(f"the head's hidden size is {cfg.hidden_size} and it has no embedding of its "
                                      f"own, so it would share the target's, of size {target.hidden_size}")
    return head.to(device=device, dtype=dtype).eval().requires_grad_(False)


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"no *.safetensors weights in {folder}")
    tensors = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    key = name.removeprefix("model.")
                    if key in WEIGHTS or key in OPTIONAL:
                        tensors[key] = f.get_tensor(name)
        except SafetensorError as e:
            raise CorruptModelError(f"{file} is not a readable safetensors file: {e}") from None
    return tensors


def _dequantize_lm_head(tensors: dict[str, torch.Tensor], folder: Path) -> None:
    """An int8 LM head (lm_head_int8) in float32: each row's values times its scale."""
    weight, scale = tensors["lm_head.weight"], tensors.pop("lm_head.weight_scale", None)
    if weight.dtype != torch.int8:
        if scale is not None:
            raise CorruptModelError(f"{folder}: lm_head.weight_scale beside an LM head of {weight.dtype}, not int8")
        return
    if scale is None or scale.shape != weight.shape[:1]:
        raise CorruptModelError(f"{folder}: an int8 lm_head.weight needs lm_head.weight_scale of shape "
                                f"[{weight.shape[0]}] (one scale a row)")
    tensors["lm_head.weight"] = weight.float() * scale.float()[:, None]


def _check_vocab_map(head: Eagle3Head, t2d: torch.Tensor | None, folder: Path) -> None:
    """d2t must map the draft ids onto distinct target ids, and t2d (when given) mark exactly them."""
    cfg = head.cfg
    ids = head.to_target(torch.arange(cfg.draft_vocab_size))
    if ids.min() < 0 or ids.max() >= cfg.vocab_size or len(ids.unique()) != len(ids):
        raise CorruptModelError(f"{folder}: d2t does not map the {cfg.draft_vocab_size} draft ids onto distinct "
                                f"ids of the target's {cfg.vocab_size}")
    if t2d is not None:
        marked = torch.zeros(cfg.vocab_size, dtype=torch.bool).index_fill_(0, ids, True)
        if t2d.shape != marked.shape or not torch.equal(t2d.bool(), marked):
            raise CorruptModelError(f"{folder}: t2d does not mark the target ids d2t maps the draft ids to")


def save_eagle3_head(head: Eagle3Head, folder: Path, dtype: torch.dtype = torch.bfloat16,
                     target_name: str | None = None, lm_head_int8: bool = False) -> None:
    """Write the head in the published layout (the vocabulary map and norms keep their dtypes'
    meaning: d2t int64, t2d bool). lm_head_int8: the LM head, the largest matrix of a head with a
    large draft vocabulary, as int8 with a float32 scale a row (its largest magnitude over 127),
    half its bfloat16 bytes; only outpace reads that extension."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = head.cfg
    state = dict(head.named_parameters()) | dict(head.named_buffers())
    tensors = {}
    for name, (ours, shard) in WEIGHTS.items():
        tensor = state[ours].detach()
        if shard is not None:
            tensor = tensor.narrow(0, shard * cfg.intermediate_size, cfg.intermediate_size)
        tensors[name] = tensor.to("cpu", torch.long if name == "d2t" else dtype).contiguous()
    ids = head.to_target(torch.arange(cfg.draft_vocab_size, device=head.d2t.device)).cpu()
    tensors["t2d"] = torch.zeros(cfg.vocab_size, dtype=torch.bool).index_fill_(0, ids, True)
    if lm_head_int8:
        weight = state["lm_head.weight"].detach().to("cpu", torch.float32)
        scale = weight.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127
        tensors["lm_head.weight"] = (weight / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
        tensors["lm_head.weight_scale"] = scale
    save_file(tensors, str(folder / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling,
        "vocab_size": cfg.vocab_size, "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size, "hidden_act": "silu", "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layers],
                         "use_aux_hidden_state": True},
    }
    if target_name is not None:
        config["target_model"] = target_name
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
