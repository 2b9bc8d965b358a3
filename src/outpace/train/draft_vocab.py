"""A head's draft vocabulary: the target tokens it may propose, the most frequent in its answers.

A head's LM head has a row per draft token, so a reduced vocabulary makes it smaller and its
logits cheaper; a token outside it is never drafted (the target still emits it). The tokens the
head learns to predict are the answers' (the target's own greedy tokens), so those are counted.
Ties go to the lower id, and the ids are kept in increasing order (d2t offsets then never go
negative), so the same data always gives the same vocabulary.
"""
from __future__ import annotations

from typing import Iterable

import torch


def answer_counts(sequences: Iterable, vocab_size: int) -> torch.Tensor:
    """How often each target id occurs in the answers (tokens past each prompt) [vocab_size]."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for seq in sequences:
        counts += torch.bincount(seq.tokens[seq.prompt_len:], minlength=vocab_size)
    return counts


def draft_vocab(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` most frequent ids (all ids when size covers the vocabulary), increasing [size]."""
    size = min(size, len(counts))
    # a stable sort of the negated counts: equal counts keep increasing ids
    order = torch.sort(-counts, stable=True).indices
    return order[:size].sort().values


def coverage(counts: torch.Tensor, ids: torch.Tensor) -> float:
    """The share of counted tokens the vocabulary holds."""
    total = int(counts.sum())
    return int(counts[ids].sum()) / total if total else 0.0
