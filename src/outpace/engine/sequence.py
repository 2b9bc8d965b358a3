"""Sequence: one request's tokens and bookkeeping. Plain Python; no torch."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from outpace.config import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


def add_lists(a: list[int], b: list[int]) -> list[int]:
    """Element-wise sum, the shorter list padded with zeros."""
    n = max(len(a), len(b))
    return [x + y for x, y in zip(a + [0] * (n - len(a)), b + [0] * (n - len(b)))]


@dataclass
class SpecStats:
    """Speculation counters of one request (summed over requests for totals)."""

    num_verify_steps: int = 0       # target forwards that produced tokens for this sequence
    num_drafts: int = 0             # verify steps that carried a non-empty draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)     # drafted tokens accepted at position i
    drafted_per_position: list[int] = field(default_factory=list)      # drafts that reached position i
    draft_s: float = 0.0
    verify_s: float = 0.0

    def record(self, num_draft: int, num_accepted: int) -> None:
        self.num_verify_steps += 1
        if num_draft:
            self.num_drafts += 1
            self.num_draft_tokens += num_draft
            self.num_accepted_tokens += num_accepted
            if len(self.accepted_per_position) < num_draft:
                self.accepted_per_position += [0] * (num_draft - len(self.accepted_per_position))
                self.drafted_per_position += [0] * (num_draft - len(self.drafted_per_position))
            for i in range(num_draft):
                self.drafted_per_position[i] += 1
            for i in range(num_accepted):
                self.accepted_per_position[i] += 1

    def add(self, other: "SpecStats") -> None:
        for name in ("num_verify_steps", "num_drafts", "num_draft_tokens", "num_accepted_tokens",
                     "draft_s", "verify_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.accepted_per_position = add_lists(self.accepted_per_position, other.accepted_per_position)
        self.drafted_per_position = add_lists(self.drafted_per_position, other.drafted_per_position)

    def as_dict(self, total_s: float | None = None) -> dict:
        steps = self.num_verify_steps
        d = {
            "num_verify_steps": steps,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0,
            # vLLM/SGLang convention: tokens gained per verify step, the target's own token included
            "mean_acceptance_length": (self.num_accepted_tokens + steps) / steps if steps else 0.0,
            "accepted_per_position": list(self.accepted_per_position),
            "acceptance_per_position": [a / self.num_drafts if self.num_drafts else 0.0
                                        for a in self.accepted_per_position],
            "drafted_per_position": list(self.drafted_per_position),
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
        }
        if total_s is not None:
            d["other_s"] = max(total_s - self.draft_s - self.verify_s, 0.0)
        return d


class Sequence:
    def __init__(self, seq_id: int, prompt_ids: list[int], params: SamplingParams, arrival: float | None = None):
        self.seq_id = seq_id
        self.prompt_ids = list(prompt_ids)
        self.token_ids = list(prompt_ids)   # prompt plus output: the one buffer drafters read too
        self.params = params
        self.status = Status.WAITING
        self.slot: int | None = None
        self.num_cached = 0                 # tokens whose keys/values are in the cache
        self.reuse_prefix = False           # may start from a freed slot's kept prefix (set by the engine)
        self.cache_salt = ""                # only kept prefixes of the same salt are reused
        self.num_reused = 0                 # prompt tokens found cached in its slot (prefix caching)
        self.finish_reason: str | None = None
        self.stats = SpecStats()
        self.seed: int | None = None        # the sampling seed (sampling.sampler.request_seed), set by the engine
        self.speculate = False              # drafts for this sequence (set by the engine)
        self.stopper = None                 # engine.stopping.StopChecker, set by the engine
        self.shaping = None                 # sampling.penalties.ShapingColumns, where params shape logits
        self.arrival = time.perf_counter() if arrival is None else arrival
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.prefill_s = 0.0
        self.text = ""                      # detokenized output, stop strings applied
        # one {token: Logprob} per output token where params.logprobs asks (sampling/logprobs.py)
        self.logprobs: list[dict] | None = [] if params.logprobs is not None else None
        # where params.prompt_logprobs asks: None for the first prompt token, then one entry a token
        self.prompt_logprobs: list[dict | None] | None = [None] if params.prompt_logprobs is not None else None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def is_prefilling(self) -> bool:
        # the last token is always left uncached: it is the input of the next decode step
        return self.num_cached < len(self.token_ids) - 1

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED
