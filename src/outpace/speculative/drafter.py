"""The drafter interface: every drafter (n-gram, trie, draft model, EAGLE/MTP head) implements it.

The decode loop only ever calls begin / propose / accept / end, so a new drafter plugs in without
touching the loop. Sequences are named by an integer id that the engine owns.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class Draft:
    """Drafted tokens for one sequence.

    A chain when parents is None; a tree otherwise, parents[i] being the index of token i's parent
    in `tokens` or -1 for a child of the sequence's last token. probs, when given, is the drafter's
    distribution at each drafted position, [len(tokens), vocab]; without it, verification treats
    the draft as one-hot (the drafter was certain). match_len, for drafters that find their draft
    by matching the sequence's tail (n-gram, suffix structures), is how many tail tokens matched:
    longer matches are accepted far more often, and the draft controller learns by how much.
    """

    tokens: list[int]
    parents: list[int] | None = None
    probs: torch.Tensor | None = None
    match_len: int = 0

    def __len__(self) -> int:
        return len(self.tokens)

    def truncated(self, n: int) -> "Draft":
        """The first n tokens (a tree's first n nodes: parents come before their children)."""
        return Draft(self.tokens[:n], None if self.parents is None else self.parents[:n],
                     None if self.probs is None else self.probs[:n], self.match_len)


class Drafter:
    """Base class. Subclasses override what they need; the defaults keep no state."""

    name = "drafter"

    def begin(self, seq_id: int, token_ids: Sequence[int]) -> None:
        """A sequence starts with these tokens (the prompt)."""

    def propose(self, seq_ids: Sequence[int], max_tokens: Sequence[int]) -> list[Draft | None]:
        """Draft at most max_tokens[i] tokens for each sequence; None (or an empty draft) = no draft."""
        return [None] * len(seq_ids)

    def accept(self, seq_id: int, token_ids: Sequence[int]) -> None:
        """Tokens appended to a sequence after verification (accepted drafts plus the target's token)."""

    def end(self, seq_id: int) -> None:
        """The sequence finished or was cancelled: drop its state."""


class DrafterChain(Drafter):
    """Drafters in priority order: the first that proposes for a sequence wins that step."""

    name = "chain"

    def __init__(self, drafters: Sequence[Drafter]):
        self.drafters = list(drafters)

    def begin(self, seq_id, token_ids):
        for d in self.drafters:
            d.begin(seq_id, token_ids)

    def propose(self, seq_ids, max_tokens):
        drafts: list[Draft | None] = [None] * len(seq_ids)
        for d in self.drafters:
            pending = [i for i, dr in enumerate(drafts) if not dr]
            if not pending:
                break
            proposed = d.propose([seq_ids[i] for i in pending], [max_tokens[i] for i in pending])
            for i, dr in zip(pending, proposed):
                drafts[i] = dr
        return drafts

    def accept(self, seq_id, token_ids):
        for d in self.drafters:
            d.accept(seq_id, token_ids)

    def end(self, seq_id):
        for d in self.drafters:
            d.end(seq_id)
