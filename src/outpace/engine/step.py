"""How a step proposes and verifies: one interface, two implementations chosen at construction.

EagerStep: rows built on the host and run through runner.forward (the CPU, and CUDA steps no graph
holds); the drafter's propose gives the drafts; verification is batched tensor math whose result
reaches the host at the step's one synchronisation. GraphStep (runner/cuda_graphs.py's runner)
adds what captured CUDA graphs make possible: greedy steps whose drafts the graph makes and
verifies itself (the drafter's graph_step), and overlap, a greedy step launched before the host
has read the step before it.

propose gives a Proposal, verify a StepResult; what a step cost (for the draft controller) travels
with the result, so the engine's step reads the same whatever ran it.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from outpace.engine.scheduler import PrefillChunk, StepPlan
from outpace.engine.sequence import Sequence
from outpace.runner.model_runner import ModelRunner, Row
from outpace.sampling.logprobs import Logprob, StepLogprobs
from outpace.sampling.penalties import ShapingColumns, chain_before, shaped, tree_before
from outpace.sampling.rejection import greedy_tokens, verify_greedy, verify_sampling
from outpace.sampling.sampler import SamplingState, inverse_cdf, logits_to_probs
from outpace.sampling.tree import tree_ancestors, tree_depths, verify_tree
from outpace.speculative.controller import DraftController
from outpace.speculative.drafter import DraftBatch, Drafter, Drafts, Verified


@dataclass
class Proposal:
    """What a step verifies: budget[i] is the most drafted tokens row i verifies (0: a plain row).
    drafts: the drafter's (None: no row drafts); in_graph: the runner's graph step drafts for the
    rows itself (GraphStep), drafts None, with graph_inputs its host inputs per row (None for a
    step launched ahead: sent at its launch). draft_s: the host's seconds proposing (on the CPU the
    drafter's work; on a GPU little more than its launches). tree_width: the width of the token
    trees the drafter was asked for (1: chains; 0: none asked)."""

    budget: list[int]
    drafts: Drafts | None = None
    in_graph: bool = False
    graph_inputs: list[tuple] | None = None
    draft_s: float = 0.0
    tree_width: int = 0

    @property
    def paid_tokens(self) -> int:
        """Drafted tokens the step verifies whose drafting the drafter prices (all but a chain's
        free lookup rows; none where the graph drafted: a lookup)."""
        if self.in_graph:
            return 0
        free = self.drafts.free if self.drafts is not None and self.drafts.free else [False] * len(self.budget)
        return sum(n for n, f in zip(self.budget, free) if not f)

    @property
    def match_len(self) -> list[int]:
        if self.drafts is None or self.drafts.match_len is None:
            return [0] * len(self.budget)
        return self.drafts.match_len


@dataclass
class StepResult:
    """A step's outcome on the host: tokens[i] to append to row i (accepted drafts then the
    target's own), num_draft[i] drafted tokens verified. step_rows, step_tokens: the step's size
    as the runner laid it out (the controller fits costs by it). period: for a step launched
    ahead, its cost, the time between two reads (None: the engine times the step itself).
    logprobs[i]: one {token: Logprob} per token of tokens[i] where row i's request asks for them
    (SamplingParams.logprobs), else None; None where no row asks."""

    tokens: list[list[int]]
    num_draft: list[int]
    step_rows: int
    step_tokens: int
    period: float | None = None
    logprobs: list[list[dict[int, Logprob]] | None] | None = None

    @property
    def counts(self) -> list[int]:
        return [len(t) for t in self.tokens]


@dataclass
class Launched:
    """A greedy graph step queued on the device whose tokens the host has not read yet (overlap):
    its rows' sequences (those still running, when resumed) and the most each may verify."""

    seqs: list[Sequence]
    budget: list[int]
    shape: tuple[int, int, int]         # its graph shape (batch bucket, tokens per row, key length)
    num_rows: int                       # the rows it was launched with


class EagerStep:
    overlap = False         # whether a step may be launched before the host reads the one before (GraphStep)

    def __init__(self, runner: ModelRunner, drafter: Drafter, controller: DraftController, max_model_len: int,
                 num_draft_tokens: int):
        self.runner, self.drafter, self.controller = runner, drafter, controller
        self.max_model_len = max_model_len
        self.num_draft_tokens = num_draft_tokens        # 0: speculation off
        self.launched: Launched | None = None           # GraphStep's overlap; never set here
        self.said: set[str] = set()                     # the malformed drafts said on stderr (_cut_malformed)

    # ---- propose ------------------------------------------------------------------------------
    def budget_for(self, seq: Sequence, ahead: int = 0) -> int:
        """The most tokens a sequence may draft: its verify step must stay within max_tokens and
        the context (ahead: tokens a step not read yet adds first)."""
        if not seq.speculate:
            return 0
        return max(0, min(self.num_draft_tokens, seq.params.max_tokens - seq.num_output_tokens - ahead - 1,
                          self.max_model_len - len(seq.token_ids) - ahead - 1))

    def propose(self, plan: StepPlan) -> Proposal:
        """Drafts for the plan's decoding rows, each at most what its budget allows."""
        seqs = plan.decode
        if not self.num_draft_tokens or not any(s.speculate for s in seqs):
            return Proposal([0] * len(seqs))
        t0 = time.perf_counter()
        room = budget = [self.budget_for(s) for s in seqs]
        if not self.drafter.priced_after_drafting:
            # drafts the host never sees: the controller's lengths are given up front
            budget = [min(r, k) for r, k in zip(room, self.lengths(seqs, load=plan.load))]
        # a tree drafter drafts trees or chains, whichever the controller measured to pay
        width = self.controller.step_tree_width(len(seqs))
        proposal = self._draft(seqs, budget, room, width)
        proposal.draft_s = time.perf_counter() - t0
        proposal.tree_width = width
        self._charge(seqs, "draft_s", proposal.draft_s)
        return proposal

    def lengths(self, seqs: list[Sequence], paid: bool = True, load: int = 0) -> list[int]:
        """The controller's draft length for each row, decided before drafting (a drafter that
        pays per drafted token): 0 for a plain row and for one whose setup (the drafter's
        setup_seconds) drafting would not repay over the tokens the row has left, in a batch of
        `load` rows where more sequences run than decode now (StepPlan.load). paid False: drafts
        that cost the drafter nothing and need no setup (a chain's lookup in the graph)."""
        spec = [s for s in seqs if s.speculate]
        if not spec:
            return [0] * len(seqs)
        ids = [s.seq_id for s in spec]
        setup = self.drafter.setup_seconds(ids) if paid else None
        remaining = None if setup is None else [
            self.controller.remaining(s.num_output_tokens, s.params.max_tokens - s.num_output_tokens) for s in spec]
        lengths = iter(self.controller.row_lengths(ids, len(seqs), setup, remaining, paid, load))
        return [next(lengths) if s.speculate else 0 for s in seqs]

    def _draft(self, seqs: list[Sequence], budget: list[int], room: list[int], tree_width: int = 0) -> Proposal:
        """The drafter drafts within budget (a drafter that uses the room: its free rows within
        room). Where it knew its drafts' lengths while drafting, the controller then weighs the
        drafts that exist (their lengths and match lengths) and cuts them; a row verifies nothing
        where it drafts nothing, so its estimates relax toward their priors."""
        if not self.drafter.uses_room:
            room = budget
        if not any(room):
            return Proposal([0] * len(seqs))
        drafts = self.drafter.propose(self._draft_batch(seqs, budget, room, tree_width))
        if self.drafter.priced_after_drafting:
            return self._cut(seqs, [0] * len(seqs), drafts, [i for i, r in enumerate(budget) if r > 0])
        if drafts.free:         # a chain's lookup rows, drafted past the controller's length: no drafting cost
            return self._cut(seqs, budget, drafts, [i for i, f in enumerate(drafts.free) if f], paid=False)
        return Proposal(budget, drafts)

    def _cut(self, seqs: list[Sequence], budget: list[int], drafts: Drafts, rows: list[int],
             paid: bool = True) -> Proposal:
        """The controller weighs the drafts of `rows` as they are (lengths, match lengths; paid
        False: at no drafting cost) and cuts them; the other rows keep their budget."""
        match = drafts.match_len or [0] * len(seqs)
        lengths = self.controller.draft_lengths([seqs[i].seq_id for i in rows], len(seqs),
                                                [drafts.num_draft_host[i] for i in rows],
                                                [match[i] for i in rows], paid)
        budget = list(budget)
        for i, n in zip(rows, lengths):
            budget[i] = n
        return Proposal(budget, drafts.truncated(budget)) if any(budget) else Proposal(budget)

    @staticmethod
    def _draft_batch(seqs: list[Sequence], budget: list[int], room: list[int] | None = None,
                     tree_width: int = 0) -> DraftBatch:
        return DraftBatch([s.seq_id for s in seqs], list(budget), [s.slot for s in seqs],
                          [len(s.token_ids) - 1 for s in seqs], [s.params for s in seqs], [s.seed for s in seqs],
                          [s.num_output_tokens for s in seqs], list(room) if room is not None else [], tree_width)

    # ---- verify -------------------------------------------------------------------------------
    def verify(self, plan: StepPlan, proposal: Proposal, chunks: list[PrefillChunk]) -> StepResult:
        """One target forward over [last token + draft] of every decoding sequence (and, on a
        packing runner, the step's prompt chunks), then the acceptance rule (greedy or rejection
        sampling) as batched tensor math, read on the host with the step's one synchronisation."""
        seqs, drafts = plan.decode, proposal.drafts
        t0 = time.perf_counter()
        if drafts is not None and drafts.parents is not None:
            return self._verify_tree(seqs, proposal, chunks, t0)
        greedy = all(s.params.is_greedy for s in seqs)
        # greedy rows' argmax alone, unless a row's logits are shaped, or read (logprobs) where the
        # runner returns the argmax alone (a graph runner returns the logits whole all the same)
        picks = greedy and not shapes_logits(seqs) and (self.runner.greedy_logits == "all"
                                                         or not asks_logprobs(seqs))
        hidden_layers = self.drafter.hidden_layers
        if drafts is not None and drafts.num_draft_host is None:
            # drafts on the device never visit the host: the runner appends them to each row's last token
            logits, hidden = self.runner.forward(self._last_rows(seqs), hidden_layers=hidden_layers,
                                                 draft_tokens=drafts.tokens)                     # [B, S, V]
        else:
            host = [[] for _ in seqs]
            if drafts is not None:
                drafts, host = self._in_vocabulary(drafts)
                proposal.drafts = drafts
            rows = [Row(s.slot, s.token_ids[-1:] + d, len(s.token_ids) - 1) for s, d in zip(seqs, host)]
            # [B, S, V], or for greedy rows on the CPU their argmax [B, S]
            logits, hidden = self.runner.forward(rows, self.runner.greedy_logits if picks else "all",
                                                 hidden_layers, chunks=chunk_rows(chunks))
        K = logits.shape[1] - 1
        if K == 0 and picks:
            return self._plain_greedy(seqs, logits, hidden, t0)
        if picks and drafts is not None and logits.dim() == 2 and logits.device.type == "cpu":
            return self._greedy_on_host(seqs, proposal.budget, logits, host, hidden, t0)
        if drafts is None:
            draft_tokens = logits.new_zeros((len(seqs), K), dtype=torch.long)
            num_draft = logits.new_zeros(len(seqs), dtype=torch.long)
        else:       # exact mode pads S beyond the drafts
            draft_tokens = F.pad(drafts.tokens, (0, K - drafts.tokens.shape[1])).to(logits.device, non_blocking=True)
            num_draft = drafts.num_draft.to(logits.device, non_blocking=True)
        picked_from = shape(seqs, logits, draft_tokens, lambda: chain_before(num_draft, K + 1, K))
        if greedy:
            out, num_out = verify_greedy(picked_from, draft_tokens, num_draft)
        else:
            state = SamplingState.from_params([s.params for s in seqs], [s.seed for s in seqs],
                                              [s.num_output_tokens for s in seqs], logits.device)
            out, num_out = verify_sampling(picked_from, draft_tokens, num_draft, state)
        scores = step_logprobs(seqs, logits, out)       # the model's own distribution: before shaping
        # a recurrent model's state becomes the one after each row's last accepted token
        self.runner.cache.commit([s.slot for s in seqs], num_out - 1)
        self._tell_verified(seqs, proposal.budget, out, num_out, hidden)
        # the one host synchronisation of the step: accepted tokens return to the scheduler
        host = torch.cat([num_out[:, None], num_draft[:, None], out], dim=1).tolist()
        return self._result(seqs, host, proposal.budget, t0, scores=scores)

    def _greedy_on_host(self, seqs: list[Sequence], budget: list[int], picks: torch.Tensor, drafted: list[list[int]],
                        hidden: torch.Tensor | None, t0: float) -> StepResult:
        """verify_greedy's rule where the CPU runner made the picks (tokens [B, S] on the host) and
        the host holds the drafts: a step's few tokens compared in Python, where each tensor op of
        the batched rule costs more than the comparisons."""
        rows = picks.tolist()
        num_out = []
        for row, draft in zip(rows, drafted):
            n = 0
            while n < len(draft) and draft[n] == row[n]:
                n += 1
            num_out.append(n + 1)
        accepted = torch.tensor(num_out)
        self.runner.cache.commit([s.slot for s in seqs], accepted - 1)
        self._tell_verified(seqs, budget, picks, accepted, hidden)
        return self._result(seqs, [[n, len(d), *row] for n, d, row in zip(num_out, drafted, rows)], budget, t0)

    def _verify_tree(self, seqs: list[Sequence], proposal: Proposal, chunks: list[PrefillChunk],
                     t0: float) -> StepResult:
        """verify() for token trees (drafts with parents, lengths on the host): one forward with
        the tree's mask (the step's prompt chunks in a forward of their own before it), the
        longest path of the target's own tokens (sampling/tree.py), and the path's keys and
        values moved to consecutive positions."""
        drafts, nodes = self._in_vocabulary(proposal.drafts)
        drafts, parents = self._whole_trees(drafts)
        proposal.drafts = drafts
        nodes = [row[:n] for row, n in zip(nodes, drafts.num_draft_host)]
        if chunks:
            self.runner.forward(chunk_rows(chunks), logits="none")
        rows = [Row(s.slot, s.token_ids[-1:] + d, len(s.token_ids) - 1) for s, d in zip(seqs, nodes)]
        greedy = all(s.params.is_greedy for s in seqs)
        picks = greedy and not needs_logits(seqs)
        logits, hidden = self.runner.forward_tree(rows, parents, "tokens" if picks else "all",
                                                  self.drafter.hidden_layers)             # [B, S] or [B, S, V]
        K = logits.shape[1] - 1
        device = logits.device
        tokens = F.pad(drafts.tokens, (0, K - drafts.tokens.shape[1])).to(device)
        tree = F.pad(drafts.parents, (0, K - drafts.parents.shape[1]), value=-1).to(device)
        num_draft = drafts.num_draft.to(device)
        full = None if picks else logits
        if not picks:       # a node is shaped after its path's tokens
            logits = shape(seqs, logits, tokens, lambda: tree_before(tree_ancestors(tree, K), num_draft))
        if greedy and not picks:
            logits = greedy_tokens(logits)
        elif not greedy:
            # every node of one depth shares that output position's u: the sample plain sampling
            # would draw there after the node's path
            state = SamplingState.from_params([s.params for s in seqs], [s.seed for s in seqs],
                                              [s.num_output_tokens for s in seqs], device)
            depth = torch.tensor([tree_depths(p, K) for p in parents], device=device)     # [B, S]
            logits = inverse_cdf(logits_to_probs(logits, state), state.uniforms(K + 1).gather(1, depth))
        out, num_out, path = verify_tree(logits, tokens, tree, num_draft)
        # the path's entries into consecutive positions: depth d's node to start + d
        starts = torch.tensor([len(s.token_ids) - 1 for s in seqs], device=device)[:, None]
        slots = torch.tensor([s.slot for s in seqs], device=device)[:, None].expand(-1, K)
        depth = torch.arange(1, K + 1, device=device)[None, :]
        moved = depth < num_out[:, None]
        self.runner.cache.compact(slots.flatten(), (starts + torch.where(moved, path, depth)).flatten(),
                                  (starts + depth).flatten())
        order = torch.cat([torch.zeros_like(path[:, :1]), path], dim=1)     # the accepted positions in path order
        if hidden is not None:
            hidden = hidden.gather(1, order.view(*order.shape, *[1] * (hidden.dim() - 2)).expand_as(hidden))
        scores = None if full is None else step_logprobs(seqs, full.gather(1, order[..., None].expand_as(full)), out)
        self._tell_verified(seqs, proposal.budget, out, num_out, hidden)
        host = torch.cat([num_out[:, None], num_draft[:, None], out], dim=1).tolist()   # the step's one sync
        return self._result(seqs, host, proposal.budget, t0, scores=scores)

    # A drafter's malformed draft may cost its tokens, never the output: each row is cut before
    # its first bad token, and the first of each kind is said on stderr.
    def _in_vocabulary(self, drafts: Drafts) -> tuple[Drafts, list[list[int]]]:
        """The drafts (host lengths known) cut before each row's first id outside the target's
        vocabulary, which no forward could embed, and their rows as host lists."""
        vocab = self.runner.model.cfg.vocab_size
        rows = drafts.host_rows()
        kept = [next((j for j, t in enumerate(row) if not 0 <= t < vocab), len(row)) for row in rows]
        cut = self._cut_malformed(drafts, kept, f"token ids outside the target's vocabulary (0 .. {vocab - 1})")
        return cut, [row[:n] for row, n in zip(rows, kept)]

    def _whole_trees(self, drafts: Drafts) -> tuple[Drafts, list[list[int]]]:
        """The drafts cut before each row's first tree node whose parent is not an earlier node
        or -1 (the row's last token): such a node has no path, and verifying it would read keys no
        path holds. Also each row's parents as a host list, as far as the row was kept."""
        parents = drafts.parents.tolist()
        kept = [next((j for j, p in enumerate(row[:n]) if not -1 <= p < j), n)
                for row, n in zip(parents, drafts.num_draft_host)]
        cut = self._cut_malformed(drafts, kept, "a token tree with a node whose parent is not an earlier node or -1")
        return cut, [row[:n] for row, n in zip(parents, kept)]

    def _cut_malformed(self, drafts: Drafts, kept: list[int], what: str) -> Drafts:
        if kept == list(drafts.num_draft_host):
            return drafts
        if what not in self.said:
            self.said.add(what)
            print(f"outpace: the drafter ({type(self.drafter).__name__}) proposed {what}; each such draft is "
                  "verified up to there", file=sys.stderr)
        return drafts.truncated(kept)

    def _plain_greedy(self, seqs: list[Sequence], logits: torch.Tensor, hidden: torch.Tensor | None,
                      t0: float) -> StepResult:
        """A step without drafts whose rows are all greedy (logits [B, 1, V], or their argmax
        [B, 1]; whole where a row asks for logprobs): each row's argmax is its one token, nothing
        to check."""
        tokens = greedy_tokens(logits)
        scores = step_logprobs(seqs, logits, tokens)
        self._tell_verified(seqs, [0] * len(seqs), tokens, torch.ones_like(tokens[:, 0]), hidden)
        host = tokens.tolist()                          # the step's one host synchronisation
        return self._result(seqs, [[1, 0, t] for (t,) in host], [0] * len(seqs), t0, scores=scores)

    def _tell_verified(self, seqs: list[Sequence], budget: list[int], out: torch.Tensor, num_out: torch.Tensor,
                       hidden: torch.Tensor | None) -> None:
        """drafter.verified with the step's outcome (out [B, S], num_out [B], hidden [B, S, ...])
        for the rows that speculate: a plain request (a baseline in the same engine) costs a
        head's catch-up nothing."""
        rows = speculating_rows(seqs)
        if not rows:
            return
        if len(rows) < len(seqs):
            index = torch.tensor(rows, device=out.device)
            seqs, budget = [seqs[i] for i in rows], [budget[i] for i in rows]
            out, num_out = out.index_select(0, index), num_out.index_select(0, index)
            hidden = hidden.index_select(0, index) if hidden is not None else None
        self.drafter.verified(Verified(self._draft_batch(seqs, budget), out, num_out, hidden))

    def _result(self, seqs: list[Sequence], host: list[list[int]], budget: list[int], t0: float,
                period: float | None = None, scores: StepLogprobs | None = None) -> StepResult:
        """A StepResult from host rows [tokens out, tokens drafted, tokens...] (and the logprobs of
        the rows that ask, read after them); the step's time is charged to its rows. A packing
        runner's step holds its rows' tokens, a padding one's rows of the longest."""
        tokens = [h[2:2 + h[0]] for h in host]
        logprobs = None if scores is None else scores.host(tokens)
        self._charge(seqs, "verify_s", time.perf_counter() - t0)
        rows = len(seqs)
        step_tokens = rows + (sum(budget) if self.runner.packs_rows else rows * max(budget, default=0))
        return StepResult(tokens, [h[1] for h in host], rows, step_tokens, period, logprobs)

    @staticmethod
    def _charge(seqs: list[Sequence], what: str, seconds: float) -> None:
        for s in seqs:
            setattr(s.stats, what, getattr(s.stats, what) + seconds / len(seqs))

    @staticmethod
    def _last_rows(seqs: list[Sequence]) -> list[Row]:
        return [Row(s.slot, s.token_ids[-1:], len(s.token_ids) - 1) for s in seqs]

    # ---- overlap (GraphStep) ------------------------------------------------------------------
    def resume(self) -> StepPlan | None:
        """The plan of a step launched ahead whose tokens the host has not read; None here."""
        return None

    def drop_launched(self) -> None:
        """Nobody will read the launched step (all its sequences ended)."""


def needs_logits(seqs: list[Sequence]) -> bool:
    """Whether a row's logits are read beyond their argmax: where it asks for its tokens'
    log-probabilities, or its picks are shaped (logit bias, min_tokens, penalties)."""
    return asks_logprobs(seqs) or shapes_logits(seqs)


def asks_logprobs(seqs: list[Sequence]) -> bool:
    return any(s.params.logprobs is not None for s in seqs)


def shapes_logits(seqs: list[Sequence]) -> bool:
    return any(s.params.shapes_logits for s in seqs)


def shape(seqs: list[Sequence], logits: torch.Tensor, draft_tokens: torch.Tensor, before) -> torch.Tensor:
    """logits [B, S, V] shaped for the rows whose params do (sampling/penalties.py; the drafts
    before each position from before(), [B, S, K]); the logits themselves where none does."""
    rows = [i for i, s in enumerate(seqs) if s.params.shapes_logits]
    if not rows:
        return logits
    columns = []
    for i in rows:
        seq = seqs[i]
        if seq.shaping is None:
            seq.shaping = ShapingColumns(seq.params, seq.prompt_ids, sorted(seq.stopper.stop_ids), logits.shape[-1])
        seq.shaping.update(seq.token_ids, seq.num_prompt_tokens)
        columns.append(seq.shaping)
    return shaped(logits, rows, [seqs[i].params for i in rows], columns, [seqs[i].num_output_tokens for i in rows],
                  draft_tokens, before())


def step_logprobs(seqs: list[Sequence], logits: torch.Tensor, out: torch.Tensor,
                  by_slot: bool = False) -> StepLogprobs | None:
    """The logprobs of the rows that ask (logits [B, S, V] at the positions of out [B, S], the
    tokens the rows emit; by_slot: their rows are the sequences' slots, as a graph step's buffers
    hold them), on the device; None where no row asks."""
    rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    if not rows:
        return None
    return StepLogprobs(rows, [seqs[i].params.logprobs for i in rows], logits, out,
                        at=[seqs[i].slot for i in rows] if by_slot else None)


def speculating_rows(seqs: list[Sequence]) -> list[int]:
    """The rows a drafter hears of after verification: those that speculate (a plain request
    costs a drafter nothing)."""
    return [i for i, s in enumerate(seqs) if s.speculate]


def chunk_rows(chunks: list[PrefillChunk]) -> list[Row]:
    """Prompt chunks as the runner's rows."""
    return [Row(c.seq.slot, c.seq.token_ids[c.start:c.end], c.start) for c in chunks]
