"""Prometheus-visible actor metrics through `ray.util.metrics` (no-ops outside a Ray worker)."""

from __future__ import annotations

from dsv4batch.jobspec.stats import BatchStats

# forward-step latency buckets, seconds: 1 ms .. 60 s
STEP_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]


class ActorTelemetry:
    """Counters for rows and tokens, a histogram of forward-step latency per batch."""

    def __init__(self, model_name: str):
        self.enabled = False
        try:
            import ray
            from ray.util import metrics

            if not ray.is_initialized():
                return
            tags = {"model": model_name}
            self.rows = metrics.Counter("dsv4batch_rows", "Rows answered by scoring actors.",
                                        tag_keys=("model", "status"))
            self.tokens = metrics.Counter("dsv4batch_tokens", "Tokens fed (input) and scored.",
                                          tag_keys=("model", "kind"))
            self.steps = metrics.Counter("dsv4batch_forward_steps", "Forward steps run.",
                                         tag_keys=("model",))
            self.step_latency = metrics.Histogram(
                "dsv4batch_step_latency_s", "Forward-step latency (batch forward time / steps).",
                boundaries=STEP_BUCKETS, tag_keys=("model",))
            for m in (self.rows, self.tokens, self.steps, self.step_latency):
                m.set_default_tags(tags)
            self.enabled = True
        except Exception:  # metrics are best effort: never fail a batch for them
            self.enabled = False

    def record(self, stats: BatchStats) -> None:
        if not self.enabled:
            return
        try:
            _inc(self.rows, stats.rows_scored, {"status": "scored"})
            _inc(self.rows, stats.rows_errored, {"status": "error"})
            _inc(self.tokens, stats.input_tokens, {"kind": "input"})
            _inc(self.tokens, stats.scored_tokens, {"kind": "scored"})
            if stats.num_steps:
                _inc(self.steps, stats.num_steps)
                per_step = stats.forward_s / stats.num_steps
                for _ in range(min(stats.num_steps, 64)):
                    self.step_latency.observe(per_step)
        except Exception:
            pass


def _inc(counter, value, tags=None) -> None:
    if value > 0:  # ray.util.metrics.Counter.inc rejects 0
        counter.inc(value, tags)
