"""DrafterChain: drafters in priority order, the first that drafts for a row wins that step.

The use: n-gram lookup where the sequence's tail matches an earlier span (free, and long accepted
runs), a draft model elsewhere. Every drafter sees every sequence's whole life (begin, prefilled,
verified, accept, end), so a later drafter's state stays current for rows an earlier one drafted
(a draft model catches up on the tokens it did not draft). Drafts must come with host lengths.

Where a paying drafter follows a free one, the controller's length (the step's budget) prices the
paying one; the free one drafts up to each row's room, and its rows are marked free for the
controller to cut after drafting, at no drafting cost (priced as the paying drafter, a lookup's
draft would be held to the length a draft model can pay for).

On a GPU the lookup also has a device twin (`lookup`, DeviceNgramDrafter, factory.lookup_twin),
which hears every sequence's life too. Its graph step is the chain's: where the paying drafter
would draft for no row, the runner's captured step drafts the twin's rows (as n-gram alone would)
and verifies them itself, and the step after it may be launched ahead (GraphStep); a step in which
the paying drafter drafts runs the chain on the host.
"""
from __future__ import annotations

from typing import Sequence

from outpace.speculative.drafter import DraftBatch, Drafter, Drafts


class DrafterChain(Drafter):
    name = "chain"

    def __init__(self, drafters: Sequence[Drafter], lookup: Drafter | None = None):
        self.drafters = list(drafters)
        self.lookup = lookup
        self.members = self.drafters + ([lookup] if lookup is not None else [])    # who hears every sequence
        # a paying drafter in the chain: the controller's budget comes first
        self.priced_after_drafting = all(d.priced_after_drafting for d in self.drafters)
        self.uses_room = not self.priced_after_drafting and any(d.priced_after_drafting for d in self.drafters)
        self.hears_plain = any(d.hears_plain for d in self.drafters)

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """Every drafter's layers (a head learns its layers when it is bound)."""
        return tuple(sorted({i for d in self.drafters for i in d.hidden_layers}))

    def bind(self, context):
        for d in self.members:
            d.bind(context)

    def begin(self, seq_id, token_ids):
        for d in self.members:
            d.begin(seq_id, token_ids)

    def propose(self, batch: DraftBatch) -> Drafts:
        rows: list[list[int]] = [[] for _ in range(len(batch))]
        match, free = [0] * len(batch), [False] * len(batch)
        for d in self.drafters:
            # a free drafter in a paying chain drafts up to the room, the others within the budget
            limit = batch.room if self.uses_room and d.priced_after_drafting and batch.room else batch.budget
            pending = [i for i, r in enumerate(rows) if not r and limit[i] > 0]
            if not pending:
                continue
            sub = batch.subset(pending)
            sub.budget = [limit[i] for i in pending]
            drafts = d.propose(sub)
            for i, tokens, m in zip(pending, drafts.host_rows(), drafts.match_len or [0] * len(pending)):
                rows[i], match[i], free[i] = tokens, m, bool(tokens) and d.priced_after_drafting
        return Drafts.from_lists(rows, match, free=free if self.uses_room else None)

    def prefilled(self, chunks):
        for d in self.members:
            d.prefilled(chunks)

    def verified(self, result):
        for d in self.members:
            d.verified(result)

    def verified_in_graph(self, result):
        """The chain's drafters alone: the graph step appended the lookup twin's tokens itself."""
        for d in self.drafters:
            d.verified(result)

    def accept(self, seq_id, token_ids):
        for d in self.members:
            d.accept(seq_id, token_ids)

    def end(self, seq_id):
        for d in self.members:
            d.end(seq_id)

    def setup_seconds(self, seq_ids):
        """What the drafters that have a setup charge together (a row the lookup drafts for pays
        none this step, but would pay it the first time the model drafts for it)."""
        setups = [s for s in (d.setup_seconds(seq_ids) for d in self.drafters) if s is not None]
        return [sum(parts) for parts in zip(*setups)] if setups else None

    def cost_per_token(self, batch_size):
        return max(d.cost_per_token(batch_size) for d in self.drafters)

    def graph_step(self, max_rows, max_tokens):
        """The lookup's device twin's part of the runner's graph step, where there is one."""
        return None if self.lookup is None else self.lookup.graph_step(max_rows, max_tokens)
