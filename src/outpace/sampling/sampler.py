"""Token sampling: per-row temperature, top-k, top-p and min-p shaping, and draws keyed by position.

Random numbers, the contract that reproducibility rests on. Every sampled row has a seed: the
request's own, or 63 bits from the system's entropy drawn once when the request is admitted
(`request_seed`). The token at output position i of a request (i = 0 for its first new token) is
decided by one number

    u(seed, i) = (mix(mix(seed) + (i + 1) * 0x9E3779B97F4A7C15) >> 11) / 2**53,

mix being splitmix64's finalizer and the arithmetic mod 2**64: a pure function of the seed and i,
in [0, 1). Both are host values, so u is computed on the host
(numpy, a few microseconds a step) and reaches the device in one asynchronous copy with the step's
other sampling inputs (`SamplingState.uniforms`); nothing is drawn on the device. The token is the
inverse CDF of the row's shaped distribution at u: the first token v, in vocabulary order, whose
cumulative probability exceeds u (`inverse_cdf`). Nothing else is random, so a request's tokens
depend only on its seed, its logits and its positions: never on the batch, its padding, the draft
lengths, or on whether speculation is on (sampling.rejection.verify_sampling samples each drafted
position with its own u and accepts a draft exactly when it equals that sample). Given the same
logits (bit-identical in exact mode) a seeded request's text is plain sampling's, token for token.
Greedy rows (temperature 0) use no randomness. A sampling draft model couples through the same
noise: it samples its own distribution at u(seed, i).

Nothing here reads tensor values on the host: no .item(), .tolist() or branching on device data.
Host decisions (all_greedy, which filters are in use) come from the SamplingParams.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from outpace.config import SamplingParams

GOLDEN = 0x9E3779B97F4A7C15     # splitmix64's increment: 2**64 / golden ratio
MIX1, MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
MASK64 = (1 << 64) - 1
CDF_BLOCK = 256                 # inverse_cdf sums the vocabulary in blocks of this many tokens
TOP_K_OFF = 2**24               # top-k above any vocabulary (and exact in float32): larger ones act as it
# Temperatures are clamped to this: logits / T stays finite for |logits| < 3e8 (an inf would make
# softmax NaN), and a logit 1e-27 or more below the maximum gets e**-1000 = 0, as in the limit.
MIN_TEMPERATURE = 1e-30


def request_seed(params: SamplingParams) -> int | None:
    """The seed a request samples with: its own, or 63 bits of system entropy when it gave none
    (drawn once, at admission); None for greedy requests, which use no randomness."""
    if params.is_greedy:
        return None
    return params.seed if params.seed is not None else secrets.randbits(63)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, elementwise on uint64 (numpy's uint64 arithmetic wraps mod 2**64)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(MIX1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(MIX2)
    return z ^ (z >> np.uint64(31))


def uniforms(seeds: Sequence[int], positions: Sequence[int], num_positions: int) -> np.ndarray:
    """u(seed, i) [N, S] float64 in [0, 1) for i = positions[n] .. positions[n] + S - 1 of each row
    n (seeds: any integers, taken mod 2**64)."""
    keys = _mix(np.array([seed & MASK64 for seed in seeds], dtype=np.uint64))
    counters = np.array(positions, dtype=np.uint64)[:, None] + np.arange(1, num_positions + 1, dtype=np.uint64)
    z = _mix(keys[:, None] + counters * np.uint64(GOLDEN))
    return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53


@dataclass
class SamplingState:
    """Batched sampling parameters, one row per sequence."""

    temperature: torch.Tensor  # [N] float32, 0 on greedy rows
    top_k: torch.Tensor  # [N] int64, 0 = off
    top_p: torch.Tensor  # [N] float32, 1 = off
    min_p: torch.Tensor  # [N] float32, 0 = off
    is_greedy: torch.Tensor  # [N] bool
    seeds: list[int]  # [N] host, each row's seed (0 on greedy rows, whose u is never used)
    positions: list[int]  # [N] host, the output position of the row's first token this call
    num_rows: int
    all_greedy: bool
    any_greedy: bool
    use_top_k: bool  # some sampled (non-greedy) row filters by top-k; likewise below
    use_top_p: bool
    use_min_p: bool
    top_k_bound: int  # every sampled row keeps at most this many tokens; 0 = some sampled row has no top-k

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        seeds: Sequence[int | None] | None = None,
        positions: Sequence[int] | None = None,
        device: torch.device | str = "cpu",
    ) -> "SamplingState":
        """One row per SamplingParams. seeds[i] is row i's seed (default: its params' seed; a sampled
        row must have one, see request_seed); positions[i] the output position of the token row i
        samples first (default 0)."""
        device = torch.device(device)
        num_rows = len(params)
        seeds = [p.seed for p in params] if seeds is None else list(seeds)
        positions = [0] * num_rows if positions is None else list(positions)
        if not len(seeds) == len(positions) == num_rows:
            raise ValueError(f"got {num_rows} SamplingParams, {len(seeds)} seeds and {len(positions)} positions")
        is_greedy_rows = [p.temperature == 0 for p in params]
        for row, (seed, is_greedy) in enumerate(zip(seeds, is_greedy_rows)):
            if seed is None and not is_greedy:
                raise ValueError(f"row {row} samples but has no seed: give it one (request_seed draws one)")
        sampled = [p for p, g in zip(params, is_greedy_rows) if not g]
        # One [5, N] host tensor, one copy: pinned + non_blocking so building a state never syncs.
        host = torch.tensor(
            [
                [p.temperature for p in params],
                [min(p.top_k, TOP_K_OFF) for p in params],  # exact in float32; any k >= V keeps all
                [p.top_p for p in params],
                [p.min_p for p in params],
                is_greedy_rows,
            ],
            dtype=torch.float32,
        ).reshape(5, num_rows)
        if device.type == "cuda":
            host = host.pin_memory()
        temperature, top_k, top_p, min_p, is_greedy = host.to(device, non_blocking=True).unbind(0)
        return cls(
            temperature=temperature,
            top_k=top_k.long(),
            top_p=top_p,
            min_p=min_p,
            is_greedy=is_greedy > 0,
            seeds=[0 if g else seed for seed, g in zip(seeds, is_greedy_rows)],
            positions=positions,
            num_rows=num_rows,
            all_greedy=all(is_greedy_rows),
            any_greedy=any(is_greedy_rows),
            use_top_k=any(p.top_k > 0 for p in sampled),
            use_top_p=any(p.top_p < 1 for p in sampled),
            use_min_p=any(p.min_p > 0 for p in sampled),
            top_k_bound=min(max(p.top_k for p in sampled), TOP_K_OFF) if sampled and all(p.top_k > 0 for p in sampled)
            else 0,
        )

    def uniforms(self, num_positions: int) -> torch.Tensor:
        """[N, S] float64 on the state's device: u(seed, position) of each row's next S output
        positions, computed on the host and sent in one copy that never syncs."""
        host = torch.from_numpy(uniforms(self.seeds, self.positions, num_positions))
        device = self.temperature.device
        if device.type == "cuda":
            host = host.pin_memory()
        return host.to(device, non_blocking=True)


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    # [..., V] -> float32 one-hot at torch.argmax (the first index on ties), as verify_greedy picks
    return torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(
        -1, logits.argmax(-1, keepdim=True), 1.0
    )


def _top_k_top_p_mask(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, top_k_bound: int) -> torch.Tensor:
    """probs [..., V]; top_k, top_p broadcast against it ([N, 1] or [N, 1, 1]) -> keep mask [..., V].

    top-k keeps the k most likely tokens (k = 0 keeps all; ties broken by sort order). top-p then
    acts on the top-k distribution renormalised: it keeps the smallest most-likely-first prefix
    whose mass reaches top_p, i.e. a token stays iff the mass strictly before it is < top_p * total.
    The first token has nothing before it, so it always stays. With top_k_bound > 0 (every row has a
    top-k) only the top_k_bound most likely tokens are sorted, by torch.topk: a full sort of a large
    vocabulary costs several times the rest of sampling.
    """
    vocab = probs.shape[-1]
    if 0 < top_k_bound < vocab:
        sorted_probs, order = probs.topk(top_k_bound, dim=-1)  # [..., L], L = top_k_bound
    else:
        sorted_probs, order = probs.sort(dim=-1, descending=True)  # [..., V]
    rank = torch.arange(sorted_probs.shape[-1], device=probs.device)
    in_top_k = rank < torch.where(top_k > 0, top_k, vocab)
    sorted_probs = sorted_probs * in_top_k
    cum = sorted_probs.cumsum(-1)
    mass_before = torch.nn.functional.pad(cum[..., :-1], (1, 0))  # exactly 0 at rank 0
    in_top_p = (mass_before < top_p * cum[..., -1:]) | (top_p >= 1)
    keep_sorted = in_top_k & in_top_p
    return torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, order, keep_sorted)


def logits_to_probs(logits: torch.Tensor, state: SamplingState) -> torch.Tensor:
    """logits [N, V] or [N, S, V] (any float dtype; state has N rows) -> float32 probs, same shape.

    Order: divide by temperature, softmax, top-k, top-p (on the top-k distribution), min-p (keep
    p >= min_p * p_max; the most likely token survives every filter, so this ratio test gives the
    same set before or after the other filters renormalise), renormalise. Temperatures below
    MIN_TEMPERATURE act as it, which is their limit: the argmax, shared among exact ties. Greedy
    rows: one-hot at the argmax of the raw logits.
    """
    if logits.shape[0] != state.num_rows:
        raise ValueError(f"logits have {logits.shape[0]} rows but the sampling state has {state.num_rows}")
    if state.all_greedy:
        return _one_hot_argmax(logits)
    per_row = (-1,) + (1,) * (logits.dim() - 1)  # [N, 1] or [N, 1, 1]: broadcast over S and V
    temperature = torch.where(state.is_greedy, 1.0, state.temperature.clamp_min(MIN_TEMPERATURE))
    probs = torch.softmax(logits.float() / temperature.view(per_row), dim=-1)
    keep = None
    if state.use_top_k or state.use_top_p:
        keep = _top_k_top_p_mask(probs, state.top_k.view(per_row), state.top_p.view(per_row), state.top_k_bound)
    if state.use_min_p:
        in_min_p = probs >= state.min_p.view(per_row) * probs.amax(-1, keepdim=True)
        keep = in_min_p if keep is None else keep & in_min_p
    if keep is not None:
        probs = probs * keep
        probs = probs / probs.sum(-1, keepdim=True)  # > 0: the top token is always kept
    if state.any_greedy:
        probs = torch.where(state.is_greedy.view(per_row), _one_hot_argmax(logits), probs)
    return probs


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """weights [..., V] >= 0 (need not sum to 1, each row some > 0); u [...] float64 in [0, 1) ->
    tokens [...] int64: the first v whose cumulative weight exceeds u * total, so v is drawn with
    probability weights[v] / total, and only tokens of positive weight are ever drawn.

    The sums run in blocks of CDF_BLOCK tokens (the last one holds the V % CDF_BLOCK left over):
    one pass sums each block, the block sums are accumulated in float64 to find the block holding
    the point, and only that block is accumulated token by token. Each row's sums run in one order
    whatever the batch holds, so a row's token never depends on the other rows.
    """
    vocab = weights.shape[-1]
    num_full = vocab // CDF_BLOCK
    blocks = weights[..., :num_full * CDF_BLOCK].unflatten(-1, (num_full, CDF_BLOCK))  # [..., nb, C], a view
    tail = weights[..., num_full * CDF_BLOCK:]  # [..., V % C]
    block_sums = blocks.sum(-1)
    if tail.shape[-1]:
        block_sums = torch.cat([block_sums, tail.sum(-1, keepdim=True)], -1)
    block_cum = block_sums.cumsum(-1, dtype=torch.float64)  # [..., nb'], nb' = ceil(V / C)
    point = (u * block_cum[..., -1])[..., None]  # [..., 1], below the total but for rounding
    # The first block whose cumulative weight exceeds the point has weight > 0. A point rounded up
    # to the total would pass every block: the block that reaches the total is taken instead.
    block = torch.minimum(torch.searchsorted(block_cum, point, right=True),
                          torch.searchsorted(block_cum, block_cum[..., -1:].contiguous()))  # [..., 1]
    start = torch.where(block > 0, block_cum.gather(-1, (block - 1).clamp_min(0)), 0.0)  # [..., 1]
    inside = None  # [..., C]: the chosen block's weights
    if num_full:
        index = block.clamp_max(num_full - 1)[..., None].expand(*block.shape[:-1], 1, CDF_BLOCK)
        inside = blocks.gather(-2, index).squeeze(-2)
    if inside is None:
        inside = tail  # V < C: the whole row is one block
    elif tail.shape[-1]:
        tail = torch.nn.functional.pad(tail, (0, CDF_BLOCK - tail.shape[-1]))  # zeros are never drawn
        inside = torch.where(block == num_full, tail, inside)
    inside_cum = inside.cumsum(-1, dtype=torch.float64)  # [..., C]
    offset = torch.minimum(torch.searchsorted(inside_cum, point - start, right=True),
                           torch.searchsorted(inside_cum, inside_cum[..., -1:].contiguous()))  # likewise within the block
    return (block * CDF_BLOCK + offset).squeeze(-1)


def sample(probs: torch.Tensor, state: SamplingState) -> torch.Tensor:
    """probs [N, V] (from logits_to_probs) -> tokens [N] int64: each row's token at its position
    (state.positions), drawn at u(seed, position). Greedy rows' probs are one-hot, so they come
    out as the argmax."""
    if state.all_greedy:
        return probs.argmax(-1)
    return inverse_cdf(probs, state.uniforms(1)[:, 0])
