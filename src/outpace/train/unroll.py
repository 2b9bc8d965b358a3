"""EAGLE-3's training-time test: the head unrolled over whole sequences as it drafts.

A batch holds B answered sequences padded to T tokens; S = T - 1 pairs. Step 0 reads pair t
(the target's features at t, token t + 1) at rotary position t, attending causally over the
pairs, and predicts token t + 2: a first draft after the sequence's first t + 2 tokens. Step
k > 0 reads, at index t, (step k - 1's output at t, token t + 1 + k) at rotary position t + k,
attending to step 0's pairs up to t and to steps 1 .. k at index t: the k + 1-th draft of that
same drafting step, attending exactly as HeadDrafter's chain node at depth k + 1 does (the
row's pairs before its start, its ancestors, itself). The tokens fed are the sequence's own
(teacher forcing): a draft counts only while every draft before it was right, and then those are
the tokens drafted, so the accepted length measured here is the drafter's.

(EAGLE-3's and SpecForge's trainers also hide pair t - k + 1 .. t from step k, a mask that
inference does not apply; here training attends as drafting does.)

Loss (EAGLE-3's): at step k, index t, the cross-entropy of the head's draft distribution against
the target's distribution at position t + 1 + k restricted to the draft vocabulary, where token
t + 2 + k is an answer token (the target's own greedy choice) and in the draft vocabulary;
steps weighted 0.8^k.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from outpace.model.draft_head import DraftHead

STEP_DECAY = 0.8        # the loss weight of step k is STEP_DECAY ** k


@dataclass
class Batch:
    """B padded sequences for `steps` unrolled steps (padding: token 0, never an answer)."""

    tokens: torch.Tensor            # [B, S + steps + 1] int64
    is_answer: torch.Tensor         # [B, S + steps + 1] bool: the token is the target's greedy answer
    hidden: torch.Tensor            # [B, S, layers, Ht]: the features' target layers at pairs 0 .. S - 1
    target_logits: torch.Tensor     # [B, S + steps, Vd] float32: the target's logits over the draft vocabulary


class Unroll:
    """The head's steps over one batch; each step's keys and values are kept for the next. Step 0
    runs at every index; a later step may run at the last indices alone (their queries, keys and
    values): an index's later steps read only step 0's keys and that index's own."""

    def __init__(self, head: DraftHead, embed: torch.nn.Module, num_pairs: int):
        self.head, self.embed, self.S = head, embed, num_pairs
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def step(self, feature: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Step k = the steps taken so far: features [B, n, H] and tokens [B, n] at indices
        S - n .. S - 1 (n = S at step 0, the same n at every later step) -> outputs [B, n, H]."""
        B, n = tokens.shape
        k = len(self.keys)
        positions = (torch.arange(self.S - n, self.S, device=tokens.device) + k).expand(B, n)
        embed = self.embed(tokens).to(feature.dtype)
        residual, q, key, value = self.head.project(feature, embed, positions)
        self.keys.append(key)
        self.values.append(value)
        return self.head.finish(residual, self._attend(q))

    def _attend(self, q: torch.Tensor) -> torch.Tensor:
        """q [B, n, Hq, D] (indices S - n ..) over step 0's keys (causal) and later steps' keys at
        the same index. Query head h reads key/value head h // groups: the queries are viewed as
        [B, n, KVH, groups, D] rather than the keys repeated, so a step copies no keys or values."""
        B, n, Hq, D = q.shape
        S, KVH = self.S, self.keys[0].shape[2]
        q, scale = q.view(B, n, KVH, Hq // KVH, D), D ** -0.5
        scores = torch.einsum("bskgd,btkd->bkgst", q, self.keys[0]) * scale                 # [B, KVH, G, n, S]
        causal = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()[S - n:]
        scores = scores.masked_fill(~causal, float("-inf"))
        diagonal = [torch.einsum("bskgd,bskd->bkgs", q, k)[..., None] * scale for k in self.keys[1:]]
        weights = torch.cat([scores, *diagonal], -1).float().softmax(-1).to(q.dtype)
        out = torch.einsum("bkgst,btkd->bskgd", weights[..., :S], self.values[0])
        for j, v in enumerate(self.values[1:]):
            out = out + weights[..., S + j].permute(0, 3, 1, 2)[..., None] * v[:, :, :, None]
        return out.flatten(-3)


def unrolled_loss(head: DraftHead, embed: torch.nn.Module, batch: Batch, steps: int, in_vocab: torch.Tensor,
                  top: int = 0, sliced: bool = True):
    """(loss, accepted [B, S] drafts accepted in a row at each index, counts [B, S] where a first
    draft predicts an answer token, ranks). in_vocab [V] bool: the draft vocabulary's target ids.
    top > 0: ranks [B, S, steps] of each step's answer token among the head's `top` best drafts
    there (0: its argmax; `top` where it is not among them or not an answer token), else None.
    sliced False: steps after the first run at every index (the same results, for tests)."""
    S = batch.hidden.shape[1]
    feature = head.features(batch.hidden)
    B = batch.tokens.shape[0]
    # steps k >= 1 at index t predict token t + 2 + k; none is an answer token before the batch's
    # first answer token less `steps` (so step 0, every index, leaves their runs at 0 there)
    first = torch.where(batch.is_answer.any(1), batch.is_answer.long().argmax(1), batch.is_answer.shape[1])
    start = max(0, min(int(first.min()) - 1 - steps, S - 1)) if sliced else 0
    unroll = Unroll(head, embed, S)
    loss = 0.0
    run = torch.ones(B, S, dtype=torch.bool, device=batch.tokens.device)                   # all right so far
    accepted = torch.zeros(run.shape, dtype=torch.long, device=run.device)
    ranks = []
    target = batch.target_logits.softmax(-1)                # step k reads positions k + 1 .. k + S
    for k in range(steps):
        a = 0 if k == 0 else start                          # the step's first index
        out = unroll.step(feature, batch.tokens[:, k + 1 + a:k + 1 + S])
        logits = head.logits(out)                                                           # [B, S - a, Vd]
        labels = batch.tokens[:, k + 2 + a:k + 2 + S]
        answer = batch.is_answer[:, k + 2 + a:k + 2 + S]
        counted = answer & in_vocab[labels]
        cross = -(target[:, k + 1 + a:k + 1 + S] * F.log_softmax(logits, -1)).sum(-1)
        loss = loss + STEP_DECAY ** k * (cross * counted).sum() / counted.sum().clamp(min=1)
        with torch.no_grad():
            run[:, a:] &= answer & (head.to_target(logits.argmax(-1)) == labels)
            accepted += run
            if top:
                hit = (head.to_target(logits.topk(top, -1).indices) == labels[..., None]) & answer[..., None]
                rank = torch.where(hit.any(-1), hit.long().argmax(-1), top)
                ranks.append(F.pad(rank, (a, 0), value=top))
        feature = out[:, start:] if k == 0 else out
    return loss, accepted, batch.is_answer[:, 2:2 + S], torch.stack(ranks, -1) if top else None
