"""DrafterChain: drafters in priority order, the first that drafts for a row wins that step.

The use: n-gram lookup where the sequence's tail matches an earlier span (free, and long accepted
runs), a draft model elsewhere. Every drafter sees every sequence's whole life (begin, prefilled,
verified, accept, end), so a later drafter's state stays current for rows an earlier one drafted
(a draft model catches up on the tokens it did not draft). Drafts must come with host lengths.

Where a paying drafter follows a free one, the controller's length (the step's budget) prices the
paying one; the free one drafts up to each row's room, and its rows are marked free for the
controller to cut after drafting, at no drafting cost (priced as the paying drafter, a lookup's
draft would be held to the length a draft model can pay for).

A later drafter may also take a row from an earlier one: where the earlier draft rests on a match
shorter than the later drafter's `lookup_yields_below` (a 1-token n-gram match ahead of a head), the
later one drafts the row if it has a budget there and a draft to give; the earlier draft stays
otherwise, so a row the paying drafter does not draft for still verifies the lookup's.

On a GPU the lookup also has a device twin (`lookup`, DeviceNgramDrafter, factory.lookup_twin),
which hears every sequence's life too. Its graph step is the chain's: where the paying drafter
would draft for no row, the runner's captured step drafts the twin's rows (as n-gram alone would)
and verifies them itself, and the step after it may be launched ahead (GraphStep). Where the
paying drafter is a head with a graph step of its own (HeadGraphStep), the chain's graph step
holds both (ChainGraphStep): each row takes the lookup's draft or the head's chain by the rule
above, on the device, so no step of the chain drafts on the host. A step in which another paying
drafter (a draft model) drafts runs the chain on the host.
"""
from __future__ import annotations

from typing import Sequence

import torch

from outpace.kernels.fused import cuda_compiled, has_conditional_nodes
from outpace.speculative import ngram_gpu
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
            # rows without a draft, and those whose draft rests on a match too short to beat d's
            pending = [i for i, r in enumerate(rows) if limit[i] > 0 and (not r or match[i] < d.lookup_yields_below)]
            if not pending:
                continue
            sub = batch.subset(pending)
            sub.budget = [limit[i] for i in pending]
            drafts = d.propose(sub)
            for i, tokens, m in zip(pending, drafts.host_rows(), drafts.match_len or [0] * len(pending)):
                if tokens or not rows[i]:
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

    def reusable_prefix(self, seq_id, slot):
        bounds = [b for b in (d.reusable_prefix(seq_id, slot) for d in self.members) if b is not None]
        return min(bounds, default=None)

    def shareable_prefix(self, source_id, seq_id):
        bounds = [b for b in (d.shareable_prefix(source_id, seq_id) for d in self.members) if b is not None]
        return min(bounds, default=None)

    def copy_prefix(self, source_id, source_slot, seq_id, slot, length):
        for d in self.members:
            d.copy_prefix(source_id, source_slot, seq_id, slot, length)

    def setup_seconds(self, seq_ids):
        """What the drafters that have a setup charge together (a row the lookup drafts for pays
        none this step, but would pay it the first time the model drafts for it)."""
        setups = [s for s in (d.setup_seconds(seq_ids) for d in self.drafters) if s is not None]
        return [sum(parts) for parts in zip(*setups)] if setups else None

    def cost_per_token(self, batch_size):
        return max(d.cost_per_token(batch_size) for d in self.drafters)

    def step_cost(self, batch_size):
        return max(d.step_cost(batch_size) for d in self.drafters)

    def graph_step(self, max_rows, max_tokens):
        """The lookup's device twin's part of the runner's graph step, where there is one, with
        the paying drafter's where it has one (ChainGraphStep)."""
        if self.lookup is None:
            return None
        lookup = self.lookup.graph_step(max_rows, max_tokens)
        paying = [d for d in self.drafters if not d.priced_after_drafting]
        step = paying[0].graph_step(max_rows, max_tokens) if len(paying) == 1 else None
        return lookup if step is None else ChainGraphStep(lookup, step, paying[0].lookup_yields_below)


# the deepest chain a head drafts inside a chain's graph step: a captured step drafts that deep
# whatever its rows need (where the graph cannot skip depths, fused.only_if). On the H200 the
# chain with its head 2 deep gave 1.86x plain against 1.78x 3 deep in the same session, at about
# the same acceptance (2.84 and 2.87 tokens a step): the third draft, right 28-31% of the times it
# was reached, did not pay for the head forward every step ran for it (docs/BENCHMARKS.md,
# "GPU: EAGLE-3 head")
CHAIN_HEAD_DEPTH = 2


class ChainGraphStep:
    """The runner's graph step of a chain whose lookup twin (ngram_device.GraphDrafting) and
    paying drafter (a head's HeadGraphStep) both draft inside it: before the forward, a row takes
    the lookup's draft where it has one (up to its room) from a match of at least `yields_below`
    tokens or where the head has no room for the row, and the head's chain (up to its room, paid,
    at most max_paid) where the head has room; after it, the twin's greedy verification and
    append. The head's chain is max_paid deep at most; where the graph can hold conditional
    nodes (fused.only_if) it runs only as deep as its rows' rooms reach, and not at all in a step
    where every row takes the lookup's draft.
    Host inputs [4, rows]: the twin's three (row to draft from, row to append to, room), then the
    head's room."""

    max_paid = CHAIN_HEAD_DEPTH     # GraphStep: the paying drafter drafts in this step, this many at most

    def __init__(self, lookup, head, yields_below: int):
        self.lookup, self.head, self.yields_below = lookup, head, yields_below
        # probed before the runner captures its graphs: whether the head's depths can be skipped
        conditional = lookup.drafter.device.type == "cuda" and has_conditional_nodes(lookup.drafter.device)
        self.cost_key = f"chain {self.max_paid} {yields_below} {conditional} {lookup.cost_key} {head.cost_key}"
        self.width = lookup.width + head.width
        self.result = lookup.result
        self.inputs_view: torch.Tensor | None = None

    def inputs(self, seq_ids, room, claim=None, paid=None) -> list[tuple[int, ...]]:
        """Per row: the twin's inputs for `room` (its lookup's lengths) and the head's room, paid
        (none where not given)."""
        paid = paid or [0] * len(seq_ids)
        return [a + b for a, b in zip(self.lookup.inputs(seq_ids, room, claim), self.head.inputs(seq_ids, paid))]

    def has_row(self, seq_id: int) -> bool:
        return self.lookup.has_row(seq_id)

    def bind(self, inputs: torch.Tensor, starts: torch.Tensor) -> None:
        self.inputs_view = view = inputs.view(self.width, -1)
        self.lookup.bind(view[:self.lookup.width], starts)
        self.head.bind(view[self.lookup.width:], starts)

    def neutral(self) -> tuple[int, ...]:
        return self.lookup.neutral() + self.head.neutral()

    def before(self, b: int, t: int, input_ids: torch.Tensor) -> None:
        d, num_draft = self.lookup.drafter, self.lookup.num_draft[:b]
        d.lengths[d.scratch:].zero_()                   # the scratch row restarts empty every step
        if t == 1:
            num_draft.zero_()
            return
        src, room, paid = self.inputs_view[0, :b], self.inputs_view[2, :b], self.inputs_view[3, :b]
        draft, num, by_lookup = _lookup_rows(src, d.tokens, d.lengths, room, paid, t - 1, d.min_ngram, d.max_ngram,
                                             d.match, self.yields_below)
        by_head = ~by_lookup & (paid > 0)
        chains = self.head.drafts[:b, :t - 1]         # past the chain's depth: unused (paid is within it)
        self.head.graphs.chain(b, min(t - 1, self.max_paid), self.head.starts[:b], by_head[:, None], chains, paid)
        _choose(input_ids, draft, num, by_lookup, chains, by_head, paid, num_draft)

    def after(self, b: int, t: int, input_ids: torch.Tensor, logits: torch.Tensor) -> None:
        self.lookup.after(b, t, input_ids, logits)


@cuda_compiled
def _lookup_rows(src, tokens, lengths, room, paid, K: int, min_ngram: int, max_ngram: int, match: str,
                 yields_below: int):
    """The lookup's drafts [b, K] and lengths [b] (within room) from buffer rows src, and the rows
    that take them: a draft from a match of yields_below tokens or more, or any draft where the
    paying drafter has no room."""
    draft, num, matched = ngram_gpu.propose_matched(tokens, lengths, src, K, min_ngram, max_ngram, match)
    num = torch.minimum(num, room)
    return draft, num, (num > 0) & ((matched >= yields_below) | (paid == 0))


@cuda_compiled
def _choose(input_ids, draft, num, by_lookup, chains, by_head, paid, num_draft) -> None:
    """Each row's draft into input_ids[:, 1:] and its length into num_draft: the lookup's, the
    head's chain, or none (what the host wrote stays)."""
    K = input_ids.shape[1] - 1
    num_draft.copy_(torch.where(by_lookup, num, torch.where(by_head, paid.clamp(max=K), 0)))
    input_ids[:, 1:] = torch.where(by_lookup[:, None], draft, torch.where(by_head[:, None], chains, input_ids[:, 1:]))
