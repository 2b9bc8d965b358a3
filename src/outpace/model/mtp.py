"""A multi-token-prediction (MTP) module, as DeepSeek-V3 and Qwen3-Next ship beside the model.

Pair p is (the target's final hidden state at p, the embedding of token p + 1): both are normed,
concatenated [embedding, hidden] and projected back to H; one decoder layer of the target's shape
follows, then a final norm and the target's own LM head (shared, as its embedding is). Later draft
steps feed the module's own output back as the hidden state. The module has the target's shape
(config.json's fields), so only its weights are read, under either layout:

  Qwen3-Next   mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden, mtp.fc, mtp.layers.0.* (the
               decoder layer's names), mtp.norm
  DeepSeek-V3  model.layers.{L}.enorm, .hnorm, .eh_proj, the decoder layer's names, and
               .shared_head.norm, L the target's number of layers (.shared_head.head and
               .embed_tokens, copies of the target's, are not read)

Covered: attention with q/k/v/o projections (and per-head q/k norms where the target has them) and
a dense SwiGLU MLP. Refused with a clear error: gated attention (Qwen3-Next's query carries its
gate), multi-head latent attention (DeepSeek-V3) and mixtures of experts, which the published MTP
modules use; no real MTP weights were reachable when this was written, so it is tested on tiny
random ones.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from outpace.errors import CorruptModelError, ModelNotFoundError, UnsupportedModelError
from outpace.model.decoder import DecoderLM
from outpace.model.draft_head import DraftHead, HeadConfig

# the decoder layer's checkpoint names (after the layout's prefix) -> (ours, shard of gate_up)
LAYER = {
    "input_layernorm.weight": ("input_norm.weight", None),
    "self_attn.q_proj.weight": ("q.weight", None),
    "self_attn.k_proj.weight": ("k.weight", None),
    "self_attn.v_proj.weight": ("v.weight", None),
    "self_attn.o_proj.weight": ("o.weight", None),
    "post_attention_layernorm.weight": ("post_norm.weight", None),
    "mlp.gate_proj.weight": ("mlp.gate_up.weight", 0),
    "mlp.up_proj.weight": ("mlp.gate_up.weight", 1),
    "mlp.down_proj.weight": ("mlp.down.weight", None),
}
QK_NORMS = {"self_attn.q_norm.weight": ("q_norm.weight", None), "self_attn.k_norm.weight": ("k_norm.weight", None)}
LAYOUTS = {
    "qwen3_next": ("mtp.", "mtp.layers.0.", {"pre_fc_norm_embedding.weight": "enorm.weight",
                                             "pre_fc_norm_hidden.weight": "hnorm.weight",
                                             "fc.weight": "eh_proj.weight", "norm.weight": "norm.weight"}),
    "deepseek_v3": ("model.layers.{L}.", "model.layers.{L}.", {"enorm.weight": "enorm.weight",
                                                              "hnorm.weight": "hnorm.weight",
                                                              "eh_proj.weight": "eh_proj.weight",
                                                              "shared_head.norm.weight": "norm.weight"}),
}
# names that mark what the module does not implement, and what they are
UNSUPPORTED = {"mlp.experts.": "a mixture of experts", "self_attn.q_a_proj": "multi-head latent attention",
               "self_attn.kv_a_proj": "multi-head latent attention"}


class MTPHead(DraftHead):
    def __init__(self, cfg: HeadConfig, target: DecoderLM, max_positions: int):
        norm = type(target.norm)
        super().__init__(cfg, cfg.hidden_size, max_positions, lm_head=target.lm_head, norm=norm)
        H = cfg.hidden_size
        self.enorm = norm(H, cfg.rms_norm_eps)
        self.hnorm = norm(H, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.input_norm = norm(H, cfg.rms_norm_eps)
        self.target_norm = norm(H, cfg.rms_norm_eps)        # a copy of the target's final norm

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        # the target's last layer, normed as its LM head sees it
        return self.normed(self.target_norm, hidden[..., -1, :])

    def attention_input(self, feature, embed):
        x = self.eh_proj(torch.cat([self.normed(self.enorm, embed), self.normed(self.hnorm, feature)], dim=-1))
        return x, self.normed(self.input_norm, x)


def mtp_config(target: DecoderLM) -> HeadConfig:
    c = target.cfg
    return HeadConfig(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_heads=c.num_heads,
                      num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                      rope_theta=c.rope_theta, rope_scaling=c.rope_scaling, vocab_size=c.vocab_size,
                      draft_vocab_size=c.vocab_size, target_hidden_size=c.hidden_size,
                      target_layers=(c.num_layers - 1,), qk_norm=c.qk_norm, attention_bias=c.attention_bias)


def load_mtp_head(folder: Path, target: DecoderLM, dtype: torch.dtype, device, max_positions: int) -> MTPHead:
    """The MTP module among the *.safetensors of `folder` (the target's own folder where it ships
    one), in either layout."""
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"no *.safetensors weights in {folder}")
    num_layers = target.cfg.num_layers
    names = {}
    try:
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                names.update({name: file for name in f.keys()})
    except SafetensorError as e:
        raise CorruptModelError(f"{folder}: a *.safetensors file is not readable: {e}") from None
    layout = next((k for k, (top, _, _) in LAYOUTS.items() if any(n.startswith(top.format(L=num_layers)) for n in names)),
                  None)
    if layout is None:
        raise ModelNotFoundError(f"no multi-token-prediction module in {folder} (tensors named mtp.* or "
                                 f"model.layers.{num_layers}.*)")
    top, layer, own = (s.format(L=num_layers) if isinstance(s, str) else s for s in LAYOUTS[layout])
    for marker, what in UNSUPPORTED.items():
        if any(n.startswith(layer + marker) for n in names):
            raise UnsupportedModelError(f"the MTP module in {folder} uses {what}, which outpace does not implement")
    cfg = mtp_config(target)
    head = MTPHead(cfg, target, max_positions).to(dtype)
    wanted = {top + k: (v, None) for k, v in own.items()} | {layer + k: v for k, v in LAYER.items()}
    if cfg.qk_norm:
        wanted |= {layer + k: v for k, v in QK_NORMS.items()}
    params = dict(head.named_parameters())
    with torch.no_grad():
        for name, (ours, shard) in wanted.items():
            if name not in names:
                raise CorruptModelError(f"the MTP module in {folder} lacks {name}")
            with safe_open(str(names[name]), framework="pt", device="cpu") as f:
                tensor = f.get_tensor(name)
            dest = params[ours]
            if shard is not None:
                dest = dest.narrow(0, shard * cfg.intermediate_size, cfg.intermediate_size)
            if dest.shape != tensor.shape:
                hint = " (a query carrying its gate: gated attention is not implemented)" if ours == "q.weight" else ""
                raise CorruptModelError(f"{name} has shape {tuple(tensor.shape)}, the target's shape implies "
                                        f"{tuple(dest.shape)}{hint}")
            dest.copy_(tensor)
        head.target_norm.weight.copy_(target.norm.weight)
    return head.to(device).eval().requires_grad_(False)
