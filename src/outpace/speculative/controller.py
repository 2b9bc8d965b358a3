"""DraftController: how many tokens to draft for each sequence, from measured acceptance and cost.

Acceptance is bursty: a draft whose first token is right is usually right for a while (a copied
span), so one per-token rate undercounts long drafts. The controller models a draft of k tokens
for sequence i as accepted up to position j with probability a_i * f_i^(j-1): a_i, the
sequence's rate at the first position, and f_i, its rate at a later position given the one
before was accepted. Where the drafter says how many tail tokens its match rested on, each
position's rate is scaled by how much likelier drafts of that match length were accepted than
drafts of any, learned over all sequences (n-gram drafts after a long match are accepted several
times as often as after a 1-token one). A verify step then yields E_i(k) = 1 + sum_j
P_i(>= j) tokens (accepted prefix plus the target's own). A step's cost is its forward, measured
at start-up (for b rows of 1 + k tokens where rows are padded to the longest; for b rows holding
e drafted tokens in all where rows are packed), plus what the step spends around the forward
(the host's work, longer contexts, and for drafting steps drafting and acceptance math), fitted
on the steps as they run as one line in the step's drafted tokens (its intercept the recent
plain steps' mean where there are some), plus the host's work per
token it yields (detokenising, stop checks), also measured. Where rows are packed a step costs
the tokens it holds, and the controller takes the most promising drafted tokens of any rows;
where they are padded it drafts one k for the batch (cut to what each row has). Either
maximises the batch's expected tokens per second, among drafts whose tokens return at least
MIN_RETURN times a plain step's tokens per second for the time they add, and no draft is a plain
step, so speculation that does not pay does not run. Until PROBE_DRAFTS drafts were verified, a
step that would not draft drafts one token: a drafter that the priors price out (a draft model,
whose drafted tokens cost far more than n-gram lookup's) would otherwise never be measured. Likewise,
while fewer than PROBE_DRAFTS drafts (decayed) reached the position past a step's chosen length, the
step drafts that one token more: a later position's rate is otherwise never measured where its
prior says it does not pay, and a draft model whose second tokens are mostly accepted drafts one
token a step for good.

Some drafting costs a row something once, before its first drafted token: a draft model reads
every token of the row it has not read yet (its prompt, where it did not cache it, and the tokens
of steps it did not draft in). Such a setup is paid only where it is repaid: where drafting at the
chosen length saves, per token of the row, the difference between a plain step's seconds per
token and a drafting step's, over the tokens the row is expected to have left (its room in
max_tokens, at most what finished sequences went on for, one cut at its own max_tokens counting
as one that went on: `remaining`), MIN_RETURN times the setup's seconds.
A row that would not repay it drafts nothing and its setup keeps growing, so under a load where
drafting does not pay, the draft model costs nothing after its probes.

A drafter of token trees (tree_width > 1) can draft chains as well, and which pays depends on the
machine and the load: a tree's first node is right more often, a chain of as many tokens reaches
deeper, and a tree's verify forward may cost more (on a GPU it runs outside the CUDA graphs). Where
the controller is timed, each batch bucket drafts one shape, chains first, and tries the other
every SHAPE_PROBE drafting steps; each such probe's tokens a second (tokens yielded over the
step's seconds, drafting through accepting) is set against the drafted shape's over its
SHAPE_WINDOW most recent steps, so both are measured on the same stretch of text (a span that
copies the prompt yields more to either), no step counting for more than OUTLIER_FORWARDS times
their median seconds. The other shape takes over where its probes' mean log ratio, decayed per
probe, exceeds SHAPE_SWITCH over SHAPE_EVIDENCE probes: a shape changes only on clear evidence,
since one step's yield is noisy, and a change of load or text is still followed. Untimed, trees
are drafted as asked.

Where every step drafts trees (a head's inside the CUDA graphs, whose chains would draft outside
them: tree_depth given), no chains are weighed against them, and the controller's positions are
the trees' depths: a step's acceptance is observed against the depth its tree of k nodes
reached, so the rates are a tree's at each depth, and a budget of k nodes is priced as a step
of 1 + k tokens that yields the depths it reaches (a node that reaches no deeper adds nothing).
A chain's positions would have counted a tree's k nodes as k positions, most never reachable,
and held trees to a few nodes.
"""
from __future__ import annotations

import bisect
import itertools
import math
import statistics
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

OUTLIER_FORWARDS = 4.0    # a step's measured overhead counts as at most this many of its forwards
# weight, in steps drafting a whole draft (num_draft_tokens tokens where rows are packed), of the prior
# that drafting costs what the calibration says: where drafting steps are few (drafting stopped),
# the fitted slope shrinks toward it, so a bad estimate is probed again rather than ending
# speculation for good
SLOPE_PRIOR = 0.5
# drafted tokens must return this many times a plain step's tokens per second for the time they
# add (estimates are noisy). Per drafted token, not per step: one drafted token costs about 2% of a
# 32-row step, so a step-wide margin would ask for several good drafts in one step
MIN_RETURN = 1.2
# verified drafts (decayed) a drafter gets on trust: below them a step drafts at least one token,
# so that acceptance is measured before the priors can rule drafting out
PROBE_DRAFTS = 8.0
MATCH_PRIOR = 4.0         # drafts' weight of the pooled rate in a match length's rate (shrinkage)
# what a sequence's rates start from before its own evidence: [accepted, trials] at the first
# drafted position and at later ones (the pool's rates replace them where they are higher)
PRIOR_FIRST = (1.0, 2.0)
PRIOR_LATER = (1.4, 2.0)
SEQ_DECAY = 0.9           # per verify step, on a sequence's own evidence
TOKEN_COST_DECAY = 0.9    # per step, on the host seconds per yielded token
FIT_DECAY = 0.97          # per step, on the measured steps behind the cost fit
PLAIN_ANCHOR = 3.0        # decayed plain steps that pin the fit's intercept (LineFit.line)
POOL_DECAY = 0.995        # per draft, on every sequence's pooled evidence
OUTPUT_DECAY = 0.95       # per finished sequence, on the mean output length
SHAPE_WINDOW = 8          # the drafted shape's (trees' or chains') recent steps a probe of the other is set against
SHAPE_PROBE = 16          # drafting steps of a bucket between two probes of the shape not drafted
SHAPE_SWITCH = 0.15       # mean log ratio of the probes' tokens a second at which the other shape takes over
SHAPE_EVIDENCE = 2.4      # decayed probes that must back a change (three)
SHAPE_DECAY = 0.8         # per probe, on the probes' evidence


@dataclass
class Rates:
    """One sequence's decayed evidence: drafts accepted at the first position of their trials,
    at later positions of those reached (every earlier token accepted), and how often the drafter
    had a draft when asked."""

    first_accepted: float
    first_trials: float
    later_accepted: float
    later_trials: float
    hits: float = 0.0
    asks: float = 0.0


@dataclass
class Reached:
    """Decayed counts at one draft position: drafts that reached it and were accepted there."""

    accepted: float = 0.0
    reached: float = 0.0

    def observe(self, is_reached: bool, is_accepted: bool, decay: float) -> None:
        self.accepted = self.accepted * decay + (is_reached and is_accepted)
        self.reached = self.reached * decay + is_reached


@dataclass
class LineFit:
    """A decayed least-squares line y = alpha + beta * x through the measured steps: running sums
    of weight, x, x^2, y and x * y, and of the weight and y of the points at x = 0 (plain steps)."""

    weight: float = 0.0
    x: float = 0.0
    xx: float = 0.0
    y: float = 0.0
    xy: float = 0.0
    weight0: float = 0.0
    y0: float = 0.0

    def add(self, x: float, y: float, decay: float) -> None:
        self.weight, self.x, self.xx = self.weight * decay + 1.0, self.x * decay + x, self.xx * decay + x * x
        self.y, self.xy = self.y * decay + y, self.xy * decay + x * y
        self.weight0, self.y0 = self.weight0 * decay + (x == 0), self.y0 * decay + (y if x == 0 else 0.0)

    def line(self, slope_prior: float) -> tuple[float, float]:
        """(alpha, beta), the slope shrunk toward 0 by slope_prior (in units of x^2). Where recent
        plain steps weigh PLAIN_ANCHOR at least, alpha is their mean and the slope is fitted
        through it: a shrunk slope with a free intercept would move drafting's cost into alpha,
        which plain steps are charged too, and make drafting look cheaper against them. Without
        them (nearly every step drafts) both are fitted."""
        if self.weight0 >= PLAIN_ANCHOR:
            alpha = self.y0 / self.weight0
            return alpha, (self.xy - alpha * self.x) / (self.xx + slope_prior)
        beta = (self.xy - self.x * self.y / self.weight) / (self.xx - self.x * self.x / self.weight + slope_prior)
        return (self.y - beta * self.x) / self.weight, beta


@dataclass
class ShapeChoice:
    """One batch bucket's choice between token trees and chains: the tree width drafted (1:
    chains), its recent drafting steps (tokens yielded, seconds), the drafting steps since the
    other shape's last probe, and the probes' decayed evidence: the sum of log(a probe's tokens a
    second / the drafted shape's recent ones) and of probes."""

    width: int
    recent: deque = field(default_factory=lambda: deque(maxlen=SHAPE_WINDOW))
    since: int = 0
    log_ratio: float = 0.0
    probes: float = 0.0

    def cap(self) -> float:
        """The most seconds a step counts for: OUTLIER_FORWARDS times the recent steps' median (a
        first call or a collection pause is not what a shape costs)."""
        return OUTLIER_FORWARDS * statistics.median(s for _, s in self.recent)

    def rate(self) -> float:
        """The drafted shape's recent tokens a second."""
        cap = self.cap()
        return sum(t for t, _ in self.recent) / max(sum(min(s, cap) for _, s in self.recent), 1e-9)


class DraftController:
    def __init__(self, num_draft_tokens: int, cost: dict[int, list] | None = None, packed: bool = False,
                 draft_cost=None, tree_width: int = 1, tree_depth: Callable[[int], int] | None = None,
                 draft_step_cost=None):
        """cost: forward seconds by batch-size bucket b, as calibrate.measure_verify_cost gives them:
        cost[b][s-1] for b rows of s tokens (packed False: rows padded to the longest), or
        cost[b] = [[e, seconds], ...] for b rows holding e drafted tokens (packed True). None =
        flat, no timing. draft_cost(batch_size): the drafter's own seconds per drafted token in a
        step of that many rows (Drafter.cost_per_token), charged on top of the verify forward;
        draft_step_cost(batch_size): seconds a step that drafts such tokens pays once beside them
        (Drafter.step_cost: a head's catch-up of the pairs the last step accepted).
        tree_width: the drafter's token trees' width (1: it drafts chains only). tree_depth: where
        every step drafts trees of tree_width (a head's inside the CUDA graphs, whose chains would
        draft outside them: HeadTreeGraphStep), the depth a tree of k nodes reaches; no chains are
        weighed against trees then, and the controller's positions are depths (_by_node)."""
        self.num_draft_tokens = num_draft_tokens
        self.packed = packed
        self.draft_cost = draft_cost
        self.draft_step_cost = draft_step_cost or (lambda batch_size: 0.0)
        # curves[b]: (x, seconds) points, x a step's tokens per row (padded) or drafted tokens (packed)
        self.curves = {b: [tuple(p) for p in curve] if packed else [(s + 1, t) for s, t in enumerate(curve)]
                       for b, curve in (cost or {}).items()}
        self.buckets = sorted(self.curves)
        self.tables: dict[int, list[float]] = {}       # packed: bucket -> forward seconds by drafted tokens
        self.padded: dict[tuple[int, int], float] = {}  # padded: (bucket, tokens a row) -> forward seconds
        self._prior_rates: Rates | None = None          # _prior(), while the pool holds
        self.rates: dict[int, Rates] = {}               # by seq_id
        # bucket -> what a step takes beyond the calibrated forward, alpha + beta * x, x its drafting
        # (drafted tokens where rows are packed, whose attention over each row's own cache follows
        # its tokens; 1 for a drafting step where rows are padded to a captured shape; 0 for a
        # plain step), and its line
        self.sums: dict[int, LineFit] = {}
        self.fit: dict[int, tuple[float, float]] = {}
        self.token_cost = 0.0       # running mean of host seconds per token a step yields
        # verified drafts of every sequence, pooled and by the drafter's match length, per position
        self.pool = [Reached() for _ in range(num_draft_tokens)]
        self.by_match: dict[int, list[Reached]] = {}
        # batch bucket -> seconds a row's token saves by drafting, a mean row's at that load's last
        # decision: what a new sequence's prompt setup is weighed against
        self.saving: dict[int, float] = {}
        # finished sequences' output tokens and how many of them ended on their own, decayed
        self.outputs = [0.0, 0.0]
        self.probe_setup: int | None = None    # the running sequence set up on trust while probing (pays_setup)
        self.tree_width = tree_width
        self.tree_depth = tree_depth
        self.shapes: dict[int, ShapeChoice] = {}        # bucket -> its choice of trees or chains
        # _gains' answers since the evidence last changed (observe and end clear it): a step asks
        # for the same rows' gains up to four times (paid and free lengths, the savings, the rows
        # that repay their setup)
        self._gains_memo: dict[tuple, list[list[float]]] = {}

    @property
    def is_timed(self) -> bool:
        """Whether step costs were calibrated: without them observe_step and observe_tokens learn nothing."""
        return bool(self.buckets)

    def _rates(self, seq_id: int) -> Rates:
        return self.rates.get(seq_id) or self._prior()

    def _prior(self) -> Rates:
        """What a sequence's rates start from and relax toward while it drafts nothing: the pool's
        rates (every sequence's drafts), where they beat the static prior, so a new sequence
        starts at its population's rate rather than at one half. Never below the static prior, so
        that sequences are probed again where every sequence's drafts were rejected."""
        if self._prior_rates is None:
            (acc1, tr1), (accf, trf) = PRIOR_FIRST, PRIOR_LATER
            first = (self.pool[0].accepted + acc1) / (self.pool[0].reached + tr1)
            later = (sum(p.accepted for p in self.pool[1:]) + accf) / (sum(p.reached for p in self.pool[1:]) + trf)
            self._prior_rates = Rates(max(first, acc1 / tr1) * tr1, tr1, max(later, accf / trf) * trf, trf)
        return self._prior_rates

    def acceptance(self, seq_id: int) -> float:
        """P(first drafted token accepted)."""
        r = self._rates(seq_id)
        return r.first_accepted / r.first_trials

    def follow_rate(self, seq_id: int) -> float:
        """P(a drafted token accepted | the one before it was)."""
        r = self._rates(seq_id)
        return r.later_accepted / r.later_trials

    def hit_rate(self, seq_id: int) -> float:
        """Share of asks for which the drafter had a draft (1 until the sequence was budget)."""
        r = self._rates(seq_id)
        return r.hits / r.asks if r.asks else 1.0

    def _bucket(self, batch_size: int) -> int:
        return self.buckets[min(bisect.bisect_left(self.buckets, batch_size), len(self.buckets) - 1)]

    def step_cost(self, batch_size: int, tokens: int) -> float:
        """Expected seconds of a step of batch_size rows holding `tokens` tokens in all: the
        calibrated forward (between the curve's points) plus the measured overheads."""
        return self._costs(batch_size)(tokens)

    def _costs(self, batch_size: int, paid: bool = True):
        """step_cost(batch_size, tokens) as a function of tokens, the bucket and its fit looked
        up once (a 32-row step weighs a few hundred drafted tokens). paid False: drafts that cost
        the drafter nothing (a chain's lookups), so its cost per drafted token is not charged."""
        if not self.buckets:
            return lambda tokens: 1.0
        b = self._bucket(batch_size)
        alpha, beta = self.fit.get(b, (0.0, 0.0))
        per_draft = self.draft_cost(batch_size) if self.draft_cost is not None and paid else 0.0
        per_step = self.draft_step_cost(batch_size) if paid else 0.0
        return lambda tokens: (self._forward(b, batch_size, tokens) + alpha + beta * self._drafting(batch_size, tokens)
                               + per_draft * (tokens - batch_size) + (per_step if tokens > batch_size else 0.0))

    def _forward(self, bucket: int, batch_size: int, tokens: int) -> float:
        if not self.packed:
            if tokens % batch_size:             # rows of unequal lengths: no padded step's shape
                return interpolate(self.curves[bucket], tokens / batch_size)
            key = (bucket, tokens // batch_size)
            seconds = self.padded.get(key)
            if seconds is None:
                seconds = self.padded[key] = interpolate(self.curves[bucket], key[1])
            return seconds
        table = self.tables.setdefault(bucket, [])      # by drafted tokens, filled as asked
        while len(table) <= tokens - batch_size:
            table.append(interpolate(self.curves[bucket], len(table)))
        return table[tokens - batch_size]

    def _drafting(self, batch_size: int, tokens: int) -> int:
        """A step's x in the fit of its cost beyond the calibration: drafted tokens (packed rows),
        or whether it drafts (padded rows)."""
        drafted = tokens - batch_size
        return drafted if self.packed else int(drafted > 0)

    def cost_ratio(self, batch_size: int, num_draft: int) -> float:
        """A step drafting num_draft tokens in every row against a plain step."""
        return self.step_cost(batch_size, batch_size * (1 + num_draft)) / self.step_cost(batch_size, batch_size)

    def match_factor(self, match_len: int, position: int) -> float:
        """How much likelier a drafted token at `position` (1-based, every earlier one accepted) is
        accepted when the draft came from a match of match_len tokens, against drafts of any match
        (1 for 0, unknown). Rates by match length shrink toward the pooled rate while they are
        measured on few drafts."""
        table = self.by_match.get(match_len)
        if table is None:
            return 1.0
        pool = self.pool[position - 1]
        pooled = (pool.accepted + 1.0) / (pool.reached + 2.0)
        mine = table[position - 1]
        return (mine.accepted + MATCH_PRIOR * pooled) / (mine.reached + MATCH_PRIOR) / pooled

    def _gains(self, seq_ids: list[int], available: list[int] | None,
               matches: list[int] | None = None) -> list[list[float]]:
        """gains[i][j-1]: expected tokens that row i's j-th drafted token adds, P_i(>= j): the
        sequence's own first-position and follow rates, scaled by what its draft's match length
        says (match_factor). available[i], when the drafts are already known, is how many tokens
        row i has (a row without a draft gains nothing); otherwise a row's gain is weighted by its
        hit rate."""
        key = (tuple(seq_ids), None if available is None else tuple(available), tuple(matches or ()))
        known = self._gains_memo.get(key)
        if known is not None:
            return known
        gains, prior = [], None
        for i, s in enumerate(seq_ids):
            # the rates read inline (acceptance, follow_rate, hit_rate): this runs for every row of
            # every step, so at 32 rows it is a visible share of a fast device's step
            r = self.rates.get(s)
            if r is None:
                r = prior = prior or self._prior()
            rate = min(r.first_accepted / r.first_trials, 0.99) * (
                1.0 if available is not None or not r.asks else r.hits / r.asks)
            follow = r.later_accepted / r.later_trials
            n = self.num_draft_tokens if available is None else min(self.num_draft_tokens, available[i])
            match = matches[i] if matches else 0
            if match not in self.by_match:       # match_factor 1 at every position: a geometric row
                reach, row, follow = min(rate, 0.99), [], min(follow, 0.99)
                for _ in range(n):
                    row.append(reach)
                    reach *= follow
                gains.append(row)
                continue
            reach, row = 1.0, []
            for j in range(1, 1 + n):
                reach *= min(rate * self.match_factor(match, j), 0.99)
                row.append(reach)
                rate = follow
            gains.append(row)
        self._gains_memo[key] = gains
        return gains

    def _by_node(self, row: list[float]) -> list[float]:
        """A row's gains by drafted token. For trees every step drafts (tree_depth), row holds the
        gains by depth, and a tree's k-th node adds the gain of the depth it first reaches: the
        gain of depth tree_depth(k) where a tree of k - 1 nodes reached less deep, else none."""
        if self.tree_depth is None:
            return row
        by_node, reached = [], 0
        for k in range(1, self.num_draft_tokens + 1):
            depth = min(self.tree_depth(k), len(row))
            by_node.append(row[depth - 1] if depth > reached else 0.0)
            reached = max(reached, depth)
        return by_node

    def num_draft(self, seq_ids: list[int], batch_size: int, available: list[int] | None = None,
                  matches: list[int] | None = None, paid: bool = True) -> int:
        """One draft length for the speculating sequences of a batch of batch_size rows (padded
        rows, or drafts not known yet): the k maximising sum_i E_i(k) / c(batch, k), against
        batch_size tokens for a plain step (which wins unless drafting clears MIN_RETURN, see
        _best_prefix).
        Rows that do not speculate yield one token whatever k is; the step is charged as b rows of
        1 + k tokens."""
        gains = [self._by_node(row) for row in self._gains(seq_ids, available, matches)]
        longest = max(map(len, gains), default=0)
        # by draft position, the rows' gains summed in the rows' order (a shorter row adds 0.0)
        columns = [sum(column, 0.0) for column in itertools.zip_longest(*gains, fillvalue=0.0)]
        best = self._best_prefix(batch_size, (batch_size * (1 + k) for k in itertools.count(1)), columns, paid)
        if best == 0:
            return 1 if longest and self.probing else 0
        probe = self.tree_depth is None and best < longest and self._probes_position(best)
        return best + 1 if probe else best

    def row_lengths(self, seq_ids: list[int], batch_size: int, setup: list[float] | None = None,
                    remaining: list[float] | None = None, paid: bool = True, load: int = 0) -> list[int]:
        """num_draft's length for each speculating row of a batch of batch_size rows (drafts not
        known yet), but 0 for a row whose setup (setup[i] seconds before it can draft) drafting
        would not repay over its remaining[i] tokens (the top); the length is then chosen again
        for the rows that draft. A setup is weighed at the saving of a batch of `load` rows where
        that is larger (sequences still caching their prompts are about to decode beside these,
        so most remaining tokens come in that batch), except while the drafter is probed. Where
        paid, also updates `saving`, which pays_setup reads; paid False: drafts at no drafting
        cost (num_draft), which say nothing of a setup's return."""
        k = self.num_draft(seq_ids, batch_size, paid=paid)
        if not paid:
            return [k] * len(seq_ids)
        savings = self._savings(seq_ids, batch_size, k)
        if savings and self.buckets:
            self.saving[self._bucket(batch_size)] = sum(savings) / len(savings)
        if not k or setup is None or not self.is_timed:
            return [k] * len(seq_ids)
        if load > batch_size and not self.probing and any(s > 0 for s in setup):
            savings = self._savings(seq_ids, load, self.num_draft(seq_ids, load))
        keep = [s <= 0 or v * r >= MIN_RETURN * s for s, v, r in zip(setup, savings, remaining)]
        if all(keep):
            return [k] * len(seq_ids)
        kept = [i for i, ok in zip(seq_ids, keep) if ok]
        k = self.num_draft(kept, batch_size) if kept else 0
        return [k if ok else 0 for ok in keep]

    def _savings(self, seq_ids: list[int], batch_size: int, k: int) -> list[float]:
        """Per row, the seconds each of its tokens saves when the batch drafts k tokens a row
        rather than none: a plain step's seconds over its batch_size tokens, less a drafting
        step's over batch_size times the row's expected tokens (the step's cost shared evenly
        by its rows); never below 0."""
        if not k or not self.buckets:
            return [0.0] * len(seq_ids)
        cost, token_cost = self._costs(batch_size), self.token_cost
        gains = [sum(self._by_node(row)[:k]) for row in self._gains(seq_ids, None)]
        plain = cost(batch_size) / batch_size + token_cost
        drafting = cost(batch_size * (1 + k)) / batch_size
        return [max(0.0, plain - drafting / (1 + g) - token_cost) for g in gains]

    def pays_setup(self, seconds: float, room: int, batch_size: int, seq_id: int) -> bool:
        """Whether sequence seq_id's setup of `seconds` (a draft model reading its prompt) is
        repaid over the tokens it is expected to output (room: its max_tokens) at the saving per
        token of the last decision at its batch's size (the sequences running with it). Where no
        decision was made at that size yet, the saving that sequences at the pool's rates would
        see there (a load the engine has not run yet: the first burst of a server already
        serving), but while the drafter is still probed one sequence at a time is set up on
        trust, so that its drafts are measured: a burst's every prompt would cost a prompt's
        setup each (4 on the CPU: about 2 s of a 24 s round). True untimed."""
        if not self.buckets or seconds <= 0:
            return True
        saving = self.saving.get(self._bucket(batch_size))
        if saving is None:
            if self.probing and self.probe_setup is None:
                self.probe_setup = seq_id
                return True
            saving = self._pooled_saving(batch_size)
        return saving * self.remaining(0, room) >= MIN_RETURN * seconds

    def _pooled_saving(self, batch_size: int) -> float:
        """The seconds a token saves in a batch of batch_size sequences that each draft at the
        pool's rates (_prior; None is the id of no sequence), at the length num_draft chooses for
        them (pays_setup asks only once probing ended, so no probe's length)."""
        rows = [None] * batch_size
        return self._savings(rows[:1], batch_size, self.num_draft(rows, batch_size))[0]

    def remaining(self, num_output: int, room: int) -> float:
        """Tokens a sequence that has output num_output tokens is expected to output yet: its room
        in max_tokens, at most the mean output length beyond num_output (a quarter of that mean
        at least: a sequence past the mean is not about to end). The mean is finished sequences'
        tokens over those of them that ended on their own: one cut at its max_tokens says only
        that it would have gone on at least that long (the estimate of a constant chance to stop
        a token from such cut-off lengths), so short requests (a benchmark's warm-up of 8 tokens)
        do not make longer ones look about to end, and where every sequence was cut, each is
        expected to fill its room."""
        tokens, ended = self.outputs
        if not ended:
            return room
        mean = tokens / ended
        return min(room, max(mean - num_output, mean / 4))

    @property
    def probing(self) -> bool:
        """Whether fewer than PROBE_DRAFTS drafts were verified: drafting is then tried on trust."""
        return self._probes_position(0)

    def _probes_position(self, index: int) -> bool:
        """Whether fewer than PROBE_DRAFTS drafts reached draft position index + 1 (0-based index):
        a step that drafts up to the position before drafts it too, on trust."""
        return self.pool[index].reached < PROBE_DRAFTS

    def draft_lengths(self, seq_ids: list[int], batch_size: int, available: list[int] | None = None,
                      matches: list[int] | None = None, paid: bool = True) -> list[int]:
        """How many of its drafted tokens each sequence verifies this step. Where rows are packed
        and the drafts are known, the most promising tokens of any rows (a step costs the tokens it
        holds); otherwise num_draft's one length, cut to what each sequence has (available) or may
        draft. paid False: the drafts cost the drafter nothing (_costs)."""
        if self.packed and available is not None:
            return self._best_tokens(seq_ids, batch_size, available, matches, paid)
        k = self.num_draft(seq_ids, batch_size, available, matches, paid)
        return [min(k, n) for n in (available or [self.num_draft_tokens] * len(seq_ids))]

    def _best_tokens(self, seq_ids: list[int], batch_size: int, available: list[int],
                     matches: list[int] | None, paid: bool = True) -> list[int]:
        """Drafted tokens taken most promising first (a row's gains fall with the position, so each
        row keeps a prefix) for as long as the step's expected tokens per second grow, against a
        plain step that wins unless drafting clears MIN_RETURN (see _best_prefix)."""
        gains = self._gains(seq_ids, available, matches)
        ranked = sorted((-g, j, i) for i, row in enumerate(gains) for j, g in enumerate(row))
        best_n = self._best_prefix(batch_size, itertools.count(batch_size + 1), (-g for g, _, _ in ranked), paid)
        if best_n == 0 and ranked and self.probing:
            best_n = 1
        elif 0 < best_n < len(ranked) and ranked[best_n][1] > 0 and self._probes_position(ranked[best_n][1]):
            best_n += 1         # the next most promising token is a later position: probed
        lengths = [0] * len(seq_ids)
        for _, _, i in ranked[:best_n]:
            lengths[i] += 1
        return lengths

    def _best_prefix(self, batch_size: int, tokens: Iterable[int], gains: Iterable[float], paid: bool = True) -> int:
        """How many drafting choices to take, in order: the n-th brings the step to tokens[n-1]
        tokens and adds gains[n-1] expected tokens. The n maximising the expected tokens per
        second among those whose drafted tokens return MIN_RETURN times a plain step's tokens per
        second for the time they add; 0 (a plain step) where none does."""
        cost, token_cost = self._costs(batch_size, paid), self.token_cost
        expected = float(batch_size)
        plain_s = cost(batch_size) + expected * token_cost
        best_n, best_rate, floor = 0, expected / plain_s, MIN_RETURN * expected / plain_s
        for n, (step_tokens, gain) in enumerate(zip(tokens, gains), 1):
            expected += gain
            seconds = cost(step_tokens) + expected * token_cost
            added, rate = seconds - plain_s, expected / seconds
            if rate > best_rate and (added <= 0 or (expected - batch_size) / added >= floor):
                best_n, best_rate = n, rate
        return best_n

    def observe(self, seq_id: int, budget: int, num_draft: int, num_accepted: int, match_len: int = 0) -> None:
        """After a step that gave the sequence a budget of `budget` drafted tokens and verified
        num_draft of them. Acceptance counts decay so the estimate follows the sequence's recent
        behaviour. A step
        with a budget of 0 carries no evidence: the estimate relaxes toward the prior instead,
        so a sequence whose drafting was switched off is probed again after a few steps (without
        this, one bad stretch would end speculation for the rest of the sequence)."""
        self._gains_memo.clear()
        if self.tree_depth is not None and num_draft:       # positions are depths: what the tree reached
            num_draft = self.tree_depth(num_draft)
        r, d = self._rates(seq_id), SEQ_DECAY
        if budget == 0:
            p = self._prior()
            self.rates[seq_id] = Rates(r.first_accepted * d + p.first_accepted * (1 - d),
                                       r.first_trials * d + p.first_trials * (1 - d),
                                       r.later_accepted * d + p.later_accepted * (1 - d),
                                       r.later_trials * d + p.later_trials * (1 - d),
                                       r.hits * d + (1 - d), r.asks * d + (1 - d))
            return
        r = Rates(r.first_accepted, r.first_trials, r.later_accepted, r.later_trials,
                  r.hits * d + (num_draft > 0), r.asks * d + 1)
        if num_draft:
            self._observe_positions(self.pool, num_draft, num_accepted)
            self._prior_rates = None
            if match_len:
                table = self.by_match.get(match_len)
                if table is None:
                    table = self.by_match[match_len] = [Reached() for _ in range(self.num_draft_tokens)]
                self._observe_positions(table, num_draft, num_accepted)
            r.first_accepted, r.first_trials = r.first_accepted * d + (num_accepted > 0), r.first_trials * d + 1
            # later positions reached: 2..num_accepted + 1 (a rejection ends the draft)
            reached = min(num_accepted + 1, num_draft) - 1
            if reached > 0:
                r.later_accepted = r.later_accepted * d + num_accepted - 1
                r.later_trials = r.later_trials * d + reached
        self.rates[seq_id] = r

    @staticmethod
    def _observe_positions(table: list[Reached], num_draft: int, num_accepted: int) -> None:
        for j, counts in enumerate(table[:num_draft]):
            # reached: every earlier position was accepted
            counts.observe(j <= num_accepted, j < num_accepted, POOL_DECAY)

    def observe_step(self, batch_size: int, tokens: int, seconds: float, paid_tokens: int = 0,
                     draft_seconds: float = 0.0) -> None:
        """A decode step of batch_size rows holding `tokens` tokens in all took `seconds` (propose
        through the host sync), paid_tokens of its drafted tokens drafted by a drafter that prices
        its own forwards (draft_cost, and draft_step_cost once). What it took beyond the calibrated
        forward and that price (launches, the host's work, lookups, acceptance math, contexts longer
        than the calibration's, whose attention grows with each drafted token where rows are packed)
        is fitted per bucket as alpha + beta * x over the recent steps, plain and drafting alike (a
        decayed least-squares line, its slope shrunk toward none by SLOPE_PRIOR). The drafter's
        price is taken out first because _costs charges it on top of the fit: left in, a draft
        model's forwards were counted twice, and a chain's free lookup rows paid for them through
        the slope. It is taken out down to nothing left, or down to the fit's intercept (a plain
        step's overhead) where that is negative, not below: a price above what the steps took is
        kept, not refunded through the fit (free rows would then look cheaper than nothing). The
        intercept is negative where the calibration is slower than the steps (timed while the
        machine was busy, or kept from a slower spell); floored at nothing there, a drafting
        step's overhead stood above a plain step's by what the calibration missed, and the slope
        charged that to each drafted token. Where the host measured the drafting take more than
        its price (draft_seconds: on the CPU a propose's time is its work, and a price that is a
        decayed mean of it lags a change), the measure is taken out instead: left in, the lag went
        into the intercept, which plain steps are charged too, and drafting looked cheaper against
        them. One fit rather than separate means of plain and drafting steps: where nearly every
        step drafts, a plain steps' mean goes stale and the drafting one absorbs its error, so
        drafted tokens look cheaper than they are; its intercept is the plain steps' mean only
        while recent plain steps weigh enough (LineFit.line). One slow step (a first call, a
        collection pause) counts as at most a few forwards."""
        if not self.buckets:
            return
        b = self._bucket(batch_size)
        forward = self._forward(b, batch_size, tokens)
        extra = seconds - forward
        if paid_tokens and self.draft_cost is not None:
            price = self.draft_cost(batch_size) * paid_tokens + self.draft_step_cost(batch_size)
            extra = max(extra - max(price, draft_seconds), min(self.fit.get(b, (0.0, 0.0))[0], 0.0))
        x, y = self._drafting(batch_size, tokens), min(extra, OUTLIER_FORWARDS * forward)
        sums = self.sums.setdefault(b, LineFit())
        sums.add(x, y, FIT_DECAY)
        self.fit[b] = sums.line(SLOPE_PRIOR * (self.num_draft_tokens ** 2 if self.packed else 1))

    def observe_tokens(self, num_tokens: int, seconds: float) -> None:
        """A step's host work on its num_tokens new tokens took `seconds`. It grows with the
        tokens a step yields, so where it is large (many rows, a fast device) drafting gains less."""
        if self.buckets and num_tokens:
            d = TOKEN_COST_DECAY
            self.token_cost = d * self.token_cost + (1 - d) * seconds / num_tokens

    def step_tree_width(self, batch_size: int) -> int:
        """The width of a step's token trees for a batch of batch_size rows (1: chains): the
        bucket's drafted shape, or the other one where SHAPE_PROBE drafting steps passed since it
        was last tried (the module's docstring). The drafter's width where it drafts chains only,
        the controller is untimed or every step drafts trees (tree_depth)."""
        if self.tree_width == 1 or not self.buckets or self.tree_depth is not None:
            return self.tree_width
        choice = self._choice(batch_size)
        if len(choice.recent) < 2 or choice.since < SHAPE_PROBE:
            return choice.width
        return 1 if choice.width != 1 else self.tree_width

    def observe_shape(self, batch_size: int, tree_width: int, tokens: int, seconds: float) -> None:
        """A drafting step of batch_size rows with trees of tree_width (1: chains) yielded `tokens`
        tokens in `seconds` (drafting through accepting): a step of the drafted shape joins its
        recent steps; a probe of the other is weighed against them, and the other shape takes
        over where the probes' evidence says it yields more."""
        if self.tree_width == 1 or not self.buckets or self.tree_depth is not None:
            return
        choice = self._choice(batch_size)
        if tree_width == choice.width or not choice.recent:
            choice.recent.append((tokens, seconds))
            choice.since += 1
            return
        ratio = math.log(max(tokens / max(min(seconds, choice.cap()), 1e-9), 1e-9) / max(choice.rate(), 1e-9))
        choice.log_ratio = choice.log_ratio * SHAPE_DECAY + ratio
        choice.probes = choice.probes * SHAPE_DECAY + 1.0
        choice.since = 0
        if choice.probes >= SHAPE_EVIDENCE and choice.log_ratio / choice.probes > SHAPE_SWITCH:
            self.shapes[self._bucket(batch_size)] = ShapeChoice(tree_width, deque([(tokens, seconds)],
                                                                                  maxlen=SHAPE_WINDOW))

    def _choice(self, batch_size: int) -> ShapeChoice:
        return self.shapes.setdefault(self._bucket(batch_size), ShapeChoice(1))

    def end(self, seq_id: int, num_output: int = 0, cut: bool = False) -> None:
        """The sequence finished with num_output tokens (0: cancelled, or unknown); cut: at its
        max_tokens or the model's length, not on its own."""
        self._gains_memo.clear()
        self.rates.pop(seq_id, None)
        if self.probe_setup == seq_id:
            self.probe_setup = None
        if num_output:
            tokens, ended = self.outputs
            self.outputs = [tokens * OUTPUT_DECAY + num_output, ended * OUTPUT_DECAY + (not cut)]


def interpolate(points: list[tuple[float, float]], x: float, extend: bool = False) -> float:
    """Piecewise-linear y(x) through points sorted by x, held at the ends; extend: past the last
    point, the last segment's line goes on."""
    if x <= points[0][0]:
        return points[0][1]
    last = len(points) - 2                  # the last segment's index
    for i, ((x0, y0), (x1, y1)) in enumerate(zip(points, points[1:])):
        if x <= x1 or (extend and i == last):
            return y0 + (x - x0) / (x1 - x0) * (y1 - y0)
    return points[-1][1]
