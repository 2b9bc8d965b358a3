"""HybridLM: the decoder of the hybrid families, whose layers mix tokens by attention or by a
recurrent layer (cfg.layer_types), with a HybridCache: keys and values for the attention layers,
recurrent state for the others. Families (qwen3_5.py, qwen3_next.py, lfm2.py) choose each
layer's mixer, their norm and their checkpoint's names; the forward is DecoderLM's."""
from __future__ import annotations

import re

import torch
from torch import nn

from outpace.model.config import ModelConfig
from outpace.model.decoder import DecoderLM
from outpace.model.layers import MLP, ForwardBatch
from outpace.model.recurrent_rows import RowGroups, row_groups
from outpace.runner.hybrid_cache import HybridCache
from outpace.runner.kv_cache import KVCache
from outpace.runner.state_cache import RecurrentShape, StateCache


class HybridLayer(nn.Module):
    """DecoderLayer with its token mixer chosen per layer. cache_index: the layer's index among
    the model's attention layers (their KV cache) or among its recurrent ones (their state)."""

    def __init__(self, cfg: ModelConfig, norm: type[nn.Module], mixer: nn.Module, is_attention: bool,
                 cache_index: int):
        super().__init__()
        self.input_norm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mixer = mixer
        self.post_norm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.is_attention, self.cache_index = is_attention, cache_index

    def forward(self, h, delta, cos, sin, batch: ForwardBatch, cache: HybridCache, rows: RowGroups):
        """(h, delta) -> (h', delta'), the residual stream h + delta as in DecoderLayer."""
        h, x = self.input_norm.add_forward(h, delta, batch.cpu_pointwise)
        i = self.cache_index
        if self.is_attention:
            out = self.mixer(x, cos, sin, batch, cache.k[i], cache.v[i])
        else:
            out = self.mixer(x, rows, cache.state, i)
        h, x = self.post_norm.add_forward(h, out, batch.cpu_pointwise)
        return h, self.mlp(x, batch.cpu_pointwise)


class HybridLM(DecoderLM):
    is_recurrent = True
    def make_mixer(self, i: int, kind: str) -> nn.Module:
        """Layer i's token mixer of kind cfg.layer_types[i]."""
        raise NotImplementedError

    def make_layer(self, i: int) -> nn.Module:
        kinds = self.cfg.layer_types
        is_attention = kinds[i] == "attention"
        index = sum((kind == "attention") == is_attention for kind in kinds[:i])
        return HybridLayer(self.cfg, self.NORM, self.make_mixer(i, kinds[i]), is_attention, index)

    def make_cache(self, num_slots: int, max_len: int, dtype: torch.dtype, device, max_row_tokens: int = 1,
                   snapshots: bool = True) -> HybridCache:
        """Keys and values of the attention layers; the recurrent layers' state with room to roll
        back verify rows of up to max_row_tokens tokens: a state snapshot per token (snapshots),
        else a checkpoint and the rows' logged inputs, replayed at commit (runner/state_cache.py)."""
        c = self.cfg
        attention = sum(layer.is_attention for layer in self.layers)
        return HybridCache(KVCache(attention, num_slots, c.num_kv_heads, max_len, c.head_dim, dtype, device),
                           StateCache(self.state_shapes(), num_slots, max_row_tokens, snapshots, dtype, device))

    def state_shapes(self) -> list[RecurrentShape]:
        """What each recurrent layer keeps per slot, in layer order."""
        return [layer.mixer.state_shape() for layer in self.layers if not layer.is_attention]

    def run_layers(self, h, cos, sin, batch: ForwardBatch, cache: HybridCache):
        rows = row_groups(batch, cache.state)
        delta = None
        for layer in self.layers:
            h, delta = layer(h, delta, cos, sin, batch, cache, rows)
            yield h, delta

    def shard_sizes(self, name: str) -> list[int]:
        """Row counts of the parts of a fused parameter, in LAYER_WEIGHTS order."""
        c = self.cfg
        m = re.fullmatch(r"layers\.(\d+)\.(.+)\.(weight|bias)", name)
        path = m.group(2) if m else None
        if path == "mixer.qkv":
            return [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
        if path == "mlp.gate_up":
            return [c.intermediate_size, c.intermediate_size]
        sizes = getattr(self.layers[int(m.group(1))].mixer, "in_proj_sizes", None) if path == "mixer.in_proj" else None
        if sizes is None:
            raise KeyError(name)
        return sizes
