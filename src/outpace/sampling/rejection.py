"""Verification of drafted chains against the target: greedy and seeded sampling, batched and ragged.

Shapes: B sequences, K drafted positions (padded), V vocabulary.
  target_logits [B, K+1, V]: position i is the target's prediction after the sequence's last token
                             followed by drafts 0..i-1 (position num_draft gives the bonus token).
  draft_tokens  [B, K] int64: entries at i >= num_draft[b] are padding, any value, never read as tokens.
  num_draft     [B] int64 in [0, K].
Outputs: out_tokens [B, K+1] int64 and num_out [B] int64 in [1, num_draft + 1]; out_tokens[b, :num_out[b]]
are the tokens to append (the accepted drafts then one target token); entries past num_out are padding.

Both rules are one rule: the target picks a token at every position (its argmax, or its sample at
that position's noise u(seed, i), see sampling/sampler.py), drafts are accepted while each equals
the target's pick, and the pick after the last accepted draft is appended. Drafts only decide how
many of the picks one forward yields, never which tokens they are.
"""
from __future__ import annotations

import torch

from outpace.sampling.sampler import SamplingState, inverse_cdf, logits_to_probs


def greedy_tokens(target: torch.Tensor) -> torch.Tensor:
    """The target's picks [B, S]: the argmax of its logits [B, S, V], or picks already made (a CPU
    runner takes the argmax over the real tokens before padding rows; verify_sampling samples)."""
    return target.argmax(-1) if target.dim() == 3 else target


def verify_greedy(
    target: torch.Tensor, draft_tokens: torch.Tensor, num_draft: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept drafts while each equals the target's pick, then append the target's next pick.
    target: the target's logits [B, K+1, V] (picks: their argmax) or its picks [B, K+1]."""
    num_positions = draft_tokens.shape[1]
    target_tokens = greedy_tokens(target)  # [B, K+1]
    is_draft = torch.arange(num_positions, device=draft_tokens.device) < num_draft[:, None]  # [B, K]
    # Draft i is accepted iff drafts 0..i are all real and equal the target's pick at their position.
    is_match = (draft_tokens == target_tokens[:, :num_positions]) & is_draft
    num_accepted = is_match.long().cumprod(-1).sum(-1)  # [B]
    # Accepted drafts equal the target's picks and position num_accepted holds the correction or
    # the bonus, so the target's picks are the output as they stand.
    return target_tokens, num_accepted + 1


def verify_sampling(
    target_logits: torch.Tensor, draft_tokens: torch.Tensor, num_draft: torch.Tensor, state: SamplingState
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling by shared noise: the target samples every position of the chain, the
    drafts' and the bonus', with that position's own u(seed, i) (the contract in sampler.py), and
    drafts are accepted while each equals the target's sample at its position; then the target's
    sample at the first mismatch (or the bonus) is emitted.

    Every emitted token is therefore the one plain sampling emits at that position after the same
    tokens: the output is plain seeded sampling's token for token, whatever the drafts, so it is
    distributed exactly as the target's shaped distribution. Greedy rows' probs are one-hot, so
    they give exactly verify_greedy's result.
    """
    if state.all_greedy:
        return verify_greedy(target_logits, draft_tokens, num_draft)
    probs = logits_to_probs(target_logits, state)  # [B, K+1, V] float32
    target_tokens = inverse_cdf(probs, state.uniforms(target_logits.shape[1]))  # [B, K+1]
    return verify_greedy(target_tokens, draft_tokens, num_draft)
