"""Prometheus metrics of a serving engine, named as vLLM names them (with a `tritonllm:` prefix).

Gauges are refreshed by the engine thread after every step and every batch of arrivals/aborts; the
engine's cumulative counts (tokens, preemptions, prefix-cache lookups) are turned into counter increments.
Each app gets its own registry, so several servers can live in one process (tests).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from tritonllm.runtime.engine import LLMEngine

# Seconds; from sub-millisecond GPU decode steps to interpreter runs of a second or more.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class EngineMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"tritonllm:{name}", doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"tritonllm:{name}", doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"tritonllm:{name}", doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.num_requests_running = gauge(
            "num_requests_running", "Sequences in the running batch (a request with n samples counts n)."
        )
        self.num_requests_waiting = gauge("num_requests_waiting", "Sequences queued or preempted, waiting to run.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).")
        self.kv_cache_free_blocks = gauge(
            "kv_cache_free_blocks", "KV-cache blocks free to allocate (cached but unreferenced blocks included)."
        )
        self.kv_cache_total_blocks = gauge("kv_cache_total_blocks", "KV-cache blocks in the pool.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.num_preemptions = counter("num_preemptions", "Sequences preempted (their KV recomputed later).")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.")
        self._request_success = Counter(
            "tritonllm:request_success",
            "Requests finished, by finish reason (stop, length, abort).",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self._model_name = model_name
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Time from arrival to the first generated token.", TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between consecutive generated tokens of a request.", ITL_BUCKETS
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Time from arrival to the last token of a request.", E2E_BUCKETS
        )
        self._seen = {"prompt": 0, "generation": 0, "preemptions": 0, "queries": 0, "hits": 0}

    def update_engine_state(self, engine: LLMEngine) -> None:
        """Read the engine's gauges and cumulative counts (call from the thread that owns the engine)."""
        stats = engine.get_stats()
        block_manager = engine.scheduler.block_manager
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.kv_cache_free_blocks.set(block_manager.get_num_free_blocks())
        self.kv_cache_total_blocks.set(block_manager.num_blocks)
        totals = {
            "prompt": (engine.num_prompt_tokens_total, self.prompt_tokens),
            "generation": (engine.num_generation_tokens_total, self.generation_tokens),
            "preemptions": (stats.num_preemptions, self.num_preemptions),
            "queries": (stats.prefix_cache_queries, self.prefix_cache_queries),
            "hits": (stats.prefix_cache_hits, self.prefix_cache_hits),
        }
        for key, (total, counter) in totals.items():
            if total > self._seen[key]:
                counter.inc(total - self._seen[key])
                self._seen[key] = total

    def observe_request_finished(self, finish_reasons: list[str | None], e2e_seconds: float) -> None:
        reason = "abort" if "abort" in finish_reasons else ("length" if "length" in finish_reasons else "stop")
        self._request_success.labels(self._model_name, reason).inc()
        self.e2e_request_latency.observe(e2e_seconds)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
