"""DraftController: how many tokens to draft for each sequence, from measured acceptance and cost.

With a per-token acceptance probability a (a sequence's running estimate) and k drafted tokens,
a verify step yields E(k) = 1 + a + a^2 + ... + a^k tokens (accepted prefix plus the target's
own), and costs c(k) = T(batch, 1 + k) / T(batch, 1) plain steps, T measured at start-up. The
controller drafts the k in [0, max_draft] maximising E(k) / c(k), summed over a batch's rows (a
step costs what its longest row costs); k = 0 is a plain step, so speculation that does not pay
does not run.
"""
from __future__ import annotations

import bisect


class DraftController:
    def __init__(self, max_draft: int, cost: dict[int, list[float]] | None = None,
                 prior_accepted: float = 1.0, prior_drafted: float = 2.0, decay: float = 0.9):
        """cost[b][s-1]: forward time of a batch of b rows of s tokens (any unit); None = flat."""
        self.max_draft = max_draft
        self.cost = cost or {}
        self.buckets = sorted(self.cost)
        self.prior = (prior_accepted, prior_drafted)
        self.decay = decay
        self.counts: dict[int, list[float]] = {}   # seq_id -> [accepted, drafted], decayed sums

    def acceptance(self, seq_id: int) -> float:
        accepted, drafted = self.counts.get(seq_id, self.prior)
        return accepted / drafted if drafted else 0.0

    def cost_ratio(self, batch_size: int, num_draft: int) -> float:
        if not self.buckets:
            return 1.0
        i = min(bisect.bisect_left(self.buckets, batch_size), len(self.buckets) - 1)
        curve = self.cost[self.buckets[i]]
        return curve[min(num_draft, len(curve) - 1)] / curve[0]

    def num_draft(self, seq_ids: list[int], batch_size: int) -> int:
        """One draft length for the speculating sequences of a batch of batch_size rows. A step's
        cost is set by its longest row, so the k chosen maximises the batch's expected tokens
        per unit of cost: sum_i E_i(k) / c(batch, k), against batch_size tokens for a plain step.
        Rows that do not speculate yield one token whatever k is."""
        rates = [min(self.acceptance(s), 0.99) for s in seq_ids]
        powers = [1.0] * len(rates)
        expected = float(batch_size)
        best_k, best_rate = 0, float(batch_size)
        for k in range(1, self.max_draft + 1):
            for i, a in enumerate(rates):
                powers[i] *= a
                expected += powers[i]
            rate = expected / self.cost_ratio(batch_size, k)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def observe(self, seq_id: int, num_draft: int, num_accepted: int) -> None:
        """Acceptance counts decay so the estimate follows the sequence's recent behaviour. A step
        without a draft carries no evidence: the estimate relaxes toward the prior instead, so a
        sequence whose drafting was switched off is probed again after a few steps (without
        this, one bad stretch would end speculation for the rest of the sequence)."""
        accepted, drafted = self.counts.get(seq_id, self.prior)
        if num_draft == 0:
            keep = self.decay
            self.counts[seq_id] = [accepted * keep + self.prior[0] * (1 - keep),
                                   drafted * keep + self.prior[1] * (1 - keep)]
            return
        # a rejection at position i says nothing about positions after i: count i + 1 trials
        trials = min(num_accepted + 1, num_draft)
        self.counts[seq_id] = [accepted * self.decay + num_accepted, drafted * self.decay + trials]

    def end(self, seq_id: int) -> None:
        self.counts.pop(seq_id, None)
