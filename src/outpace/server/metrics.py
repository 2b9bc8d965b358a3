"""Server metrics, exposed in Prometheus' text format by prometheus_client, plus the per-request
log line and the periodic summary.

Updated by the engine thread (tokens, finished requests) and the handlers (rejected requests), read
by /metrics; prometheus_client's metrics are thread-safe. Each Metrics has a registry of its own,
so several servers can live in one process (the tests run them). Speculation counters follow
vLLM's names (spec_decode_num_drafts, ..._num_draft_tokens, ..._num_accepted_tokens, ..._per_pos)
so existing dashboards read them.
"""
from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

log = logging.getLogger("outpace.server")

PREFIX = "outpace:"
CONTENT_TYPE = CONTENT_TYPE_LATEST
STATUSES = ("stop", "length", "abort", "error", "rejected")
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class Metrics:
    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()

        def make(kind, name: str, help: str, labels: tuple[str, ...] = (), **options):
            return kind(PREFIX + name, help, ("model_name", *labels), registry=self.registry, **options)

        self.running = make(Gauge, "num_requests_running", "Requests holding a slot.")
        self.waiting = make(Gauge, "num_requests_waiting", "Requests queued for a slot.")
        self.requests = make(Counter, "requests", "Requests by final status (rejected: 4xx).", ("status",))
        self.prompt_tokens = make(Counter, "prompt_tokens", "Prompt tokens of accepted requests.")
        self.cached_tokens = make(Counter, "prompt_tokens_cached",
                                  "Prompt tokens found cached from an earlier or a running request "
                                  "(prefix caching and sharing).")
        self.generation_tokens = make(Counter, "generation_tokens", "Output tokens generated.")
        self.ttft = make(Histogram, "time_to_first_token_seconds", "Time from arrival to the first output token.",
                         buckets=TTFT_BUCKETS)
        self.tpot = make(Histogram, "time_per_output_token_seconds",
                         "Mean time between output tokens after the first, per request.", buckets=TPOT_BUCKETS)
        self.latency = make(Histogram, "e2e_request_latency_seconds", "Time from arrival to the last output token.",
                            buckets=LATENCY_BUCKETS)
        self.drafts = make(Counter, "spec_decode_num_drafts", "Verify steps that carried a draft.")
        self.draft_tokens = make(Counter, "spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.accepted_tokens = make(Counter, "spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_pos = make(Counter, "spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted at each draft position.", ("position",))
        for status in STATUSES:                 # every status reads 0 from the start
            self.requests.labels(model_name, status)
        for metric in (self.running, self.waiting, self.prompt_tokens, self.cached_tokens, self.generation_tokens,
                       self.ttft, self.tpot, self.latency, self.drafts, self.draft_tokens, self.accepted_tokens):
            metric.labels(model_name)
        self._window = self._totals()          # counters at the last summary
        self._window_start = time.monotonic()

    # ---- updates ----------------------------------------------------------------------------
    def on_add(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.labels(self.model_name).inc(num_prompt_tokens)

    def on_tokens(self, num_tokens: int) -> None:
        self.generation_tokens.labels(self.model_name).inc(num_tokens)

    def on_rejected(self) -> None:
        self.requests.labels(self.model_name, "rejected").inc()

    def on_finish(self, request_id: str, seq, status: str, arrival: float) -> None:
        """A request left the engine (finished, aborted or failed): count it and log one line."""
        end = seq.finish_time or time.perf_counter()
        n = seq.num_output_tokens
        stats = seq.stats
        model = self.model_name
        self.cached_tokens.labels(model).inc(seq.num_reused)
        self.drafts.labels(model).inc(stats.num_drafts)
        self.draft_tokens.labels(model).inc(stats.num_draft_tokens)
        self.accepted_tokens.labels(model).inc(stats.num_accepted_tokens)
        for position, accepted in enumerate(stats.accepted_per_position):
            self.accepted_per_pos.labels(model, str(position)).inc(accepted)
        if seq.first_token_time is not None:
            self.ttft.labels(model).observe(seq.first_token_time - arrival)
            self.latency.labels(model).observe(end - arrival)
            if n > 1:
                self.tpot.labels(model).observe((end - seq.first_token_time) / (n - 1))
        self.requests.labels(model, status).inc()   # last: a finished request's figures are all in
        ttft = f"{seq.first_token_time - arrival:.3f} s" if seq.first_token_time else "none"
        rate = stats.num_accepted_tokens / stats.num_draft_tokens if stats.num_draft_tokens else 0.0
        log.info("%s %s: %d prompt (%d cached) + %d output tokens in %.2f s (ttft %s); drafted %d, accepted %d "
                 "(%.0f%%), mean acceptance length %.2f", request_id, status, seq.num_prompt_tokens, seq.num_reused, n,
                 end - arrival, ttft, stats.num_draft_tokens, stats.num_accepted_tokens, 100 * rate,
                 stats.as_dict()["mean_acceptance_length"])

    # ---- reading ----------------------------------------------------------------------------
    def render(self, num_running: int, num_waiting: int) -> bytes:
        """The exposition text, with the gauges set to the engine's last published counts."""
        self.running.labels(self.model_name).set(num_running)
        self.waiting.labels(self.model_name).set(num_waiting)
        return generate_latest(self.registry)

    def value(self, name: str, **labels: str) -> float:
        """A sample's value, e.g. value("requests_total", status="stop")."""
        found = self.registry.get_sample_value(PREFIX + name, {"model_name": self.model_name, **labels})
        return found or 0.0

    def log_summary(self, num_running: int, num_waiting: int) -> None:
        """One line on the last interval; silent when nothing happened and nothing is pending."""
        now, totals = time.monotonic(), self._totals()
        finished, prompt, generated, drafted, accepted = (a - b for a, b in zip(totals, self._window))
        elapsed = max(now - self._window_start, 1e-9)
        self._window, self._window_start = totals, now
        if not (finished or generated or num_running or num_waiting):
            return
        log.info("running %d, waiting %d; last %.0f s: %d finished, prompt %.1f tokens/s, generation %.1f tokens/s, "
                 "draft acceptance %.0f%%", num_running, num_waiting, elapsed, finished, prompt / elapsed,
                 generated / elapsed, 100 * accepted / drafted if drafted else 0.0)

    def _totals(self) -> tuple[float, ...]:
        finished = sum(self.value("requests_total", status=s) for s in STATUSES if s != "rejected")
        return (finished, self.value("prompt_tokens_total"), self.value("generation_tokens_total"),
                self.value("spec_decode_num_draft_tokens_total"), self.value("spec_decode_num_accepted_tokens_total"))
