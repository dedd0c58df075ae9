"""GET /metrics of `kvedge serve`, in Prometheus' text format (prometheus_client, one registry per server)."""

from __future__ import annotations

from kvedge.errors import require

# seconds; a CPU decode step is milliseconds to tenths of a second, a first token up to many seconds
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self):
        pc = require("prometheus_client", "serve", "kvedge serve")
        self._pc = pc
        self.registry = r = pc.CollectorRegistry()
        self.requests = pc.Counter("kvedge_requests", "Requests by outcome: stop, length (finished), cancelled "
                                   "(client gone), error, rejected (429: queue full), invalid (4xx)",
                                   ["outcome"], registry=r)
        self.prompt_tokens = pc.Counter("kvedge_prompt_tokens", "Prompt tokens of the requests run", registry=r)
        self.completion_tokens = pc.Counter("kvedge_completion_tokens", "Tokens generated", registry=r)
        self.queue_depth = pc.Gauge("kvedge_queue_depth", "Requests waiting for a cache row", registry=r)
        self.running = pc.Gauge("kvedge_running_rows", "Cache rows holding a request", registry=r)
        self.ttft = pc.Histogram("kvedge_time_to_first_token_seconds", "From a request's arrival to its first "
                                 "token", buckets=LATENCY_BUCKETS, registry=r)
        self.itl = pc.Histogram("kvedge_inter_token_latency_seconds", "Between a request's consecutive tokens",
                                buckets=LATENCY_BUCKETS, registry=r)

    def watch(self, scheduler) -> None:
        """Read the queue depth and the rows in use from the scheduler when scraped."""
        self.queue_depth.set_function(lambda: len(scheduler.waiting))
        self.running.set_function(lambda: scheduler.running)

    def token(self, seconds: float, first: bool) -> None:
        (self.ttft if first else self.itl).observe(seconds)

    def finished(self, job, outcome: str) -> None:
        self.requests.labels(outcome).inc()
        self.prompt_tokens.inc(job.filled)
        self.completion_tokens.inc(len(job.out.tokens) if job.out else 0)

    def refused(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()

    def render(self) -> tuple[bytes, str]:
        return self._pc.generate_latest(self.registry), self._pc.CONTENT_TYPE_LATEST
