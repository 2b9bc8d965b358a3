"""Server metrics in Prometheus text format (exposition format 0.0.4), written by hand, plus the
per-request log line and the periodic summary.

Updated by the engine thread (tokens, finished requests) and the handlers (rejected requests), read
by /metrics: one lock guards every field. Speculation counters follow vLLM's names
(spec_decode_num_drafts, ..._num_draft_tokens, ..._num_accepted_tokens, ..._per_pos) so existing
dashboards read them.
"""
from __future__ import annotations

import bisect
import logging
import threading
import time

log = logging.getLogger("outpace.server")

PREFIX = "outpace:"
STATUSES = ("stop", "length", "abort", "error", "rejected")
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class Histogram:
    def __init__(self, name: str, help: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = PREFIX + name, help, buckets
        self.counts = [0] * (len(buckets) + 1)     # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def render(self, labels: str) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        total = 0
        for bound, count in zip([*map(repr, self.buckets), "+Inf"], self.counts):
            total += count
            lines.append(f'{self.name}_bucket{{{labels},le="{bound}"}} {total}')
        lines += [f"{self.name}_sum{{{labels}}} {self.sum!r}", f"{self.name}_count{{{labels}}} {total}"]
        return lines


class Metrics:
    def __init__(self, model_name: str):
        self.labels = f'model_name="{_escape(model_name)}"'
        self.lock = threading.Lock()
        self.requests = dict.fromkeys(STATUSES, 0)
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos: list[int] = []
        self.ttft = Histogram("time_to_first_token_seconds", "Time from arrival to the first output token.",
                              TTFT_BUCKETS)
        self.tpot = Histogram("time_per_output_token_seconds",
                              "Mean time between output tokens after the first, per request.", TPOT_BUCKETS)
        self.latency = Histogram("e2e_request_latency_seconds", "Time from arrival to the last output token.",
                                 LATENCY_BUCKETS)
        self._window = self._totals()          # counters at the last summary
        self._window_start = time.monotonic()

    # ---- updates ----------------------------------------------------------------------------
    def on_add(self, num_prompt_tokens: int) -> None:
        with self.lock:
            self.num_prompt_tokens += num_prompt_tokens

    def on_tokens(self, num_tokens: int) -> None:
        with self.lock:
            self.num_generation_tokens += num_tokens

    def on_rejected(self) -> None:
        with self.lock:
            self.requests["rejected"] += 1

    def on_finish(self, request_id: str, seq, status: str, arrival: float) -> None:
        """A request left the engine (finished, aborted or failed): count it and log one line."""
        end = seq.finish_time or time.perf_counter()
        n = seq.num_output_tokens
        stats = seq.stats
        with self.lock:
            self.requests[status] += 1
            self.num_drafts += stats.num_drafts
            self.num_draft_tokens += stats.num_draft_tokens
            self.num_accepted_tokens += stats.num_accepted_tokens
            extra = len(stats.accepted_per_position) - len(self.accepted_per_pos)
            self.accepted_per_pos += [0] * max(extra, 0)
            for i, accepted in enumerate(stats.accepted_per_position):
                self.accepted_per_pos[i] += accepted
            if seq.first_token_time is not None:
                self.ttft.observe(seq.first_token_time - arrival)
                self.latency.observe(end - arrival)
                if n > 1:
                    self.tpot.observe((end - seq.first_token_time) / (n - 1))
        ttft = f"{seq.first_token_time - arrival:.3f} s" if seq.first_token_time else "none"
        rate = stats.num_accepted_tokens / stats.num_draft_tokens if stats.num_draft_tokens else 0.0
        log.info("%s %s: %d prompt + %d output tokens in %.2f s (ttft %s); drafted %d, accepted %d (%.0f%%), "
                 "mean acceptance length %.2f", request_id, status, seq.num_prompt_tokens, n, end - arrival, ttft,
                 stats.num_draft_tokens, stats.num_accepted_tokens, 100 * rate,
                 stats.as_dict()["mean_acceptance_length"])

    # ---- reading ----------------------------------------------------------------------------
    def render(self, num_running: int, num_waiting: int) -> str:
        L = self.labels
        with self.lock:
            lines = [*_metric("num_requests_running", "gauge", "Requests holding a slot.", [(L, num_running)]),
                     *_metric("num_requests_waiting", "gauge", "Requests queued for a slot.", [(L, num_waiting)]),
                     *_metric("requests_total", "counter", "Requests by final status (rejected: 4xx).",
                              [(f'{L},status="{s}"', n) for s, n in self.requests.items()]),
                     *_metric("prompt_tokens_total", "counter", "Prompt tokens of accepted requests.",
                              [(L, self.num_prompt_tokens)]),
                     *_metric("generation_tokens_total", "counter", "Output tokens generated.",
                              [(L, self.num_generation_tokens)]),
                     *self.ttft.render(L), *self.tpot.render(L), *self.latency.render(L),
                     *_metric("spec_decode_num_drafts_total", "counter", "Verify steps that carried a draft.",
                              [(L, self.num_drafts)]),
                     *_metric("spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed.",
                              [(L, self.num_draft_tokens)]),
                     *_metric("spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.",
                              [(L, self.num_accepted_tokens)]),
                     *_metric("spec_decode_num_accepted_tokens_per_pos_total", "counter",
                              "Draft tokens accepted at each draft position.",
                              [(f'{L},position="{i}"', n) for i, n in enumerate(self.accepted_per_pos)])]
        return "\n".join(lines) + "\n"

    def log_summary(self, num_running: int, num_waiting: int) -> None:
        """One line on the last interval; silent when nothing happened and nothing is pending."""
        with self.lock:
            now, totals = time.monotonic(), self._totals()
        finished, prompt, generated, drafted, accepted = (a - b for a, b in zip(totals, self._window))
        elapsed = max(now - self._window_start, 1e-9)
        self._window, self._window_start = totals, now
        if not (finished or generated or num_running or num_waiting):
            return
        log.info("running %d, waiting %d; last %.0f s: %d finished, prompt %.1f tokens/s, generation %.1f tokens/s, "
                 "draft acceptance %.0f%%", num_running, num_waiting, elapsed, finished, prompt / elapsed,
                 generated / elapsed, 100 * accepted / drafted if drafted else 0.0)

    def _totals(self) -> tuple[int, ...]:
        finished = sum(n for s, n in self.requests.items() if s != "rejected")
        return (finished, self.num_prompt_tokens, self.num_generation_tokens, self.num_draft_tokens,
                self.num_accepted_tokens)


def _metric(name: str, kind: str, help: str, samples: list[tuple[str, float]]) -> list[str]:
    name = PREFIX + name
    return [f"# HELP {name} {help}", f"# TYPE {name} {kind}", *(f"{name}{{{labels}}} {value}" for labels, value in samples)]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
