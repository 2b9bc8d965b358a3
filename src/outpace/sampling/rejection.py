"""Verification of drafted chains against the target: greedy and speculative sampling, batched and ragged.

Shapes: B sequences, K drafted positions (padded), V vocabulary.
  target_logits [B, K+1, V]: position i is the target's prediction after the sequence's last token
                             followed by drafts 0..i-1 (position num_draft gives the bonus token).
  draft_tokens  [B, K] int64: entries at i >= num_draft[b] are padding, any value, never read as tokens.
  num_draft     [B] int64 in [0, K].
  draft_probs   [B, K, V] or None: the distribution each draft was sampled from; None = one-hot
                (the drafter was certain, q(x) = 1 at the drafted token).
Outputs: out_tokens [B, K+1] int64 and num_out [B] int64 in [1, num_draft + 1]; out_tokens[b, :num_out[b]]
are the tokens to append (the accepted drafts then one target token); entries past num_out are padding.

Randomness (the contract in sampling/sampler.py): a seeded sampled row draws one
u = torch.rand(V + MAX_NUM_DRAFT, float64) per call whatever K or num_draft are; u[V + i] is draft
i's acceptance uniform and u[:V] drive the race for the emitted target token. Greedy rows draw nothing.
"""
from __future__ import annotations

import torch

from outpace.sampling.sampler import MAX_NUM_DRAFT, SamplingState, draw_uniforms, exponential_race, logits_to_probs


def greedy_tokens(target: torch.Tensor) -> torch.Tensor:
    """The target's tokens [B, S]: the argmax of its logits [B, S, V], or that argmax already taken
    (a CPU runner takes it over the real tokens before padding rows)."""
    return target.argmax(-1) if target.dim() == 3 else target


def verify_greedy(
    target: torch.Tensor, draft_tokens: torch.Tensor, num_draft: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept drafts while each equals the target's argmax, then append the target's argmax.
    target: the target's logits [B, K+1, V] or their tokens (greedy_tokens)."""
    num_positions = draft_tokens.shape[1]
    target_tokens = greedy_tokens(target)  # [B, K+1]
    is_draft = torch.arange(num_positions, device=draft_tokens.device) < num_draft[:, None]  # [B, K]
    # Draft i is accepted iff drafts 0..i are all real and equal the target's argmax at their position.
    is_match = (draft_tokens == target_tokens[:, :num_positions]) & is_draft
    num_accepted = is_match.long().cumprod(-1).sum(-1)  # [B]
    # Accepted drafts equal the target's tokens and position num_accepted holds the correction or
    # the bonus, so the target's argmaxes are the output as they stand.
    return target_tokens, num_accepted + 1


def verify_sampling(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_draft: torch.Tensor,
    state: SamplingState,
    draft_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling (Leviathan et al. 2023): every emitted token is distributed exactly as
    plain sampling from the target (with the row's temperature/top-k/top-p/min-p) would give it.

    With num_draft 0 this is plain sampling: the same token as sample() from the same generator
    state, leaving the generator in the same state. Greedy rows give exactly verify_greedy's result.
    """
    batch, num_positions, vocab = target_logits.shape
    num_slots = num_positions - 1  # K
    if state.all_greedy:
        return verify_greedy(target_logits, draft_tokens, num_draft)
    if num_slots > MAX_NUM_DRAFT:
        raise ValueError(f"at most {MAX_NUM_DRAFT} drafted tokens per step, got {num_slots}")
    device = target_logits.device
    probs = logits_to_probs(target_logits, state)  # [B, K+1, V] float32, p
    uniforms = draw_uniforms(state.generators, vocab, device, skip=state.is_greedy_rows)  # [B, V + MAX_NUM_DRAFT]
    u_race, u_accept = uniforms[:, :vocab], uniforms[:, vocab:vocab + num_slots]  # [B, V], [B, K]
    num_draft = num_draft.clamp(0, num_slots)
    drafts = draft_tokens.clamp(0, vocab - 1)  # [B, K]: padding may hold any value; it is masked below

    p_draft = probs[:, :num_slots].gather(-1, drafts[..., None]).squeeze(-1)  # [B, K] p_i(x_i)
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(-1, drafts[..., None]).squeeze(-1).float()  # [B, K] q_i(x_i)
    is_draft = torch.arange(num_slots, device=device) < num_draft[:, None]  # [B, K]
    # Accept draft x_i iff u_i < p_i(x_i) / q_i(x_i), u_i ~ U[0, 1), written u_i * q_i(x_i) < p_i(x_i)
    # (no division; q = 0 accepts whenever p > 0, p = 0 never accepts). One-hot q: accept with
    # probability p_i(x_i). A row keeps the longest all-accepted prefix of its real drafts.
    is_accepted = (u_accept * q_draft < p_draft) & is_draft
    num_accepted = is_accepted.long().cumprod(-1).sum(-1)  # [B], j in [0, num_draft]

    # The next token comes from position j = num_accepted:
    #   j < num_draft (draft j rejected): from normalize(max(p_j - q_j, 0)); one-hot q: p_j without x_j;
    #   j = num_draft (all accepted):     the bonus, from p_j.
    # max(p_j - q_j, 0) sums to 0 only if p_j = q_j, where rejection has probability 0: fall back to p_j.
    # The race needs no normalisation.
    p_next = probs.gather(1, num_accepted.view(batch, 1, 1).expand(batch, 1, vocab)).squeeze(1)  # [B, V]
    if num_slots == 0:
        weights = p_next
    else:
        is_rejected = (num_accepted < num_draft)[:, None]  # [B, 1]
        slot = num_accepted.clamp(max=num_slots - 1)  # [B]; bonus rows read slot K-1, masked by is_rejected
        if draft_probs is None:
            q_next = torch.zeros_like(p_next).scatter_(-1, drafts.gather(1, slot[:, None]), 1.0)
        else:
            q_next = draft_probs.gather(1, slot.view(batch, 1, 1).expand(batch, 1, vocab)).squeeze(1).float()
        weights = (p_next - q_next * is_rejected).clamp_min(0)  # [B, V]
        weights = torch.where(weights.sum(-1, keepdim=True) > 0, weights, p_next)
    next_token = exponential_race(weights, u_race)  # [B]

    out_tokens = torch.cat([draft_tokens, draft_tokens.new_zeros(batch, 1)], dim=1)  # [B, K+1]
    out_tokens = out_tokens.scatter(1, num_accepted[:, None], next_token[:, None])
    num_out = num_accepted + 1
    if state.any_greedy:
        greedy_tokens, greedy_num_out = verify_greedy(target_logits, draft_tokens, num_draft)
        out_tokens = torch.where(state.is_greedy[:, None], greedy_tokens, out_tokens)
        num_out = torch.where(state.is_greedy, greedy_num_out, num_out)
    return out_tokens, num_out
