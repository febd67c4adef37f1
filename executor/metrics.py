"""The executor's Prometheus metrics, fed from `Engine.stats()` and the step loop's timing."""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from common.metrics import METRICS, ProcessMetrics
from engine.outputs import EngineStats

# What a scrape shows before the first snapshot: an empty engine.
IDLE_STATS = EngineStats(
    **{name: 0 for name in EngineStats.__dataclass_fields__ if name != "spec_method"},
    spec_method="",
)


class EngineStatsCollector(Collector):
    """The engine's gauges and cumulative counters, read at each scrape from the latest
    EngineStats snapshot the step loop handed over (the scraping thread never reads the
    engine itself)."""

    def __init__(self) -> None:
        self.latest = IDLE_STATS
        self._created_unix_s = time.time()

    def collect(self) -> Iterator[Metric]:
        stats, family = self.latest, self._family
        total = stats.num_total_blocks
        yield family("kvgate_executor_running_requests", stats.num_running)
        yield family("kvgate_executor_waiting_requests", stats.num_waiting)
        used = total - stats.num_free_blocks
        yield family("kvgate_executor_kv_usage_ratio", used / total if total else 0.0)
        yield family("kvgate_executor_kv_blocks", total)
        yield family("kvgate_executor_session_pins", stats.num_session_pins)
        yield family("kvgate_executor_session_blocks", stats.num_session_blocks)
        yield family("kvgate_executor_prefix_cache_hit_tokens", stats.prefix_hit_tokens)
        yield family("kvgate_executor_evicted_blocks", stats.num_evicted_blocks)
        yield family("kvgate_executor_evicted_sessions", stats.num_evicted_sessions)
        yield family("kvgate_executor_preemptions", stats.num_preemptions)
        yield family("kvgate_executor_host_kv_blocks", stats.num_host_blocks_total)
        yield family("kvgate_executor_host_kv_blocks_used", stats.num_host_blocks_used)
        yield family("kvgate_executor_swapped_out_blocks", stats.num_swapped_out_blocks)
        yield family("kvgate_executor_swapped_in_blocks", stats.num_swapped_in_blocks)
        yield family("kvgate_executor_offloaded_sessions", stats.num_offloaded_sessions)
        yield from self._speculative(stats)

    def _speculative(self, stats: EngineStats) -> Iterator[Metric]:
        """Speculative decoding's counts, labelled with the proposer's method (none when
        speculation is off)."""
        counts = {
            "kvgate_executor_spec_drafts": stats.num_spec_drafts,
            "kvgate_executor_spec_proposed_tokens": stats.num_spec_proposed_tokens,
            "kvgate_executor_spec_accepted_tokens": stats.num_spec_accepted_tokens,
            "kvgate_executor_spec_bonus_tokens": stats.num_spec_bonus_tokens,
        }
        for name, value in counts.items():
            counter = CounterMetricFamily(name, METRICS[name].documentation, labels=["method"])
            if stats.spec_method:
                counter.add_metric([stats.spec_method], value, created=self._created_unix_s)
            yield counter
        proposed = stats.num_spec_proposed_tokens
        gauges = {
            "kvgate_executor_spec_acceptance_ratio": (
                stats.num_spec_accepted_tokens / proposed if proposed else 0.0
            ),
            "kvgate_executor_spec_mean_accepted_length": stats.spec_mean_accepted_length,
        }
        for name, value in gauges.items():
            gauge = GaugeMetricFamily(name, METRICS[name].documentation, labels=["method"])
            if stats.spec_method:
                gauge.add_metric([stats.spec_method], value)
            yield gauge

    def describe(self) -> Iterator[Metric]:
        """The families `collect` yields, so the registry knows their names."""
        return self.collect()

    def _family(self, name: str, value: float) -> Metric:
        """The one sample of the gauge or counter METRICS declares under `name`."""
        spec = METRICS[name]
        if spec.kind == "counter":
            created = self._created_unix_s
            return CounterMetricFamily(name, spec.documentation, value=value, created=created)
        return GaugeMetricFamily(name, spec.documentation, value=value)


class ExecutorMetrics(ProcessMetrics):
    """Every kvgate_executor_ metric of common.metrics.METRICS, on a registry of its own: the
    step histograms, observed by the step loop, and the engine's snapshot, read at each
    scrape."""

    def __init__(self) -> None:
        self._engine = EngineStatsCollector()
        super().__init__("kvgate_executor_", collected={f.name for f in self._engine.describe()})
        self.registry.register(self._engine)
        # Every series of the KV moves from the start: a drain's last increments come just
        # before the process exits, and a rate() needs the series' zero before them.
        for kind in ("request", "session", "rebalance"):
            for result in ("moved", "fallback"):
                self.kv_moves.labels(kind, result)
        for direction in ("in", "out"):
            self.kv_moved_blocks.labels(direction)
            self.kv_moved_bytes.labels(direction)

    def record_kernels(self, backend: str, cpu_isa: str | None) -> None:
        """The engine runs the `backend` kernels, the CPU ones built for `cpu_isa`."""
        self.kernels.labels(backend=backend, cpu_isa=cpu_isa or "none").set(1)

    def record_step(self, step_s: float, stats: EngineStats) -> None:
        """A step took `step_s` seconds; `stats` is the engine's snapshot after it."""
        num_tokens = stats.num_batched_tokens - self._engine.latest.num_batched_tokens
        if num_tokens > 0:
            self.step_seconds.observe(step_s)
            self.step_tokens.observe(num_tokens)
        self.record_stats(stats)

    def record_stats(self, stats: EngineStats) -> None:
        """Hand over an EngineStats snapshot: the next scrape reads it."""
        self._engine.latest = stats
