"""Tensor parallelism of the dense decoder: each of N ranks holds a slice of every large weight
and the key/value heads of its query heads (Megatron-LM's split, Shoeybi et al. 2019).

- qkv and gate_up are column-parallel: rank r holds query heads [r H/N, (r+1) H/N), key/value
  heads [r KVH/N, (r+1) KVH/N) and the same slice of the intermediate size, so attention, its KV
  cache and SwiGLU run on the rank's own heads and slice with no communication.
- o and down are row-parallel: each rank's product is a partial sum over its heads or slice; an
  all-reduce adds them, two a layer, and every rank holds the whole residual stream after it.
- The embedding and the LM head are vocabulary-parallel: rank r holds rows [r P, (r+1) P), P =
  V/N rounded up (rows past V are zero). A lookup takes the rows the rank holds, zeros elsewhere,
  and an all-reduce sums them (one term is non-zero, so the sum is exact); the LM head's logits
  [T, P] are all-gathered into [T, V] on every rank, so rank 0 samples over the whole vocabulary.
- Norms and rotary tables are replicated.

A rank's model is a DecoderLM of the rank's config (heads, key/value heads and intermediate size
over N; vocab_size stays whole, as the logits are), so the runner, the KV cache, CUDA graphs and
the CPU kernels see an ordinary model of fewer heads. Each rank reads only its slices of the
checkpoint (read_weight). A row-parallel sum adds N partial sums in another order than one
rank's product, so logits can differ from N = 1's in the last bits (greedy output only at
near-ties).
"""
from __future__ import annotations

import dataclasses
import datetime
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from outpace.errors import InvalidParameterError, UnsupportedModelError
from outpace.kernels.fused import linear
from outpace.model.config import ModelConfig
from outpace.model.decoder import DecoderLM
from outpace.model.layers import MLP, Attention, DecoderLayer

# our parameter names (without "layers.N.") by the dimension split across ranks
COLUMN_PARALLEL = ("attn.qkv", "mlp.gate_up")       # output rows: each fused part split alike
ROW_PARALLEL = ("attn.o", "mlp.down")               # input columns
VOCAB_PARALLEL = ("embed", "lm_head")               # vocabulary rows, padded to P a rank

# torch 2.13 renamed all_gather_into_tensor; older builds (the GPU machines') have only the old name
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


WAIT_SLICE = datetime.timedelta(milliseconds=100)


def wait_sliced(work, failed: Callable[[], bool]) -> None:
    """Wait for a gloo collective WAIT_SLICE at a time, raising RuntimeError once failed() says a
    rank has ended. gloo can leave a collective waiting for a peer that died between two
    collectives until the group's timeout (30 minutes), and a wait that never returns runs no
    Python, so neither the word that the peer ended nor Ctrl-C could end it."""
    while True:
        try:
            work.wait(WAIT_SLICE)
            return
        except RuntimeError:
            if work.is_completed():             # failed, or done since the slice ran out
                work.wait()                     # returns, or raises the collective's own error
                return
        if failed():
            raise RuntimeError("a tensor-parallel worker ended during a collective")


@dataclass(frozen=True)
class Shard:
    """This process's place among the ranks, and the collectives its layers call (the default
    process group: NCCL for CUDA tensors, gloo for CPU ones). failed: on the driver, whether a
    worker has ended; its gloo collectives then wait in slices (wait_sliced)."""

    rank: int
    world_size: int
    failed: Callable[[], bool] | None = field(default=None, compare=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the ranks, in place."""
        self._wait(x, dist.all_reduce(x, async_op=True))
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[T, P] from every rank -> [T, N * P], rank r's columns at [r P, (r+1) P)."""
        T, P = x.shape
        out = x.new_empty(self.world_size * T, P)
        self._wait(x, _all_gather(out, x.contiguous(), async_op=True))
        return out.view(self.world_size, T, P).transpose(0, 1).reshape(T, self.world_size * P)

    def _wait(self, x: torch.Tensor, work) -> None:
        if self.failed is None or x.is_cuda:        # NCCL: the driver's monitor aborts its communicators
            work.wait()
        else:
            wait_sliced(work, self.failed)


def check_shardable(cfg: ModelConfig, world_size: int, family: type[nn.Module]) -> None:
    """A clear error where this model cannot be split over world_size ranks."""
    if family is not DecoderLM:
        raise UnsupportedModelError(f"tensor parallelism serves the dense families (llama, qwen2, qwen3) for now; "
                                    f"{cfg.architecture} has recurrent layers: run it with --tensor-parallel-size 1")
    for what, n in (("query heads", cfg.num_heads), ("key/value heads", cfg.num_kv_heads),
                    ("intermediate size", cfg.intermediate_size)):
        if n % world_size:
            sizes = [d for d in range(2, 9) if cfg.num_heads % d == 0 and cfg.num_kv_heads % d == 0
                     and cfg.intermediate_size % d == 0]
            raise InvalidParameterError(f"{cfg.architecture}'s {n} {what} do not divide by --tensor-parallel-size "
                                        f"{world_size}; sizes up to 8 that divide this model: "
                                        f"{', '.join(map(str, [1] + sizes))}")


def vocab_rows(cfg: ModelConfig, world_size: int) -> int:
    """P: the embedding and LM head rows a rank holds."""
    return -(-cfg.vocab_size // world_size)


class ParallelAttention(Attention):
    """Attention over this rank's heads; o is row-parallel, its partial sums added across ranks."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, shard: Shard):
        super().__init__(cfg, layer_idx)
        self.shard = shard

    def output(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.shard.all_reduce(super().output(out, x))


class ParallelMLP(MLP):
    """SwiGLU over this rank's slice of the intermediate size; down's partial sums added across ranks."""

    def __init__(self, cfg: ModelConfig, shard: Shard):
        super().__init__(cfg)
        self.shard = shard

    def forward(self, x, kernels: bool = False):
        return self.shard.all_reduce(super().forward(x, kernels))


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + P) of the embedding; ids outside them look up zeros, and the
    all-reduce adds the one rank's row that holds each id."""

    def __init__(self, rows: int, hidden_size: int, shard: Shard):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))
        self.start, self.rows, self.shard = shard.rank * rows, rows, shard

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.shard.all_reduce(h.masked_fill_(outside.unsqueeze(-1), 0))


class TensorParallelLM(DecoderLM):
    """A rank's part of a dense DecoderLM (the module docstring says which)."""

    def __init__(self, cfg: ModelConfig, max_len: int, shard: Shard):
        check_shardable(cfg, shard.world_size, DecoderLM)
        n = shard.world_size
        self.shard = shard                              # make_layer, called by DecoderLM.__init__, reads it
        super().__init__(dataclasses.replace(cfg, num_heads=cfg.num_heads // n, num_kv_heads=cfg.num_kv_heads // n,
                                             intermediate_size=cfg.intermediate_size // n), max_len)
        rows = vocab_rows(cfg, n)
        self.embed = VocabParallelEmbedding(rows, cfg.hidden_size, shard)
        self.lm_head = nn.Linear(cfg.hidden_size, rows, bias=False)

    def make_layer(self, i: int) -> nn.Module:
        layer = DecoderLayer(self.cfg, i)
        # built on the meta device (load_model): the parts replaced here cost nothing
        layer.attn = ParallelAttention(self.cfg, i, self.shard)
        layer.mlp = ParallelMLP(self.cfg, self.shard)
        return layer

    def lm_logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.shard.all_gather(linear(x, self.lm_head))                 # [T, N * P]
        if logits.shape[1] != self.cfg.vocab_size:
            logits = logits[:, :self.cfg.vocab_size]
        return logits.float()

    def read_weight(self, f, hf_name: str) -> torch.Tensor:
        """This rank's slice of a checkpoint tensor, read alone (f: a safetensors file)."""
        name, _ = self.map_weight(hf_name)
        module = re.sub(r"^layers\.\d+\.", "", name.rpartition(".")[0])
        tensor = f.get_slice(hf_name)
        r, n = self.shard.rank, self.shard.world_size
        if module in COLUMN_PARALLEL:
            rows = tensor.get_shape()[0] // n
            return tensor[r * rows:(r + 1) * rows]
        if module in ROW_PARALLEL:
            columns = tensor.get_shape()[1] // n
            return tensor[:, r * columns:(r + 1) * columns]
        if module in VOCAB_PARALLEL:
            rows = self.embed.rows
            part = tensor[r * rows:(r + 1) * rows]
            return F.pad(part, (0, 0, 0, rows - part.shape[0]))        # the last rank's rows past V: zero
        return tensor[:]
