"""What a request's SamplingParams do to the logits before a token is picked: logit bias, min_tokens
and the repetition, frequency and presence penalties, applied at every position a step verifies,
counting the drafts before that position as part of the output.

The logits at a verify row's position j predict the token after the sequence and drafts 0..j-1,
so they are shaped as a plain step would shape them after those tokens: penalized with the
output's counts plus those drafts', and with the stop tokens barred while the output and those
drafts number fewer than min_tokens. Where a draft is rejected, the positions after it are never
read, so every emitted token is picked from the distribution plain decoding picks from: greedy
output is plain's, seeded sampling plain's, token for token (tests/test_penalties.py). vLLM's
order: the logit bias added and the stop tokens barred first, then repetition_penalty over prompt
and output tokens, then frequency and presence penalties over the output's counts.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def shaped(logits: torch.Tensor, rows: list[int], params, prompts: list[list[int]], outputs: list[list[int]],
           stop_ids: list[list[int]], draft_tokens: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """logits [B, S, V] shaped by the params of `rows` (with the prompt and output token ids of
    each, and the stop token ids that min_tokens bars) at each position, the draft tokens [B, K]
    that come before it (before [B, S, K]: a chain's earlier drafts, a tree node's path:
    chain_before, tree_before) counted as output; a new tensor, float32, the other rows as they
    were."""
    device, V = logits.device, logits.shape[-1]
    index = torch.tensor(rows, device=device)
    before = before.index_select(0, index)
    x = logits.index_select(0, index).float()
    per_row = (-1, 1, 1)
    if any(p.logit_bias for p in params):
        bias = torch.zeros(len(rows), V)
        for k, p in enumerate(params):
            if p.logit_bias:
                bias[k, list(p.logit_bias)] = torch.tensor(list(p.logit_bias.values()), dtype=torch.float32)
        x = x + bias.to(device)[:, None, :]
    for k, p in enumerate(params):
        barred = [t for t in stop_ids[k] if t < V]
        if p.min_tokens and barred:
            # position j's token would be output token len(output) + (drafts before j)
            early = len(outputs[k]) + before[k].sum(-1) < p.min_tokens                          # [S]
            x[k, :, barred] = x[k, :, barred].masked_fill(early[:, None], float("-inf"))
    if not any(p.has_penalties for p in params):
        return logits.float().index_copy(0, index, x)
    counts = torch.zeros(len(rows), V, device=device)
    for k, ids in enumerate(outputs):
        if ids:
            counts[k] = torch.bincount(torch.tensor(ids, device=device), minlength=V)[:V].float()
    drafts = F.one_hot(draft_tokens.index_select(0, index), V).float()                     # [R, K, V]
    counts = counts[:, None, :] + torch.bmm(before.float(), drafts)                        # [R, S, V]
    if any(p.repetition_penalty != 1 for p in params):
        repetition = torch.tensor([p.repetition_penalty for p in params], device=device).view(per_row)
        seen = torch.zeros(len(rows), V, dtype=torch.bool, device=device)
        for k, ids in enumerate(prompts):
            seen[k, torch.tensor(ids, device=device)] = True
        seen = seen[:, None, :] | (counts > 0)
        x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
    frequency = torch.tensor([p.frequency_penalty for p in params], device=device).view(per_row)
    presence = torch.tensor([p.presence_penalty for p in params], device=device).view(per_row)
    x = x - frequency * counts - presence * (counts > 0)
    return logits.float().index_copy(0, index, x)


def chain_before(num_draft: torch.Tensor, S: int, K: int) -> torch.Tensor:
    """[B, S, K]: draft i comes before position j where i < j (and i is a draft of its row)."""
    order = torch.arange(K, device=num_draft.device)
    earlier = order[None, None, :] < torch.arange(S, device=num_draft.device)[None, :, None]
    return earlier & (order < num_draft[:, None])[:, None, :]


def tree_before(ancestors: torch.Tensor, num_draft: torch.Tensor) -> torch.Tensor:
    """[B, K + 1, K]: a tree's node i comes before position j + 1 (after node j) where it is node
    j or on its path (ancestors [B, K, K], tree.tree_ancestors'); nothing before the root's."""
    B, K, _ = ancestors.shape
    is_node = torch.arange(K, device=ancestors.device) < num_draft[:, None]
    below = ancestors & is_node[:, None, :] & is_node[:, :, None]
    return torch.cat([below.new_zeros(B, 1, K), below], dim=1)
