"""DraftController: how many tokens to draft for each sequence, from measured acceptance and cost.

Acceptance is bursty: a draft whose first token is right is usually right for a while (a copied
span), so one per-token rate undercounts long drafts. The controller models a draft of k tokens
for sequence i as accepted up to position j with probability a_i * f_i^(j-1): a_i, the
sequence's rate at the first position, and f_i, its rate at a later position given the one
before was accepted. A verify step then yields E_i(k) = 1 + sum_j P_i(>= j) tokens (accepted
prefix plus the target's own). A step's cost is its forward, measured at start-up (for b rows of
1 + k tokens where rows are padded to the longest; for b rows holding e drafted tokens in all
where rows are packed), plus what the step spends around the forward (drafting, acceptance math,
the host sync, longer contexts), measured on the steps as they run, plus the host's work per
token it yields (detokenising, stop checks), also measured. The controller drafts the one k (cut
to what each row has) that maximises the batch's expected tokens per second, a step charged as
every row holding 1 + k tokens (what it costs where rows are padded; an upper bound where they
are packed, which measured better than charging packed rows what they hold). No draft is a plain
step, so speculation that does not pay does not run.
"""
from __future__ import annotations

import bisect

OUTLIER_FORWARDS = 4.0    # a step's measured overhead counts as at most this many of its forwards
MIN_GAIN = 1.03           # drafting must promise this much over a plain step: estimates are noisy


class DraftController:
    def __init__(self, max_draft: int, cost: dict[int, list] | None = None, packed: bool = False,
                 prior_accepted: float = 1.0, prior_drafted: float = 2.0, decay: float = 0.9,
                 step_decay: float = 0.9, probe_decay: float = 0.98, prior_follow: tuple[float, float] = (1.4, 2.0)):
        """cost: forward seconds by batch-size bucket b, as calibrate.measure_verify_cost gives them:
        cost[b][s-1] for b rows of s tokens (packed False: rows padded to the longest), or
        cost[b] = [[e, seconds], ...] for b rows holding e drafted tokens (packed True). None =
        flat, no timing."""
        self.max_draft = max_draft
        self.packed = packed
        # curves[b]: (x, seconds) points, x a step's tokens per row (padded) or drafted tokens (packed)
        self.curves = {b: [tuple(p) for p in curve] if packed else [(s + 1, t) for s, t in enumerate(curve)]
                       for b, curve in (cost or {}).items()}
        self.buckets = sorted(self.curves)
        self.prior = (prior_accepted, prior_drafted, *prior_follow)
        self.decay = decay
        self.step_decay = step_decay
        self.probe_decay = probe_decay
        # seq_id -> decayed counts [accepted, trials] at position 1, [accepted, trials] at later
        # positions reached, [hits, asks] of the drafter
        self.counts: dict[int, list[float]] = {}
        # (bucket, drafting) -> running mean of step seconds beyond the calibrated forward
        self.overhead: dict[tuple[int, bool], float] = {}
        self.token_cost = 0.0       # running mean of host seconds per token a step yields

    @property
    def is_timed(self) -> bool:
        """Whether step costs were calibrated: without them observe_step and observe_tokens learn nothing."""
        return bool(self.buckets)

    def _counts(self, seq_id: int) -> list[float]:
        return self.counts.get(seq_id) or [*self.prior, 0.0, 0.0]

    def acceptance(self, seq_id: int) -> float:
        """P(first drafted token accepted)."""
        accepted, trials = self._counts(seq_id)[:2]
        return accepted / trials

    def follow_rate(self, seq_id: int) -> float:
        """P(a drafted token accepted | the one before it was)."""
        accepted, trials = self._counts(seq_id)[2:4]
        return accepted / trials

    def hit_rate(self, seq_id: int) -> float:
        """Share of asks for which the drafter had a draft (1 until the sequence was asked)."""
        hits, asks = self._counts(seq_id)[4:]
        return hits / asks if asks else 1.0

    def _bucket(self, batch_size: int) -> int:
        return self.buckets[min(bisect.bisect_left(self.buckets, batch_size), len(self.buckets) - 1)]

    def step_cost(self, batch_size: int, tokens: int) -> float:
        """Expected seconds of a step of batch_size rows holding `tokens` tokens in all: the
        calibrated forward (between the curve's points) plus the measured overhead."""
        if not self.buckets:
            return 1.0
        b = self._bucket(batch_size)
        x = tokens - batch_size if self.packed else tokens / batch_size
        return _interpolate(self.curves[b], x) + self.overhead.get((b, tokens > batch_size), 0.0)

    def cost_ratio(self, batch_size: int, num_draft: int) -> float:
        """A step drafting num_draft tokens in every row against a plain step."""
        return self.step_cost(batch_size, batch_size * (1 + num_draft)) / self.step_cost(batch_size, batch_size)

    def _gains(self, seq_ids: list[int], available: list[int] | None) -> list[list[float]]:
        """gains[i][j-1]: expected tokens that row i's j-th drafted token adds, P_i(>= j).
        available[i], when the drafts are already known, is how many tokens row i has (a row
        without a draft gains nothing); otherwise a row's gain is weighted by its hit rate."""
        gains = []
        for i, s in enumerate(seq_ids):
            follow = min(self.follow_rate(s), 0.99)
            reach = min(self.acceptance(s), 0.99) * (1.0 if available is not None else self.hit_rate(s))
            row = []
            for _ in range(self.max_draft if available is None else min(self.max_draft, available[i])):
                row.append(reach)
                reach *= follow
            gains.append(row)
        return gains

    def num_draft(self, seq_ids: list[int], batch_size: int, available: list[int] | None = None) -> int:
        """One draft length for the speculating sequences of a batch of batch_size rows: the k
        maximising sum_i E_i(k) / c(batch, k), against batch_size tokens for a plain step (which
        wins unless drafting promises MIN_GAIN more). Rows that do not speculate yield one token
        whatever k is. The step is charged as b rows of 1 + k tokens even where rows are packed
        and rows without a draft cost less: charging packed rows only what they hold drafted more
        and served worse (0.94x of plain at 16 clients, against 1.00x with this rule)."""
        gains = self._gains(seq_ids, available)
        expected = float(batch_size)
        best_k, best_rate = 0, MIN_GAIN * self._rate(batch_size, batch_size, expected)
        for k in range(1, max(map(len, gains), default=0) + 1):
            expected += sum(row[k - 1] for row in gains if len(row) >= k)
            rate = self._rate(batch_size, batch_size * (1 + k), expected)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def draft_lengths(self, seq_ids: list[int], batch_size: int, available: list[int] | None = None) -> list[int]:
        """num_draft's one length, cut to what each sequence has (available) or may draft. One
        length rather than the most promising tokens of each row: with a length per row, rows
        whose acceptance was estimated from a few steps (or relaxed toward the prior while they
        did not draft) drafted on their own, and serving at 16 clients measured 0.92x of plain
        against 1.00x with one length (docs/BENCHMARKS.md)."""
        k = self.num_draft(seq_ids, batch_size, available)
        return [min(k, n) for n in (available or [self.max_draft] * len(seq_ids))]

    def _rate(self, batch_size: int, tokens: int, expected: float) -> float:
        """Expected tokens per second of a step of `tokens` tokens yielding `expected` tokens."""
        return expected / (self.step_cost(batch_size, tokens) + expected * self.token_cost)

    def observe(self, seq_id: int, asked: int, num_draft: int, num_accepted: int) -> None:
        """After a step that asked the drafter for `asked` tokens and verified num_draft of them.
        Acceptance counts decay so the estimate follows the sequence's recent behaviour. A step
        that asked for nothing carries no evidence: the estimate relaxes toward the prior instead,
        so a sequence whose drafting was switched off is probed again after a few steps (without
        this, one bad stretch would end speculation for the rest of the sequence)."""
        acc1, trials1, accf, trialsf, hits, asks = self._counts(seq_id)
        d, p = self.decay, self.prior
        if asked == 0:
            self.counts[seq_id] = [acc1 * d + p[0] * (1 - d), trials1 * d + p[1] * (1 - d),
                                   accf * d + p[2] * (1 - d), trialsf * d + p[3] * (1 - d),
                                   hits * d + (1 - d), asks * d + (1 - d)]
            return
        hits, asks = hits * d + (num_draft > 0), asks * d + 1
        if num_draft:
            acc1, trials1 = acc1 * d + (num_accepted > 0), trials1 * d + 1
            # later positions reached: 2..num_accepted + 1 (a rejection ends the draft)
            reached = min(num_accepted + 1, num_draft) - 1
            if reached > 0:
                accf, trialsf = accf * d + num_accepted - 1, trialsf * d + reached
        self.counts[seq_id] = [acc1, trials1, accf, trialsf, hits, asks]

    def observe_step(self, batch_size: int, tokens: int, seconds: float) -> None:
        """A decode step of batch_size rows holding `tokens` tokens in all took `seconds` (propose
        through the host sync). What it took beyond the calibrated forward is the overhead that
        start-up timing cannot see: drafting, acceptance math, launches, longer contexts. One slow
        step (a first call, a collection pause) counts as at most a few forwards, and plain steps
        pull the drafting overhead toward the plain one, so a bad estimate is probed again rather
        than ending speculation for good."""
        if not self.buckets:
            return
        b, drafting = self._bucket(batch_size), tokens > batch_size
        forward = self.step_cost(batch_size, tokens) - self.overhead.get((b, drafting), 0.0)
        extra = min(seconds - forward, OUTLIER_FORWARDS * forward)
        self._update((b, drafting), extra, self.step_decay)
        if not drafting and (b, True) in self.overhead:
            self._update((b, True), self.overhead[(b, False)], self.probe_decay)

    def observe_tokens(self, num_tokens: int, seconds: float) -> None:
        """A step's host work on its num_tokens new tokens took `seconds`. It grows with the
        tokens a step yields, so where it is large (many rows, a fast device) drafting gains less."""
        if self.buckets and num_tokens:
            d = self.step_decay
            self.token_cost = d * self.token_cost + (1 - d) * seconds / num_tokens

    def _update(self, key: tuple[int, bool], value: float, decay: float) -> None:
        old = self.overhead.get(key)
        self.overhead[key] = value if old is None else decay * old + (1 - decay) * value

    def end(self, seq_id: int) -> None:
        self.counts.pop(seq_id, None)


def _interpolate(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear y(x) through points sorted by x, held at the ends."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (x - x0) / (x1 - x0) * (y1 - y0)
    return points[-1][1]
