"""GET /metrics: Prometheus text, with vLLM's metric names (its dashboards read them as they are):
requests running and waiting (read from the scheduler at scrape time), prompt and generation
token counters, time to first token and per-output-token latency, finished requests, and the
speculation counters (`vllm:spec_decode_*`) fed from each request's final turbo.sequence.stats.Stats;
and turbo's own (`turbo:`): the prefix cache's bytes and snapshots, and the bytes the snapshots kept
added (each its GDN + conv state, its drafter's context and the K/V rows it brought) by the kind of mark.
"""

from __future__ import annotations

import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from ..sequence.stats import Stats
from ..sequence.stops import Finish

disable_created_metrics()  # no *_created series (as vLLM)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)


class Metrics:
    """One server's (one Ray replica's) metrics, in a registry of its own."""

    def __init__(self, model: str, gauges: Callable[[], object]):
        self.registry = r = CollectorRegistry()
        labels, self.model = ["model_name"], model

        def gauge(name: str, doc: str, attr: str) -> None:
            Gauge(name, doc, labels, registry=r).labels(model).set_function(lambda: getattr(gauges(), attr))

        gauge("vllm:num_requests_running", "Requests in the running batch.", "running")
        gauge("vllm:num_requests_waiting", "Requests waiting to be admitted.", "waiting")
        gauge("turbo:prefix_cache_bytes", "Bytes the prefix cache's snapshots hold.", "cache_bytes")
        gauge("turbo:prefix_cache_entries", "Snapshots in the prefix cache.", "cache_entries")
        r.register(KeptBytes(model, gauges))
        self.prompt = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests.", labels, registry=r)
        self.generated = Counter("vllm:generation_tokens", "Generated tokens.", labels, registry=r)
        self.cached = Counter("vllm:prefix_cache_hits", "Prompt tokens served by the prefix cache.", labels,
                              registry=r)
        self.success = Counter("vllm:request_success", "Finished requests.", labels + ["finished_reason"],
                               registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to the first token.", labels,
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Time per output token after the first.",
                              labels, buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Time from arrival to the last token.", labels,
                             buckets=TTFT_BUCKETS, registry=r)
        self.drafts = Counter("vllm:spec_decode_num_drafts", "Rounds that drafted proposals.", labels, registry=r)
        self.draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Proposals drafted.", labels, registry=r)
        self.accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Proposals accepted.", labels, registry=r)
        self.per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Proposals accepted at each position.",
                               labels + ["position"], registry=r)

    def text(self) -> bytes:
        return generate_latest(self.registry)

    def request(self) -> "Timing":
        return Timing(self)

    def finished(self, stats: Stats | None, finish: Finish | None, cached: int, timing: "Timing") -> None:
        m = self.model
        self.success.labels(m, finish.reason if finish is not None else "abort").inc()
        if timing.first is not None:
            self.e2e.labels(m).observe(timing.last - timing.start)
            if timing.tokens > 1:
                self.tpot.labels(m).observe((timing.last - timing.first) / (timing.tokens - 1))
        self.cached.labels(m).inc(cached)
        if stats is None:
            return
        self.prompt.labels(m).inc(stats.prompt_tokens)
        self.drafts.labels(m).inc(stats.reached[0] if stats.reached else 0)  # rounds that judged a proposal
        self.draft_tokens.labels(m).inc(stats.drafted)
        self.accepted.labels(m).inc(stats.accepted)
        for i, n in enumerate(stats.landed):
            self.per_pos.labels(m, str(i)).inc(n)


class KeptBytes(Collector):
    """turbo:prefix_cache_kept_bytes_total{kind}: the bytes the snapshots the prefix cache kept added,
    by the kind of mark each was kept at (read from the scheduler's keeper at scrape time)."""

    def __init__(self, model: str, gauges: Callable[[], object]):
        self.model, self.gauges = model, gauges

    def collect(self):
        family = CounterMetricFamily("turbo:prefix_cache_kept_bytes", "Bytes the snapshots kept added, by the "
                                     "kind of mark (system, tools, turn, chunk, prompt, answer).",
                                     labels=["model_name", "kind"])
        for kind, n in sorted(self.gauges().kept_bytes.items()):
            family.add_metric([self.model, kind], n)
        yield family


class Timing:
    """One request's clock: arrival, first and last token, tokens seen."""

    def __init__(self, metrics: Metrics):
        self.metrics, self.start, self.first, self.last, self.tokens = metrics, time.perf_counter(), None, 0.0, 0

    def tokens_out(self, n: int) -> None:
        if not n:
            return
        self.last = time.perf_counter()
        if self.first is None:
            self.first = self.last
            self.metrics.ttft.labels(self.metrics.model).observe(self.first - self.start)
        self.tokens += n
        self.metrics.generated.labels(self.metrics.model).inc(n)
