"""The executor's Prometheus metrics, fed from `Engine.stats()` and the step loop's timing."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from common.metrics import LATENCY_BUCKETS_S, SIZE_BUCKETS
from executor.engine import EngineStats


class ExecutorMetrics:
    """Every metric of one executor, on its own registry.

    Gauges are set from each EngineStats snapshot; counters advance by the
    difference between the engine's cumulative totals and the last snapshot.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self._last: EngineStats | None = None
        self.running = Gauge(
            "kvgate_executor_running_requests", "requests in the running batch", registry=registry
        )
        self.waiting = Gauge(
            "kvgate_executor_waiting_requests",
            "requests admitted but waiting for KV blocks or a batch slot",
            registry=registry,
        )
        self.kv_usage = Gauge(
            "kvgate_executor_kv_usage_ratio",
            "fraction of KV cache blocks held by requests and session pins",
            registry=registry,
        )
        self.kv_blocks = Gauge(
            "kvgate_executor_kv_blocks", "KV cache blocks in the pool", registry=registry
        )
        self.session_pins = Gauge(
            "kvgate_executor_session_pins", "sessions holding pinned KV blocks", registry=registry
        )
        self.session_blocks = Gauge(
            "kvgate_executor_session_blocks",
            "KV blocks pinned by sessions",
            registry=registry,
        )
        self.prefix_hit_tokens = Counter(
            "kvgate_executor_prefix_cache_hit_tokens",
            "prompt tokens served from the prefix or session cache",
            registry=registry,
        )
        self.evicted_blocks = Counter(
            "kvgate_executor_evicted_blocks",
            "cached KV blocks reused for new data",
            registry=registry,
        )
        self.evicted_sessions = Counter(
            "kvgate_executor_evicted_sessions",
            "pinned sessions dropped under memory pressure",
            registry=registry,
        )
        self.preemptions = Counter(
            "kvgate_executor_preemptions",
            "running requests preempted for lack of KV blocks",
            registry=registry,
        )
        self.step_time = Histogram(
            "kvgate_executor_step_seconds",
            "time of one engine step (schedule, forward, sample, update)",
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.step_tokens = Histogram(
            "kvgate_executor_step_tokens",
            "tokens run through the model in one step (prompt chunks and decodes)",
            buckets=SIZE_BUCKETS,
            registry=registry,
        )

    def record_step(self, step_s: float, stats: EngineStats) -> None:
        """A step took `step_s` seconds; `stats` is the engine's snapshot after it."""
        num_tokens = stats.num_batched_tokens - self._last_value("num_batched_tokens")
        if num_tokens > 0:
            self.step_time.observe(step_s)
            self.step_tokens.observe(num_tokens)
        self.record_stats(stats)

    def record_stats(self, stats: EngineStats) -> None:
        """Bring every gauge and counter up to an EngineStats snapshot."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_blocks.set(stats.num_total_blocks)
        used = stats.num_total_blocks - stats.num_free_blocks
        self.kv_usage.set(used / stats.num_total_blocks if stats.num_total_blocks else 0.0)
        self.session_pins.set(stats.num_session_pins)
        self.session_blocks.set(stats.num_session_blocks)
        self._advance(self.prefix_hit_tokens, stats, "prefix_hit_tokens")
        self._advance(self.evicted_blocks, stats, "num_evicted_blocks")
        self._advance(self.evicted_sessions, stats, "num_evicted_sessions")
        self._advance(self.preemptions, stats, "num_preemptions")
        self._last = stats

    def _last_value(self, name: str) -> int:
        return 0 if self._last is None else getattr(self._last, name)

    def _advance(self, counter: Counter, stats: EngineStats, name: str) -> None:
        counter.inc(getattr(stats, name) - self._last_value(name))
