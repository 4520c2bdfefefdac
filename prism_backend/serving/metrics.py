"""Standing metrics of the decision step, all named `prism_...`.

Written against a tiny factory interface so that this module needs no Triton: the adapter passes
`make_family(name, description, kind)` returning an object with `.Metric(labels=..., buckets=...)`
(exactly `pb_utils.MetricFamily`), and the tests pass a fake.
"""
from __future__ import annotations

from ..forest import ForestStats
from ..engine.prefix_cache import PrefixCache

BATCH_BUCKETS = [1, 2, 4, 8, 16, 32, 64]
LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10]


class EngineMetrics:
    def __init__(self, make_family, labels: dict[str, str]):
        # Triton requires each family to outlive its metrics: keep them, and drop metrics first.
        self._families = []

        def metric(name, description, kind, buckets=None):
            family = make_family(name, description, kind)
            self._families.append(family)
            return family.Metric(labels=labels, buckets=buckets) if buckets else family.Metric(labels=labels)

        self.requests = metric("prism_requests_total", "Decision requests scored successfully", "counter")
        self.request_errors = metric("prism_request_errors_total", "Decision requests rejected as invalid", "counter")
        self.tasks = metric("prism_tasks_total", "Decisions (tasks) scored", "counter")
        self.fallbacks = metric("prism_fallback_tasks_total",
                                "Tasks scored over the full vocabulary (more candidates than the cap)", "counter")
        self.tokens_computed = metric("prism_tokens_computed_total", "Unique prompt tokens run through the model",
                                      "counter")
        self.tokens_generic = metric("prism_tokens_generic_total",
                                     "Prompt tokens a per-question generic path would have run", "counter")
        self.hit_rate = metric("prism_shared_prefix_hit_rate",
                               "Tokens saved by shared prefixes over tokens a generic path computes (cumulative)",
                               "gauge")
        self.candidates_per_task = metric("prism_candidates_per_task", "Average candidates per task (cumulative)",
                                          "gauge")
        self.self_check = metric("prism_determinism_self_check",
                                 "1 when the startup batch-invariance check matched bit for bit, else 0", "gauge")
        self.available = metric("prism_engine_available",
                                "1 while the engine can score; 0 once a tensor-parallel worker has died", "gauge")
        self.available.set(1.0)
        self.batch_size = metric("prism_execution_batch_size", "Requests per execute() (one forest)", "histogram",
                                 BATCH_BUCKETS)
        self.latency = metric("prism_execution_seconds", "Wall time of one execute(): forest, forward, scoring",
                              "histogram", LATENCY_BUCKETS)
        self.cache_tokens_reused = metric("prism_prefix_cache_tokens_reused_total",
                                          "Prompt tokens whose K/V came from the prefix cache", "counter")
        self.cache_hit_rate = metric("prism_prefix_cache_hit_rate",
                                     "Prefix tokens found in the cache over prefix tokens looked up (cumulative)",
                                     "gauge")
        self.cache_bytes = metric("prism_prefix_cache_bytes", "Bytes of K/V held by the prefix cache", "gauge")
        self.cache_evictions = metric("prism_prefix_cache_evictions_total", "Prefix-cache blocks evicted (LRU)",
                                      "counter")
        self._totals = {"computed": 0, "generic": 0, "candidates": 0, "tasks": 0}
        self._evictions_seen = 0

    def close(self) -> None:
        """Release metrics before their families (called from the adapter's finalize)."""
        for name in [k for k, v in vars(self).items() if hasattr(v, "increment") or hasattr(v, "observe")]:
            delattr(self, name)
        self._families.clear()

    def set_self_check(self, ok: bool) -> None:
        self.self_check.set(1.0 if ok else 0.0)

    def record_batch(self, stats: ForestStats, batch_size: int, errors: int, seconds: float,
                     cache: PrefixCache | None = None) -> None:
        self.requests.increment(stats.requests)
        self.request_errors.increment(errors)
        self.tasks.increment(stats.tasks)
        self.fallbacks.increment(stats.fallback_tasks)
        self.tokens_computed.increment(stats.tokens_computed)
        self.tokens_generic.increment(stats.tokens_generic)
        t = self._totals
        t["computed"] += stats.tokens_computed
        t["generic"] += stats.tokens_generic
        t["candidates"] += stats.candidates
        t["tasks"] += stats.tasks
        if t["generic"]:
            self.hit_rate.set((t["generic"] - t["computed"]) / t["generic"])
        if t["tasks"]:
            self.candidates_per_task.set(t["candidates"] / t["tasks"])
        self.batch_size.observe(batch_size)
        self.latency.observe(seconds)
        self.cache_tokens_reused.increment(stats.tokens_cached)
        if cache is not None:
            self.cache_hit_rate.set(cache.stats.hit_rate)
            self.cache_bytes.set(cache.bytes_held)
            self.cache_evictions.increment(cache.stats.evictions - self._evictions_seen)
            self._evictions_seen = cache.stats.evictions


QUEUE_WAIT_BUCKETS = [0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 7.5, 10, 15, 30]
LANES = ("bulk", "urgent")


class AdmissionMetrics:
    """The scheduler's (scheduler.py), by lane: the queue wait of every request that was scored
    (submit to the start of its batch), and the requests refused, by reason ("door": the expected
    answer was past the bound; "overdue": the backstop; "stopping": queued at unload; "error")."""

    def __init__(self, make_family, labels: dict[str, str], reasons: tuple[str, ...]):
        self._families = [
            make_family("prism_queue_wait_seconds",
                        "Seconds from arrival at prism_decision to the start of the batch that scores the request",
                        "histogram"),
            make_family("prism_rejected_requests_total",
                        "Requests answered UNAVAILABLE to keep admitted ones within max_queue_wait_s, by reason",
                        "counter"),
        ]
        self.queue_wait = {lane: self._families[0].Metric(labels={**labels, "lane": lane}, buckets=QUEUE_WAIT_BUCKETS)
                           for lane in LANES}
        self.rejected = {(lane, reason): self._families[1].Metric(labels={**labels, "lane": lane, "reason": reason})
                         for lane in LANES for reason in reasons}

    def close(self) -> None:
        self.queue_wait.clear()
        self.rejected.clear()
        self._families.clear()
