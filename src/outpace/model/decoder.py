"""DecoderLM: the decoder-only transformer all supported families share, and its weight mapping."""
from __future__ import annotations

import re

import torch
from torch import nn

from outpace.model.config import ModelConfig
from outpace.kernels import cpu_kernels
from outpace.kernels.cpu_linear import kernel_parts
from outpace.kernels.fused import linear, linear_rows
from outpace.runner.kv_cache import KVCache
from outpace.model.layers import MLP, Attention, AttentionKind, DecoderLayer, ForwardBatch, RMSNorm


class DecoderLM(nn.Module):
    is_recurrent = False    # layers with recurrent state (HybridLM): rolled back by cache.commit
    # Hugging Face parameter name (per layer, after "model.layers.N.") -> (our name, shard index).
    # Fused matrices take their parts in the listed order: qkv = [q; k; v], gate_up = [gate; up].
    LAYER_WEIGHTS = {
        "self_attn.q_proj": ("attn.qkv", 0),
        "self_attn.k_proj": ("attn.qkv", 1),
        "self_attn.v_proj": ("attn.qkv", 2),
        "self_attn.o_proj": ("attn.o", None),
        "self_attn.q_norm": ("attn.q_norm", None),
        "self_attn.k_norm": ("attn.k_norm", None),
        "mlp.gate_proj": ("mlp.gate_up", 0),
        "mlp.up_proj": ("mlp.gate_up", 1),
        "mlp.down_proj": ("mlp.down", None),
        "input_layernorm": ("input_norm", None),
        "post_attention_layernorm": ("post_norm", None),
    }
    TOP_WEIGHTS = {"model.embed_tokens": "embed", "model.norm": "norm", "lm_head": "lm_head"}
    NORM = RMSNorm      # the final norm's class (a hybrid family may scale by 1 + w)

    def __init__(self, cfg: ModelConfig, max_len: int):
        super().__init__()
        self.cfg = cfg
        # given its (meta) weight, the embedding skips its random init: an op on the meta device
        # (as rope_tables' would be) runs PyTorch's Python reference, whose first call imports
        # torch._dynamo, 2.4 s of every start
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(self.make_layer(i) for i in range(cfg.num_layers))
        self.norm = self.NORM(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.logit_rows = cfg.vocab_size    # the token ids [0, logit_rows) whose logits forward computes
        # [max_len, D] float32, filled by loader.empty_model (rope_tables) once the model, built on
        # the meta device, has its memory
        self.register_buffer("rope_cos", torch.empty(max_len, cfg.head_dim), persistent=False)
        self.register_buffer("rope_sin", torch.empty(max_len, cfg.head_dim), persistent=False)
        self._stacks = {}   # (activations' dtype, the layers' first product) -> cpu_kernels.DecoderStack or None

    def make_layer(self, i: int) -> nn.Module:
        return DecoderLayer(self.cfg, i)

    def make_cache(self, num_slots: int, max_len: int, dtype: torch.dtype, device, max_row_tokens: int = 1,
                   snapshots: bool = True) -> KVCache:
        """The cache this model's forward reads and writes. max_row_tokens and snapshots size a
        hybrid model's recurrent state (HybridLM.make_cache); keys and values need neither."""
        c = self.cfg
        return KVCache(c.num_layers, num_slots, c.num_kv_heads, max_len, c.head_dim, dtype, device)

    def tie_weights(self) -> None:
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight

    def forward(self, batch: ForwardBatch, cache: KVCache, hidden_layers: tuple[int, ...] = (),
                compute_dtype: torch.dtype | None = None):
        """Returns logits [N, V] float32 for every token of the batch's rows (N = B*S, or T when
        packed; prompt chunks packed after the rows return nothing; None when batch.logits is
        False), and the residual stream after each of hidden_layers ([N, len(hidden_layers), H],
        in the weights' dtype; layer i's output before the next layer's norm, the last layer's
        before the final norm), None when none is asked for. compute_dtype: the activations' dtype
        when it is not the weights' (weights and cache keep theirs)."""
        h = self.embed(batch.input_ids)                                  # [B, S, H] or [T, H]
        hidden_dtype = h.dtype
        if compute_dtype is not None:
            h = h.to(compute_dtype)
        positions = batch.positions if batch.packed is None else batch.packed.positions
        if batch.rope_positions is not None:
            positions = batch.rope_positions
        cos = self.rope_cos[positions].to(h.dtype).unsqueeze(-2)         # [B, S, 1, D] or [T, 1, D]
        sin = self.rope_sin[positions].to(h.dtype).unsqueeze(-2)
        rows = len(batch.packed.index) if batch.packed is not None else None    # the rows' tokens come first
        stack = self.cpu_stack(h.dtype) if batch.attention is AttentionKind.CPU_KERNEL and h.dtype == cache.k.dtype \
            else None
        if stack is not None:
            pk = batch.packed
            h, delta, hidden = stack(h.reshape(-1, h.shape[-1]), cos, sin, cache.k, cache.v,
                                     batch.slots if pk is None else pk.slots,
                                     batch.positions if pk is None else pk.positions, self.cfg.sliding_window,
                                     [i for i in range(len(self.layers)) if i in hidden_layers], batch.tree)
            hidden = None if hidden is None else hidden[:rows]
        else:
            kept = []
            for i, (h, delta) in enumerate(self.run_layers(h, cos, sin, batch, cache)):
                if i in hidden_layers:
                    kept.append((h + delta)[:rows].reshape(-1, h.shape[-1]).to(hidden_dtype))
            hidden = torch.stack(kept, dim=1) if kept else None             # [N, layers, H]
        if not batch.logits:
            return None, hidden
        if batch.packed is not None and batch.packed.chunks:    # prompt chunks' tokens return nothing
            h, delta = h[:rows], delta[:rows]
        h, normed = self.norm.add_forward(h, delta, batch.cpu_pointwise)
        # the LM head in the weights' dtype (a float32 forward's rows would widen its whole matrix)
        logits = self.lm_logits(normed.reshape(-1, normed.shape[-1]).to(hidden_dtype))
        return logits, hidden

    def cpu_stack(self, dtype: torch.dtype) -> cpu_kernels.DecoderStack | None:
        """The layers as one call of the CPU kernels (cpu_kernels.DecoderStack) for activations of
        this dtype, where every layer is a plain DecoderLayer (no query/key norms, no override of
        run_layers) whose products the kernels compute; else None (the layers' own forwards).
        Built at the first CPU_KERNEL forward after the weights are in place."""
        first = self.layers[0] if len(self.layers) else None
        key = (dtype, id(getattr(getattr(first, "attn", None), "qkv", None)))     # packing replaces the products
        if key not in self._stacks:
            self._stacks[key] = self._build_stack(dtype)
        return self._stacks[key]

    def _build_stack(self, dtype: torch.dtype) -> cpu_kernels.DecoderStack | None:
        if type(self).run_layers is not DecoderLM.run_layers or not self.layers:
            return None
        layers = []
        for layer in self.layers:
            if (type(layer) is not DecoderLayer or type(layer.attn) is not Attention or type(layer.mlp) is not MLP
                    or layer.attn.q_norm is not None):
                return None
            products = [kernel_parts(m) for m in (layer.attn.qkv, layer.attn.o, layer.mlp.gate_up, layer.mlp.down)]
            if any(p is None or len(p) > cpu_kernels.MAX_PARTS for p in products):
                return None
            norms = [norm.weight.detach().to(dtype).contiguous() for norm in (layer.input_norm, layer.post_norm)]
            layers.append((*norms, *products))
        return cpu_kernels.DecoderStack(layers, self.cfg.rms_norm_eps, self.cfg.num_heads, self.cfg.intermediate_size)

    def lm_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The LM head: x [N, H] -> float32 logits [N, logit_rows] (a draft model's draft
        vocabulary: the first token ids alone)."""
        if self.logit_rows < self.cfg.vocab_size:
            return linear_rows(x, self.lm_head, self.logit_rows).float()
        return linear(x, self.lm_head).float()

    def run_layers(self, h, cos, sin, batch: ForwardBatch, cache: KVCache):
        """The layers over the embedded tokens, yielding (h, delta) after each: the residual
        stream is h + delta."""
        delta = None
        for i, layer in enumerate(self.layers):
            h, delta = layer(h, delta, cos, sin, batch, cache.k[i], cache.v[i])
            yield h, delta

    def read_weight(self, f, hf_name: str) -> torch.Tensor:
        """A checkpoint tensor as this model holds it (f: a safetensors file): all of it here; a
        rank of a tensor-parallel model reads its slice."""
        return f.get_tensor(hf_name)

    def convert_weight(self, hf_name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """A checkpoint tensor as the (name, tensor) parts map_weight places: itself here; a family
        whose checkpoint fuses or orders tensors otherwise splits or reorders them."""
        return [(hf_name, tensor)]

    def map_weight(self, hf_name: str) -> tuple[str, int | None] | None:
        """Our parameter name and shard index for a Hugging Face tensor name; None = not used."""
        base, _, kind = hf_name.rpartition(".")                         # kind: weight or bias
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", base)
        if m:
            target = self.LAYER_WEIGHTS.get(m.group(2))
            if target is None:
                return None
            return f"layers.{m.group(1)}.{target[0]}.{kind}", target[1]
        if base in self.TOP_WEIGHTS:
            if base == "lm_head" and self.cfg.tie_word_embeddings:
                return None
            return f"{self.TOP_WEIGHTS[base]}.{kind}", None
        return None

    def shard_sizes(self, name: str) -> list[int]:
        """Row counts of the parts of a fused parameter, in LAYER_WEIGHTS order."""
        c = self.cfg
        if ".attn.qkv." in name:
            return [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
        if ".mlp.gate_up." in name:
            return [c.intermediate_size, c.intermediate_size]
        raise KeyError(name)
