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

from collections import Counter

import torch

from outpace.runner.staging import to_device


def shaped(logits: torch.Tensor, rows: list[int], params, columns: list["ShapingColumns"], outputs: list[int],
           draft_tokens: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """logits [B, S, V] shaped by the params of `rows` (each row's ShapingColumns, up to date,
    and how many tokens it has output) at each position, the draft tokens [B, K] that come before
    it (before [B, S, K]: a chain's earlier drafts, a tree node's path: chain_before, tree_before)
    counted as output; a new tensor, float32, the other rows as they were.

    Only the logits of a row's touched tokens change: its output's, its prompt's (under a
    repetition penalty), its biased and barred ones, and its drafts. So the work is done on those
    columns alone, gathered from the logits and scattered back, never over the vocabulary: a
    row's host-known tokens (ShapingColumns: unique, each with its facts) and its K drafts, whose
    facts are those of the host token they match (none where they match none). A token twice
    among the columns gets the same value in both, so the scatter writes it once in effect. The
    host sends its part in two copies that never wait for the device."""
    device = logits.device
    R, M = len(rows), max(c.size for c in columns)
    # padded with copies of a row's first column, facts and all, which a draft's match skips (it
    # would count it twice)
    host_tokens, facts = torch.empty(R, M, dtype=torch.long), torch.empty(R, M, 4)
    is_copy = torch.zeros(R, M)
    for r, c in enumerate(columns):
        host_tokens[r, :c.size], facts[r, :c.size] = c.tokens[:c.size], c.facts[:c.size]
        host_tokens[r, c.size:], facts[r, c.size:], is_copy[r, c.size:] = c.tokens[0], c.facts[0], 1.0
    scalars = torch.tensor([value for p, n in zip(params, outputs) for value in (
        p.repetition_penalty, p.frequency_penalty, p.presence_penalty, p.min_tokens - n)])
    ints = to_device(torch.cat([torch.tensor(rows), host_tokens.flatten()]), device)
    index, host_tokens = ints.split([R, R * M])
    floats = to_device(torch.cat([facts.flatten(), is_copy.flatten(), scalars]), device, torch.float32)
    facts, is_copy, scalars = floats.split([R * M * 4, R * M, R * 4])
    facts = facts.view(R, M, 4)
    repetition, frequency, presence, tokens_left = scalars.view(R, 4, 1, 1).unbind(1)     # each [R, 1, 1]

    host_tokens = host_tokens.view(R, M)
    drafts = draft_tokens.index_select(0, index)                                # [R, K]
    before = before.index_select(0, index).float()                              # [R, S, K]
    # a draft's facts: those of the host column holding its token (host tokens are unique)
    match = (drafts[:, :, None] == host_tokens[:, None, :]) & (is_copy.view(R, 1, M) == 0)   # [R, K, M]
    facts = torch.cat([facts, torch.bmm(match.float(), facts)], dim=1)          # [R, C, 4]
    tokens = torch.cat([host_tokens, drafts], dim=1)                            # [R, C]
    output_count, in_prompt, bias, is_stop = facts.unbind(-1)                   # each [R, C]
    # each column's count at each position: the output's, plus the drafts before that position
    same = (drafts[:, :, None] == tokens[:, None, :]).float()                   # [R, K, C]
    counts = output_count[:, None, :] + torch.bmm(before, same)                 # [R, S, C]

    x = logits.index_select(0, index).float()                                   # [R, S, V]
    S = x.shape[1]
    at = tokens[:, None, :].expand(-1, S, -1)
    v = x.gather(2, at) + bias[:, None, :]
    # position j's token would be output token len(output) + (drafts before j): the stop tokens
    # are barred there while that falls short of min_tokens
    early = before.sum(-1, keepdim=True) < tokens_left                          # [R, S, 1]
    v = v.masked_fill(early & (is_stop[:, None, :] > 0), float("-inf"))
    seen = (in_prompt[:, None, :] > 0) | (counts > 0)
    v = torch.where(seen, torch.where(v > 0, v / repetition, v * repetition), v)
    v = v - frequency * counts - presence * (counts > 0)
    return logits.float().index_copy(0, index, x.scatter_(2, at, v))


class ShapingColumns:
    """One sequence's host-known tokens whose logits its params may change, for shaped(): each
    token once, with its facts (output count, in the prompt, bias, a barred stop token), as
    tensors on the host. The prompt's, biased and barred tokens are set once; update counts the
    output tokens added since its last call, so a step costs the host its new tokens' work, not
    the whole prompt's and output's again. Never empty (a token of the prompt, with no facts)."""

    def __init__(self, params, prompt: list[int], stops: list[int], vocab_size: int):
        in_prompt = set(prompt) if params.repetition_penalty != 1 else set()
        bias = params.logit_bias or {}
        barred = {t for t in stops if t < vocab_size} if params.min_tokens else set()
        tokens = sorted(in_prompt | bias.keys() | barred) or [prompt[-1]]
        self.index = {t: i for i, t in enumerate(tokens)}
        self.size = len(tokens)
        capacity = max(2 * self.size, 64)
        self.tokens = torch.zeros(capacity, dtype=torch.long)
        self.facts = torch.zeros(capacity, 4)
        self.tokens[:self.size] = torch.tensor(tokens)
        self.facts[:self.size] = torch.tensor([(0.0, float(t in in_prompt), bias.get(t, 0.0), float(t in barred))
                                               for t in tokens])
        self.counted = 0            # output tokens counted

    def update(self, token_ids: list[int], num_prompt: int) -> None:
        """Counts the sequence's output tokens (token_ids past its num_prompt prompt tokens) added
        since the last call."""
        new = Counter(token_ids[num_prompt + self.counted:])
        self.counted = len(token_ids) - num_prompt
        if not new:
            return
        fresh = [t for t in new if t not in self.index]
        if self.size + len(fresh) > len(self.tokens):
            grown = max(2 * len(self.tokens), self.size + len(fresh))
            self.tokens = torch.cat([self.tokens, self.tokens.new_zeros(grown - len(self.tokens))])
            self.facts = torch.cat([self.facts, self.facts.new_zeros(grown - len(self.facts), 4)])
        for t in fresh:
            self.index[t] = self.size
            self.size += 1
        if fresh:
            self.tokens[self.size - len(fresh):self.size] = torch.tensor(fresh)
        at = torch.tensor([self.index[t] for t in new], dtype=torch.long)
        self.facts[:, 0].index_add_(0, at, torch.tensor(list(new.values()), dtype=torch.float32))


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
