"""GraphStep: the step on a CUDA graph runner (runner/cuda_graphs.py).

Beyond EagerStep it does two things captured graphs make possible:
  - a greedy step whose rows fit a captured shape is drafted, verified and appended to the
    drafter's device state inside the graph (the drafter's graph_step, bound into the runner as
    its extension), replacing some forty small launches from the host;
  - overlap: once a greedy graph step is queued, the step after it is launched before the host
    reads the first one's tokens (each row's start and last token derived on the device from the
    first step's result), so the GPU never idles while the host reads and accepts a step. A
    step is launched ahead without drafts: where a drafter outside the graph (a head, a draft
    model, a chain whose lookup drafts first) would draft the next step, none is launched; a
    head catches up on a plain step's hidden states before its successor overwrites them. A
    chain whose lookup has a device twin (DrafterChain.lookup) drafts in the graph, launched
    ahead or not, wherever its paying drafter would draft for no row, and everywhere where that
    drafter drafts in the graph too (a head: chain.ChainGraphStep).
A launched step holds the same rows as the step before it; the next engine step reads it
(resume) instead of scheduling. Rows whose sequence ended meanwhile are dropped, tokens and all.
"""
from __future__ import annotations

import time

import torch

from outpace.engine.scheduler import PrefillChunk, Scheduler, StepPlan
from outpace.engine.sequence import Sequence
from outpace.engine.step import (EagerStep, Launched, Proposal, StepResult, asks_logprobs, shapes_logits,
                                 speculating_rows, step_logprobs)
from outpace.runner.cuda_graphs import CudaGraphRunner
from outpace.runner.model_runner import Row
from outpace.runner.staging import slot_rows, to_device
from outpace.speculative.drafter import Verified


class GraphStep(EagerStep):
    def __init__(self, runner: CudaGraphRunner, *args, scheduler: Scheduler, overlap: bool):
        super().__init__(runner, *args)
        self.extension = runner.extension           # the drafter's part of every graph, or None
        self.scheduler = scheduler
        self.overlap = overlap
        self._read_at = 0.0                         # when the host last read a graph step's tokens

    # ---- propose ------------------------------------------------------------------------------
    def propose(self, plan: StepPlan) -> Proposal:
        if plan.launched is not None:               # drafted in its graph already
            return Proposal(plan.launched.budget, in_graph=True)
        return super().propose(plan)

    def _draft(self, seqs: list[Sequence], budget: list[int], room: list[int], tree_width: int = 0) -> Proposal:
        """The graph drafts and verifies itself where the rows are greedy and a captured shape
        holds them; elsewhere the drafter drafts on the device (EagerStep). A chain whose lookup
        has a graph step (DrafterChain.lookup) drafts in the graph at the lookup's own lengths,
        and its paying drafter's (budget) where that drafts inside the graph too (a head:
        ChainGraphStep); where it does not and would draft for some row, the chain drafts on the
        host."""
        # an extension that drafts trees drafts nothing else: a step asked for chains drafts them
        # outside the graph (the engine's controller asks such a head for trees alone)
        trees = getattr(self.extension, "trees", False)
        trees_only = trees and tree_width == 1
        # the graph's steps read their tokens, and the logprobs of a chain's positions from its
        # logits: rows whose logits are shaped, or that ask for logprobs of a tree, verify outside it
        in_graph = (all(s.params.is_greedy for s in seqs) and not shapes_logits(seqs)
                    and not (trees and asks_logprobs(seqs)))
        if self.extension is not None and not trees_only and in_graph:
            lookup, paid = self._chain_lengths(seqs, budget, room) if self.drafter.uses_room else (budget, None)
            if lookup is None:
                return super()._draft(seqs, budget, room, tree_width)
            widths = lookup if paid is None else [max(a, b) for a, b in zip(lookup, paid)]
            rows = [Row(s.slot, [0], len(s.token_ids) - 1) for s in seqs]
            if self.runner.shape_for(rows, max(widths)) is not None:
                # every speculating sequence takes its buffer row now, drafting or not: a launched
                # step cannot take one (the host lacks the tokens of the step before it)
                inputs = self._inputs(seqs, lookup, paid, [s.speculate for s in seqs])
                return Proposal(widths, in_graph=True, graph_inputs=inputs)
        return super()._draft(seqs, budget, room, tree_width)

    def _chain_lengths(self, seqs: list[Sequence], paid: list[int], room: list[int]):
        """A chain's lengths in the graph: (its lookup's, its paying drafter's, at most what the
        graph step drafts for it, or None where it drafts for no row), or (None, None) where the
        paying drafter drafts outside the graph."""
        limit = self.extension.max_paid
        if any(paid) and not limit:
            return None, None
        lookup = [min(r, k) for r, k in zip(room, self.lengths(seqs, paid=False))]
        return lookup, [min(k, limit) for k in paid] if any(paid) else None

    def _inputs(self, seqs: list[Sequence], lengths: list[int], paid: list[int] | None,
                claim: list[bool] | None = None) -> list[tuple]:
        """The graph step's host inputs per row: drafting up to lengths (a chain's lookup), and
        the paying drafter's lengths where it drafts in the graph too."""
        ids = [s.seq_id for s in seqs]
        if paid is None:
            return self.extension.inputs(ids, lengths, claim)
        return self.extension.inputs(ids, lengths, claim, paid)

    # ---- verify -------------------------------------------------------------------------------
    def verify(self, plan: StepPlan, proposal: Proposal, chunks: list[PrefillChunk]) -> StepResult:
        t0 = time.perf_counter()
        if plan.launched is not None:
            launched = plan.launched
            read_before = self._read_at
            result = self._read_back(plan.decode, proposal.budget, launched.shape, t0,
                                     may_launch=len(plan.decode) == launched.num_rows)
            # what a launched step costs is the time between two reads, the longer of the device's
            # step and the host's loop; the host's work on the tokens overlaps the device's
            result.period = self._read_at - read_before
            result.step_rows, result.step_tokens = launched.num_rows, launched.num_rows * launched.shape[1]
            return result
        if proposal.in_graph:
            seqs = plan.decode
            self.runner.forward(self._last_rows(seqs), step_inputs=proposal.graph_inputs,
                                num_device_tokens=max(proposal.budget))
            return self._read_back(seqs, proposal.budget, self.runner.last_shape, t0)
        return super().verify(plan, proposal, chunks)

    def _plain_greedy(self, seqs, logits, hidden, t0) -> StepResult:
        """A plain greedy step a graph ran is read like any graph step (its successor launched
        first where it may be); the drafter's device state needs no append where nobody drafts.
        A drafter that reads hidden states (a head) catches up on them in _read_back."""
        if self.runner.last_shape is not None and (self.extension is None or not any(s.speculate for s in seqs)):
            return self._read_back(seqs, [0] * len(seqs), self.runner.last_shape, t0)
        return super()._plain_greedy(seqs, logits, hidden, t0)

    def _catch_up(self, seqs: list[Sequence], budget: list[int], shape: tuple[int, int, int], result) -> None:
        """A graph step's outcome (result: step_result's rows [tokens out, tokens drafted, target
        tokens]) for a drafter that reads hidden states, its rows' tokens and hidden states taken
        from the graph rows (views of the runner's buffers where the rows are slots 0..), for the
        drafter to copy before a launched step overwrites them.
        A drafted step's rows hold the target's token at every position, which at an accepted
        one is the draft's."""
        heard = speculating_rows(seqs)
        seqs, budget = [seqs[i] for i in heard], [budget[i] for i in heard]
        index = slot_rows([s.slot for s in seqs], result.device)
        rows = result[index]
        tokens = rows[:, 2:2 + shape[1]]
        hidden = self.runner.step_hidden(shape)[index]
        self.drafter.verified_in_graph(Verified(self._draft_batch(seqs, budget), tokens, rows[:, 0], hidden))

    def _read_back(self, seqs: list[Sequence], budget: list[int], shape: tuple[int, int, int], t0: float,
                   may_launch: bool = True) -> StepResult:
        """A greedy graph step's result rows, read with the step's one host synchronisation. With
        overlap the next step is launched first, so the device works on it while the host reads
        this one and accepts its tokens."""
        runner = self.runner
        result = runner.step_result(shape)
        runner.start_read(result)
        # the logprobs of a chain's positions from the step's logits and target tokens (by graph
        # row: slot), queued before a step launched ahead overwrites the logits
        scores = step_logprobs(seqs, runner.step_logits(shape), result[:, 2:2 + shape[1]], by_slot=True)
        if self.drafter.hidden_layers and speculating_rows(seqs):
            self._catch_up(seqs, budget, shape, result)
        if may_launch and self.overlap:
            self.launched = self._launch_next(seqs, shape, result)
        host = runner.read_back()                       # the step's one host synchronisation
        self._read_at = time.perf_counter()
        return self._result(seqs, [host[s.slot] for s in seqs], budget, t0, scores=scores)

    # ---- overlap ------------------------------------------------------------------------------
    def _launch_next(self, seqs: list[Sequence], shape: tuple[int, int, int], result):
        """Launch the step after a greedy graph step whose tokens are not read yet, when that step
        holds the same rows (no request waits for a free slot, no prompt is being cached) and
        every row's positions, however many tokens the step being read adds, stay in the context.
        Rows draft up to what they have room for after that many tokens."""
        scheduler = self.scheduler
        if (scheduler.waiting and scheduler.free_slots) or len(scheduler.running) != len(seqs):
            return None
        ahead = shape[1]                                # the most tokens the step being read adds to a row
        speculating = any(s.speculate for s in seqs)
        drafts = speculating and self.extension is not None
        lengths, paid = self.lengths(seqs), None
        if speculating and self.drafter.uses_room:
            # a chain: where its lookup has no graph step (its free rows draft whatever the
            # controller's length), or its paying drafter drafts the next step outside the graph,
            # that step is proposed, not launched; otherwise it drafts in the graph
            if not drafts:
                return None
            lengths, paid = self._chain_lengths(seqs, lengths, [self.budget_for(s, ahead) for s in seqs])
            if lengths is None:
                return None
        elif speculating and not drafts and any(lengths):
            # a drafter outside the graph drafts the next step: it is proposed, not launched
            return None
        # a launched step cannot take a buffer row: only rows that have one draft (the paying
        # drafter's graph step zeroes its rows that cannot draft yet)
        budget = [min(k, self.budget_for(s, ahead)) if drafts and self.extension.has_row(s.seq_id) else 0
                  for s, k in zip(seqs, lengths)]
        if paid is not None:
            paid = [min(k, self.budget_for(s, ahead)) for s, k in zip(seqs, paid)]
        widths = budget if paid is None else [max(a, b) for a, b in zip(budget, paid)]
        rows = [Row(s.slot, [0], len(s.token_ids) - 1 + ahead) for s in seqs]     # starts, at the most
        if max(r.start for r in rows) + 1 + max(widths) > self.max_model_len:
            return None
        next_shape = self.runner.shape_for(rows, max(widths))
        if next_shape is None or next_shape[0] != shape[0]:
            return None
        slots = {s.slot for s in seqs}
        active = to_device([int(r in slots) for r in range(shape[0])], result.device)
        inputs = self._inputs(seqs, budget, paid) if drafts else None
        self.runner.replay_next(result, active, next_shape, rows, inputs)
        return Launched(seqs, widths, next_shape, len(seqs))

    def resume(self) -> StepPlan | None:
        """The step launched ahead, as a plan of its rows whose sequences still run."""
        launched, self.launched = self.launched, None
        if launched is None or all(s.is_finished for s in launched.seqs):
            return None
        live = [i for i, s in enumerate(launched.seqs) if not s.is_finished]
        seqs = [launched.seqs[i] for i in live]
        return StepPlan(decode=seqs, launched=Launched(seqs, [launched.budget[i] for i in live], launched.shape,
                                                       launched.num_rows))

    def drop_launched(self) -> None:
        if self.launched is not None and all(s.is_finished for s in self.launched.seqs):
            self.launched = None                        # nobody reads it; the device finishes it unread
