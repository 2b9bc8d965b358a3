"""Answers as a head's unrolled steps read them, and the drafts it gets accepted on them.

The trainer batches its training answers through `Answers.batch` and measures acceptance on its
held-back ones through `Answers.accepted`; benchmarks/head_acceptance.py measures a finished head
the same way on Spec-Bench's answers. A batch's features are computed there: the target reads the
batch's sequences (one forward, no logits) and returns the hidden states of the head's layers and
of its last layer, whose final norm and LM head's rows of the draft vocabulary give the target's
logits over that vocabulary.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, ContextManager

import torch

from outpace.kernels.fused import linear
from outpace.model.draft_head import DraftHead
from outpace.runner.model_runner import ModelRunner, Row
from outpace.train.head_data import Answer
from outpace.train.unroll import Batch, unrolled_loss


class Answers:
    def __init__(self, target, head_layers: tuple[int, ...], ids: torch.Tensor, steps: int, device, max_len: int,
                 max_rows: int):
        """head_layers: the target layers the head reads; ids [Vd]: the draft vocabulary's target
        ids; steps: unrolled steps (chain length); max_len: the longest answer's tokens; max_rows:
        the most answers a batch holds."""
        last = target.cfg.num_layers - 1
        self.layers = tuple(sorted(set(head_layers) | {last}))
        self.features, self.last = [self.layers.index(i) for i in head_layers], self.layers.index(last)
        self.target, self.steps, self.device = target, steps, device
        # a cache of its own: the batch's rows written from position 0, whatever the engine's hold
        self.runner = ModelRunner(target, max_rows, max_len, 1)
        ids = ids.to(device)
        self.lm_rows = lm_head_rows(target, ids).float()                                        # [Vd, H]
        self.in_vocab = torch.zeros(target.cfg.vocab_size, dtype=torch.bool, device=device).index_fill_(0, ids, True)

    def batch(self, seqs: list[Answer]) -> Batch:
        """seqs padded into a Batch on the device, with the target's hidden states at every
        position but each sequence's last (never fed)."""
        T = max(len(s.tokens) for s in seqs)
        S, steps = T - 1, self.steps
        width = S + steps + 1
        tokens = torch.zeros(len(seqs), width, dtype=torch.long)
        is_answer = torch.zeros(len(seqs), width, dtype=torch.bool)
        for b, s in enumerate(seqs):
            n = len(s.tokens)
            tokens[b, :n] = s.tokens
            is_answer[b, s.prompt_len:n] = True
        # every row padded to S from position 0: one causal forward, no mask, nothing packed; a
        # sequence's padding comes after its tokens, so it changes none of their hidden states
        _, read = self.runner.forward([Row(b, tokens[b, :S].tolist(), 0) for b in range(len(seqs))],
                                      logits="none", hidden_layers=self.layers)           # [B, S, layers, H]
        # copied out of the runner's inference-mode tensor (autograd keeps the features for the
        # head's backward), zero past each sequence's end and up to the unrolled steps' width
        ends = torch.tensor([len(s.tokens) - 1 for s in seqs], device=read.device)
        hidden = read.new_zeros(len(seqs), S + steps, *read.shape[2:])
        hidden[:, :S] = read.masked_fill((torch.arange(S, device=read.device) >= ends[:, None])[..., None, None], 0)
        with torch.no_grad():
            target_logits = self.target.norm(hidden[:, :, self.last]).float() @ self.lm_rows.T     # [B, S + steps, Vd]
        return Batch(tokens.to(self.device), is_answer.to(self.device), hidden[:, :S, self.features].float(),
                     target_logits)

    def loss(self, head: DraftHead, seqs: list[Answer]) -> torch.Tensor:
        return unrolled_loss(head, self._embed(head), self.batch(seqs), self.steps, self.in_vocab)[0]

    def accepted(self, head: DraftHead, seqs: list[Answer], batch_size: int,
                 autocast: Callable[[], ContextManager] = nullcontext) -> list[tuple[int, int, int]]:
        """Per sequence: drafts accepted in a row summed over its answer positions (chains of
        `steps`, teacher forced), the positions whose first draft was accepted, and the positions
        counted. autocast: makes the forwards' context."""
        return [run_counts(r) for r in self.runs(head, seqs, batch_size, autocast)]

    @torch.no_grad()
    def runs(self, head: DraftHead, seqs: list[Answer], batch_size: int,
             autocast: Callable[[], ContextManager] = nullcontext) -> list[dict[int, int]]:
        """Per sequence, {p: drafts accepted in a row} at each answer position p that a first
        draft predicts (tokens[p], from the sequence's third token on): the chain drafted after
        tokens[:p], teacher forced."""
        return [{s + 2: n for s, (n, ok) in enumerate(zip(run, counted)) if ok}
                for run, counted, _ in self._unrolled(head, seqs, batch_size, autocast)]

    @torch.no_grad()
    def ranks(self, head: DraftHead, seqs: list[Answer], batch_size: int, top: int) -> list[dict[int, tuple]]:
        """Per sequence, {p: the rank of each step's answer token among the head's `top` best
        drafts along that chain (unrolled_loss's ranks)} at the positions runs gives."""
        return [{s + 2: tuple(r) for s, (r, ok) in enumerate(zip(ranks, counted)) if ok}
                for _, counted, ranks in self._unrolled(head, seqs, batch_size, nullcontext, top)]

    def _unrolled(self, head: DraftHead, seqs: list[Answer], batch_size: int,
                  autocast: Callable[[], ContextManager], top: int = 0):
        """unrolled_loss over seqs in batches: per sequence, its rows of accepted runs, of the
        positions counted and of ranks (None without top), as lists."""
        for i in range(0, len(seqs), batch_size):
            with autocast():
                _, run, counted, ranks = unrolled_loss(head, self._embed(head), self.batch(seqs[i:i + batch_size]),
                                                       self.steps, self.in_vocab, top)
            yield from zip(run.tolist(), counted.tolist(), ranks.tolist() if top else [None] * len(run))

    def _embed(self, head: DraftHead) -> torch.nn.Module:
        return head.embed if head.embed is not None else self.target.embed


def run_counts(runs: dict[int, int]) -> tuple[int, int, int]:
    """One sequence's Answers.runs as (drafts accepted in a row summed, positions whose first
    draft was right, positions)."""
    return sum(runs.values()), sum(n > 0 for n in runs.values()), len(runs)


def lm_head_rows(target, ids: torch.Tensor) -> torch.Tensor:
    """The target's LM head rows of `ids` [n, H]. A CPU model's LM head may hold only a packed copy
    of its weight (and its embedding only blocks), so the rows are read through its forward (the
    identity's products are exact) in the dtype of its final norm's weight, the model's."""
    weight = getattr(target.lm_head, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.shape == (target.cfg.vocab_size, target.cfg.hidden_size):
        return weight[ids]
    eye = torch.eye(target.cfg.hidden_size, dtype=target.norm.weight.dtype, device=ids.device)
    return linear(eye, target.lm_head).T[ids]
