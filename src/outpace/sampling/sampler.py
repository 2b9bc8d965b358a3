"""Token sampling: per-row temperature, top-k, top-p and min-p shaping, and seeded draws.

Random numbers, the contract that seeded reproducibility rests on. A row is *seeded* when it has
its own torch.Generator g (on the logits' device, made by `make_generator`). Per call of sample or
of sampling.rejection.verify_sampling, a seeded row that is not greedy draws exactly one

    u = torch.rand(V + MAX_NUM_DRAFT, dtype=torch.float64, generator=g)

(written in place into its row of a batch buffer, which draws the same numbers) and nothing else:
u[:V] are the exponential race's uniforms for the emitted token (the plain sample, or the
correction / bonus after the drafts), u[V + i] is the acceptance uniform of draft i (sample leaves
them unused). The count depends on the vocabulary size alone, never on the batch, its padded draft
length K, the row's own number of drafts or which of the two functions runs, so a seeded request's
tokens depend only on its seed and its own inputs, and verify_sampling with no drafts emits what
sample would. Greedy rows (temperature 0) draw nothing. Rows without a generator share one batched
torch.rand(N, V + MAX_NUM_DRAFT) from the device's default generator, so their tokens depend on the
batch: unseeded requests promise no reproducibility.

Nothing here reads tensor values on the host: no .item(), .tolist() or branching on device data.
Host decisions (all_greedy, which filters are in use) come from the SamplingParams.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from outpace.config import MAX_NUM_DRAFT_TOKENS as MAX_NUM_DRAFT, SamplingParams


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """The per-request generator: None (the default generator) when the request has no seed."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


@dataclass
class SamplingState:
    """Batched sampling parameters, one row per sequence (or per sequence position, after repeat_rows)."""

    temperature: torch.Tensor  # [N] float32, 0 on greedy rows
    top_k: torch.Tensor  # [N] int64, 0 = off
    top_p: torch.Tensor  # [N] float32, 1 = off
    min_p: torch.Tensor  # [N] float32, 0 = off
    is_greedy: torch.Tensor  # [N] bool, on the device
    generators: list[torch.Generator | None]  # [N], None = the device's default generator
    is_greedy_rows: list[bool]  # [N], the host copy of is_greedy
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
        generators: Sequence[torch.Generator | None] | None = None,
        device: torch.device | str = "cpu",
    ) -> "SamplingState":
        """One row per SamplingParams; generators[i] is row i's request-owned generator (or None)."""
        device = torch.device(device)
        generators = list(generators) if generators is not None else [None] * len(params)
        if len(generators) != len(params):
            raise ValueError(f"got {len(params)} SamplingParams but {len(generators)} generators")
        is_greedy_rows = [p.temperature == 0 for p in params]
        sampled = [p for p, g in zip(params, is_greedy_rows) if not g]
        # One [5, N] host tensor, one copy; pinned + non_blocking so building a state never syncs.
        host = torch.tensor(
            [
                [p.temperature for p in params],
                [p.top_k for p in params],  # exact in float32 below 2**24
                [p.top_p for p in params],
                [p.min_p for p in params],
                is_greedy_rows,
            ],
            dtype=torch.float32,
        ).reshape(5, len(params))
        if device.type == "cuda":
            host = host.pin_memory()
        temperature, top_k, top_p, min_p, is_greedy = host.to(device, non_blocking=True).unbind(0)
        return cls(
            temperature=temperature,
            top_k=top_k.long(),
            top_p=top_p,
            min_p=min_p,
            is_greedy=is_greedy > 0,
            generators=generators,
            is_greedy_rows=is_greedy_rows,
            all_greedy=all(is_greedy_rows),
            any_greedy=any(is_greedy_rows),
            use_top_k=any(p.top_k > 0 for p in sampled),
            use_top_p=any(p.top_p < 1 for p in sampled),
            use_min_p=any(p.min_p > 0 for p in sampled),
            top_k_bound=max(p.top_k for p in sampled) if sampled and all(p.top_k > 0 for p in sampled) else 0,
        )

    @property
    def num_rows(self) -> int:
        return len(self.generators)

    def repeat_rows(self, repeats: int) -> "SamplingState":
        """Each row repeated `repeats` times in place (row i becomes rows i*R .. i*R+R-1), e.g. to
        shape [B, K+1, V] logits flattened to [B*(K+1), V]. A repeated generator is shared, so
        sample() on the result draws R times from it in row order."""

        def rep(t: torch.Tensor) -> torch.Tensor:
            return t[:, None].expand(-1, repeats).reshape(-1)  # no index tensor, no sync

        return SamplingState(
            temperature=rep(self.temperature),
            top_k=rep(self.top_k),
            top_p=rep(self.top_p),
            min_p=rep(self.min_p),
            is_greedy=rep(self.is_greedy),
            generators=[g for g in self.generators for _ in range(repeats)],
            is_greedy_rows=[x for x in self.is_greedy_rows for _ in range(repeats)],
            all_greedy=self.all_greedy,
            any_greedy=self.any_greedy,
            use_top_k=self.use_top_k,
            use_top_p=self.use_top_p,
            use_min_p=self.use_min_p,
            top_k_bound=self.top_k_bound,
        )


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
    same set before or after the other filters renormalise), renormalise. Greedy rows: one-hot at
    the argmax of the raw logits.
    """
    if logits.shape[0] != state.num_rows:
        raise ValueError(f"logits have {logits.shape[0]} rows but the sampling state has {state.num_rows}")
    if state.all_greedy:
        return _one_hot_argmax(logits)
    per_row = (-1,) + (1,) * (logits.dim() - 1)  # [N, 1] or [N, 1, 1]: broadcast over S and V
    temperature = torch.where(state.is_greedy, 1.0, state.temperature).view(per_row)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
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


def draw_uniforms(
    generators: Sequence[torch.Generator | None],
    vocab: int,
    device: torch.device | str,
    skip: Sequence[bool] | None = None,
) -> torch.Tensor:
    """[N, V + MAX_NUM_DRAFT] float64 U[0, 1) numbers: one step's randomness for each row.

    Seeded row i draws torch.rand(V + MAX_NUM_DRAFT, dtype=float64, generator=generators[i]), one
    kernel per seeded row. Rows with skip[i] (greedy) draw nothing. Rows without a generator share
    one batched draw from the default generator; if there are none it is skipped and skipped rows
    hold 0.5.
    """
    num_rows, size = len(generators), vocab + MAX_NUM_DRAFT
    skip = list(skip) if skip is not None else [False] * num_rows
    if any(g is None and not s for g, s in zip(generators, skip)):
        uniforms = torch.rand(num_rows, size, dtype=torch.float64, device=device)
    else:
        uniforms = torch.full((num_rows, size), 0.5, dtype=torch.float64, device=device)
    for row, (generator, is_skipped) in enumerate(zip(generators, skip)):
        if generator is not None and not is_skipped:
            uniforms[row].uniform_(generator=generator)
    return uniforms


def exponential_race(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """weights [N, V] >= 0 (need not sum to 1, each row some > 0, at most ~1e15); uniforms [N, V]
    in [0, 1) -> [N] int64, token v with probability weights[v] / sum(weights).

    E_v = -log(u_v) are i.i.d. Exp(1), so E_v / w_v is exponential with rate w_v and the smallest
    of them, the argmax of w_v / E_v, is v with probability w_v / sum(w). u = 0 gives a large but
    finite E (~708), never inf, so a row whose only positive weight drew u = 0 still picks it.
    """
    exponentials = -torch.log(uniforms.clamp_min(torch.finfo(uniforms.dtype).tiny))
    return (weights / exponentials.to(weights.dtype)).argmax(-1)


def sample(
    probs: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    is_greedy: Sequence[bool] | None = None,
) -> torch.Tensor:
    """probs [N, V] (from logits_to_probs) -> tokens [N] int64, one per row, each drawn with its
    row's generator (one torch.rand(V + MAX_NUM_DRAFT, float64) per seeded sampled row, of which
    the first V are used; see the module docstring).

    is_greedy (host list, e.g. state.is_greedy_rows) marks rows that consume no randomness; their
    probs must be one-hot (logits_to_probs makes them so), which the race picks whatever the
    uniforms, so they come out as the argmax.
    """
    if is_greedy is not None and all(is_greedy):
        return probs.argmax(-1)
    vocab = probs.shape[-1]
    uniforms = draw_uniforms(generators, vocab, probs.device, skip=is_greedy)  # [N, V + MAX_NUM_DRAFT]
    return exponential_race(probs, uniforms[:, :vocab])
