"""DraftHead: one decoder layer that drafts from the target's hidden states (EAGLE-3, MTP).

A head reads pairs: pair p is (a feature of position p, the embedding of token p + 1) and its
output predicts token p + 2. The first feature of a position comes from the target's hidden states
there (`features`: EAGLE-3 fuses three layers, MTP norms the last one); a drafted position's
feature is the head's own output at the position before it. The layer's math lives here once, in
three steps the callers compose around attention, which each does its own way (the drafter over a
cache in the target's slots, the trainer over whole sequences and their unrolled steps):

  project(feature, embed, positions) -> residual [N, H], q [N, Hq, D], k, v [N, KVH, D] (rotated)
  finish(residual, attention [N, Hq * D]) -> out [N, H]   (the layer's output, fed back as a feature)
  logits(out) -> [N, draft vocabulary] float32             (final norm, then the LM head)

A head drafts over a draft vocabulary of `draft_vocab_size` ids; `to_target` maps them to the
target's ids (d2t offsets: target id = draft id + d2t[draft id]); identity when nothing is
reduced.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from outpace.errors import InvalidParameterError
from outpace.kernels import cpu_kernels
from outpace.kernels.fused import linear, rope
from outpace.model.layers import MLP, RMSNorm, planless_attention
from outpace.model.rope import rope_tables


@dataclass
class HeadConfig:
    """A head's shape. target_layers: the target layers whose outputs (the residual stream after
    each) the head reads, in outpace's numbering (layer i's output)."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int                 # the target's vocabulary: the ids a head embeds and drafts into
    draft_vocab_size: int           # rows of the head's LM head
    target_hidden_size: int
    target_layers: tuple[int, ...]
    rope_scaling: dict | None = None
    qk_norm: bool = False
    attention_bias: bool = False

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise InvalidParameterError(f"the head's {self.num_heads} attention heads do not group over its "
                                        f"{self.num_kv_heads} key/value heads")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise InvalidParameterError(f"draft_vocab_size must be in [1, {self.vocab_size}] (the target's "
                                        f"vocabulary), got {self.draft_vocab_size}")


class DraftHead(nn.Module):
    """The shared layer. Subclasses build `attention_input` (what the attention and the residual
    read from a feature and an embedding) and `features` (the first feature from the target)."""

    def __init__(self, cfg: HeadConfig, attention_in: int, max_positions: int, lm_head: nn.Module | None = None,
                 norm: type[nn.Module] = RMSNorm):
        """attention_in: the width of the attention's input; lm_head: one shared with the target
        (MTP), else the head's own over the draft vocabulary; norm: the norms' class (a family
        may scale by 1 + w)."""
        super().__init__()
        self.cfg = cfg
        H, D = cfg.hidden_size, cfg.head_dim
        self.q = nn.Linear(attention_in, cfg.num_heads * D, bias=cfg.attention_bias)
        self.k = nn.Linear(attention_in, cfg.num_kv_heads * D, bias=cfg.attention_bias)
        self.v = nn.Linear(attention_in, cfg.num_kv_heads * D, bias=cfg.attention_bias)
        self.qkv: nn.Module | None = None          # q, k and v as one product (fuse_qkv)
        self.o = nn.Linear(cfg.num_heads * D, H, bias=False)
        self.q_norm = norm(D, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = norm(D, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.post_norm = norm(H, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.norm = norm(H, cfg.rms_norm_eps)
        if lm_head is None:
            self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        else:       # the target's: kept out of the head's parameters and buffers (never moved, cast or saved)
            object.__setattr__(self, "lm_head", lm_head)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.embed: nn.Embedding | None = None     # the head's own embedding; None: the target's
        # the norms, SwiGLU and rotation as cpu_kernels calls (a CPU drafter whose activations'
        # dtype they serve): PyTorch's bfloat16 norm took about 80 us a call, four a draft position
        self.kernels = False
        self.max_positions = 0
        self.extend_rope(max_positions)

    def extend_rope(self, max_positions: int) -> None:
        """Rotary tables (float32, not saved) covering positions [0, max_positions)."""
        if max_positions <= self.max_positions:
            return
        cos, sin = rope_tables(self.cfg.head_dim, self.cfg.rope_theta, max_positions, self.cfg.rope_scaling)
        device = self.o.weight.device if self.o.weight.device.type != "meta" else "cpu"
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)
        self.max_positions = max_positions

    # ---- subclasses -----------------------------------------------------------------------------
    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """The first feature of each position from the target's hidden states [..., layers, Ht]."""
        raise NotImplementedError

    def attention_input(self, feature: torch.Tensor, embed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual [..., H], attention input [..., attention_in]) of pairs (feature, embedding)."""
        raise NotImplementedError

    # ---- the layer ------------------------------------------------------------------------------
    def project(self, feature: torch.Tensor, embed: torch.Tensor, positions: torch.Tensor):
        """Pairs [..., H] at rotary positions [...] -> (residual [..., H], q [..., Hq, D], k and v
        [..., KVH, D]), q and k rotated."""
        residual, x = self.attention_input(feature, embed)
        D = self.cfg.head_dim
        if self.qkv is None:
            q, k, v = self.q(x), self.k(x), self.v(x)
        else:
            q, k, v = self.qkv(x).split([self.cfg.num_heads * D] + [self.cfg.num_kv_heads * D] * 2, -1)
        q, k, v = (t.unflatten(-1, (-1, D)) for t in (q, k, v))
        if self.q_norm is not None:
            q, k = self.normed(self.q_norm, q), self.normed(self.k_norm, k)
        cos = self.rope_cos[positions].to(q.dtype).unsqueeze(-2)                # [..., 1, D]
        sin = self.rope_sin[positions].to(q.dtype).unsqueeze(-2)
        if not self.kernels:
            return residual, rope(q, cos, sin), rope(k, cos, sin), v
        # the kernel reads one row of cos and sin a token
        cos, sin = (t.expand(*q.shape[:-2], 1, D) for t in (cos, sin))
        return residual, cpu_kernels.rope(q, cos, sin), cpu_kernels.rope(k, cos, sin), v

    def fuse_qkv(self) -> None:
        """q, k and v as one product from now on (a drafter that never saves the head: on the CPU
        one call, and one quantization of its input, instead of three)."""
        parts = (self.q, self.k, self.v)
        fused = nn.Linear(self.q.in_features, sum(m.out_features for m in parts), bias=self.q.bias is not None,
                          device=self.q.weight.device, dtype=self.q.weight.dtype)
        with torch.no_grad():
            fused.weight.copy_(torch.cat([m.weight for m in parts]))
            if fused.bias is not None:
                fused.bias.copy_(torch.cat([m.bias for m in parts]))
        self.qkv = fused
        del self.q, self.k, self.v

    def finish(self, residual: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        """The layer's output [..., H] from its residual and the heads' outputs [..., Hq * D]."""
        h, x = self.add_normed(self.post_norm, residual, linear(attention, self.o))
        return h + self.mlp(x, self.kernels)

    def logits(self, out: torch.Tensor, wide: bool = True) -> torch.Tensor:
        """[..., draft_vocab_size] logits of the head's outputs, in float32 (wide) or the model
        dtype (their argmax is the float32 logits': the cast is exact). The head's own LM head is
        one product through fused.linear (a one-row product inside CUDA graphs)."""
        normed = self.normed(self.norm, out)
        normed = normed.reshape(-1, normed.shape[-1])
        logits = linear(normed, self.lm_head) if type(self.lm_head) is nn.Linear else self.lm_head(normed)
        return (logits.float() if wide else logits).view(*out.shape[:-1], -1)

    def normed(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """norm(x), as add_normed computes it."""
        return self.add_normed(norm, x)[1]

    def add_normed(self, norm: nn.Module, h: torch.Tensor, delta: torch.Tensor | None = None):
        """(h + delta, its norm) (delta None: (h, norm(h))), in one cpu_kernels call where the head
        runs them and the norm is a plain RMSNorm (a family's 1 + w norm goes through its own
        forward)."""
        if self.kernels and type(norm) is RMSNorm:
            return norm.add_forward(h.contiguous(), delta, kernels=True)
        if delta is not None:
            h = h + delta
        return h, norm(h)

    def cpu_pair_head(self, embed: nn.Module, dtype: torch.dtype) -> cpu_kernels.PairHead | None:
        """The head as one CPU kernel call a layer or chain (cpu_kernels.PairHead), embedding
        through `embed`, for activations of this dtype; None where the kernels do not compute it
        (the drafter's Python path then runs it)."""
        return None

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target ids of draft ids."""
        return draft_ids + self.d2t[draft_ids]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [B, S, Hq, D] over keys and values [B, KVH, L, D] through mask [B, 1, S, L] (True: may
    attend) -> [B, S, Hq * D]. On CUDA through kernels that build no plan per shape: every
    eager catch-up and draft has a new key length (layers.PROMPT_BACKENDS)."""
    q, k, v = q.transpose(1, 2), k.to(q.dtype), v.to(q.dtype)
    if q.is_cuda:
        out = planless_attention(q, k, v, mask)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return out.transpose(1, 2).flatten(-2)
