"""Prometheus metrics: every metric's declaration, the bucket layouts, the --metrics-* flags
and the server.

METRICS declares every metric of the three processes in one place. Each process builds its
own (gateway/metrics.py, scheduler/metrics.py, executor/metrics.py) on a
`CollectorRegistry` of its own and serves it on `--metrics-port` with
`start_metrics_server`. Every metric name starts with `kvgate_`; durations are in seconds;
every latency histogram has LATENCY_BUCKETS_S and every size histogram SIZE_BUCKETS.
"""

from __future__ import annotations

import argparse
import logging
import threading
from collections.abc import Collection, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.metrics_core import Metric

from common.config import check_range, env_int, env_str

log = logging.getLogger(__name__)

# The one bucket layout of every latency histogram, in seconds: 1 ms to 2 min.
LATENCY_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)
# The one bucket layout of every size histogram (requests or tokens per batch or step).
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# --metrics-port value that serves no metrics.
METRICS_DISABLED = -1


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One kvgate metric: its kind (counter, gauge, latency or size histogram), what it
    counts, and its labels."""

    kind: str
    documentation: str
    labels: tuple[str, ...] = ()


# Every metric of every process, by name (counters are exposed as NAME_total); each process
# builds its own as a ProcessMetrics. docs/observability.md explains them.
METRICS = {
    # every process
    "kvgate_redis_up": MetricSpec(
        "gauge", "1 while this process reaches Redis, 0 while it does not"
    ),
    # gateway
    "kvgate_gateway_requests": MetricSpec(
        "counter",
        "calls finished, by service, method, status code and api (the front: kvgate, openai "
        "or vllm)",
        ("service", "method", "code", "api"),
    ),
    "kvgate_gateway_active_streams": MetricSpec(
        "gauge", "server-streaming calls open now, by method and api", ("method", "api")
    ),
    "kvgate_gateway_ttft_seconds": MetricSpec(
        "latency", "time from arrival to the first token, by api", ("api",)
    ),
    "kvgate_gateway_itl_seconds": MetricSpec(
        "latency", "gap between consecutive token arrivals of one request, by api", ("api",)
    ),
    "kvgate_gateway_e2e_seconds": MetricSpec(
        "latency", "time from arrival to the last chunk, by api", ("api",)
    ),
    "kvgate_gateway_finished_requests": MetricSpec(
        "counter", "generations finished, by finish reason and api", ("finish_reason", "api")
    ),
    "kvgate_gateway_prompt_tokens": MetricSpec(
        "counter", "prompt tokens of queued requests, by api", ("api",)
    ),
    "kvgate_gateway_output_tokens": MetricSpec(
        "counter", "tokens streamed to clients, by api", ("api",)
    ),
    "kvgate_gateway_drain_hand_ons": MetricSpec(
        "counter",
        "requests a draining executor handed on mid-stream, queued again by this gateway (kv: "
        "moved, their KV went to a peer first; recomputed, it did not)",
        ("kv",),
    ),
    "kvgate_gateway_requeues": MetricSpec(
        "counter", "requests re-queued because their executor went away, by api", ("api",)
    ),
    "kvgate_gateway_refused": MetricSpec(
        "counter",
        "calls refused with RESOURCE_EXHAUSTED at a limit, by the limit's flag: "
        "max_concurrent_streams, redis_max_connections, max_queue_len, max_queued_turns; and api",
        ("limit", "api"),
    ),
    # per tenant: the first --metrics-max-tenants tenants a gateway sees have a label of their
    # own, the others share the label "_other"
    "kvgate_gateway_tenant_requests": MetricSpec(
        "counter", "generations finished, by tenant", ("tenant",)
    ),
    "kvgate_gateway_tenant_prompt_tokens": MetricSpec(
        "counter", "prompt tokens of finished generations, by tenant", ("tenant",)
    ),
    "kvgate_gateway_tenant_cached_prompt_tokens": MetricSpec(
        "counter", "prompt tokens served from the KV cache, by tenant", ("tenant",)
    ),
    "kvgate_gateway_tenant_generated_tokens": MetricSpec(
        "counter", "tokens generated, by tenant", ("tenant",)
    ),
    "kvgate_gateway_tenant_refused": MetricSpec(
        "counter",
        "calls refused over a quota, by tenant and limit: requests_per_s, tokens_per_min or "
        "max_streams",
        ("tenant", "limit"),
    ),
    # scheduler
    "kvgate_scheduler_is_leader": MetricSpec(
        "gauge", "1 while this scheduler holds the leader lock, 0 as a standby"
    ),
    "kvgate_scheduler_queue_length": MetricSpec(
        "gauge", "requests waiting in the scheduler's queue for a batch or an executor"
    ),
    "kvgate_scheduler_queue_wait_seconds": MetricSpec(
        "latency", "time from a request being queued (its XADD, on Redis's clock) to its assignment"
    ),
    "kvgate_scheduler_batch_size": MetricSpec("size", "requests in a released batch"),
    "kvgate_scheduler_batch_tokens": MetricSpec("size", "prompt tokens in a released batch"),
    "kvgate_scheduler_window_releases": MetricSpec(
        "counter",
        "batches released, by reason: window, max_batch_size or max_batch_tokens",
        ("reason",),
    ),
    "kvgate_scheduler_assigned_requests": MetricSpec("counter", "requests assigned to an executor"),
    "kvgate_scheduler_dropped_requests": MetricSpec(
        "counter", "queued requests dropped, by reason: cancelled or expired", ("reason",)
    ),
    "kvgate_scheduler_executors_alive": MetricSpec("gauge", "executors with a live heartbeat"),
    # executor
    "kvgate_executor_running_requests": MetricSpec("gauge", "requests in the running batch"),
    "kvgate_executor_waiting_requests": MetricSpec(
        "gauge", "requests admitted but waiting for KV blocks or a batch slot"
    ),
    "kvgate_executor_kv_usage_ratio": MetricSpec(
        "gauge", "fraction of KV cache blocks held by requests and session pins"
    ),
    "kvgate_executor_kv_blocks": MetricSpec("gauge", "KV cache blocks in the pool"),
    "kvgate_executor_session_pins": MetricSpec("gauge", "sessions holding pinned KV blocks"),
    "kvgate_executor_session_blocks": MetricSpec("gauge", "KV blocks pinned by sessions"),
    "kvgate_executor_prefix_cache_hit_tokens": MetricSpec(
        "counter", "prompt tokens served from the prefix or session cache"
    ),
    "kvgate_executor_evicted_blocks": MetricSpec("counter", "cached KV blocks reused for new data"),
    "kvgate_executor_evicted_sessions": MetricSpec(
        "counter", "pinned sessions dropped under memory pressure"
    ),
    "kvgate_executor_preemptions": MetricSpec(
        "counter", "running requests preempted for lack of KV blocks"
    ),
    "kvgate_executor_host_kv_blocks": MetricSpec(
        "gauge", "KV blocks of the host tier (--swap-space-gib; 0: none)"
    ),
    "kvgate_executor_host_kv_blocks_used": MetricSpec(
        "gauge", "host tier KV blocks held by swapped-out requests and offloaded sessions"
    ),
    "kvgate_executor_swapped_out_blocks": MetricSpec(
        "counter", "KV blocks copied from the device to the host tier"
    ),
    "kvgate_executor_swapped_in_blocks": MetricSpec(
        "counter", "KV blocks copied from the host tier back to the device"
    ),
    "kvgate_executor_offloaded_sessions": MetricSpec(
        "counter", "pinned sessions moved to the host tier under memory pressure"
    ),
    "kvgate_executor_spec_drafts": MetricSpec(
        "counter", "steps in which a request verified speculatively proposed tokens", ("method",)
    ),
    "kvgate_executor_spec_proposed_tokens": MetricSpec(
        "counter", "tokens proposed by speculative decoding and verified", ("method",)
    ),
    "kvgate_executor_spec_accepted_tokens": MetricSpec(
        "counter", "proposed tokens the target model agreed with (kept)", ("method",)
    ),
    "kvgate_executor_spec_bonus_tokens": MetricSpec(
        "counter", "target tokens gained after a fully accepted proposal", ("method",)
    ),
    "kvgate_executor_spec_acceptance_ratio": MetricSpec(
        "gauge", "accepted over proposed tokens since the executor started", ("method",)
    ),
    "kvgate_executor_spec_mean_accepted_length": MetricSpec(
        "gauge",
        "tokens a verifying step gave a request on average (accepted ones and the target's own)",
        ("method",),
    ),
    "kvgate_executor_kernels": MetricSpec(
        "gauge",
        "1, labelled with the kernel backend (triton, cpu, reference) and the ISA level the CPU "
        "kernels were built for (avx512, avx2, scalar; none for the other backends)",
        ("backend", "cpu_isa"),
    ),
    "kvgate_executor_kv_moved_blocks": MetricSpec(
        "counter",
        "KV blocks moved between executors (direction: out on the sender, in on the receiver)",
        ("direction",),
    ),
    "kvgate_executor_kv_moved_bytes": MetricSpec(
        "counter", "bytes of KV blocks moved between executors", ("direction",)
    ),
    "kvgate_executor_kv_transfer_seconds": MetricSpec(
        "latency", "time of one sequence's KV transfer to a peer, from dial to acknowledgement"
    ),
    "kvgate_executor_kv_moves": MetricSpec(
        "counter",
        "sequences with KV to move that a drain or a rebalance handed on (kind: request, "
        "session or rebalance; result: moved with their KV, or fallback: left to be "
        "recomputed)",
        ("kind", "result"),
    ),
    "kvgate_executor_step_seconds": MetricSpec(
        "latency", "time of one engine step (schedule, forward, sample, update)"
    ),
    "kvgate_executor_step_tokens": MetricSpec(
        "size", "tokens run through the model in one step (prompt chunks and decodes)"
    ),
}
_BUCKETS = {"latency": LATENCY_BUCKETS_S, "size": SIZE_BUCKETS}


class ProcessMetrics:
    """The metrics METRICS declares under `prefix` (kvgate_<process>_) on a registry of their
    own, each an attribute named after the rest of its name: kvgate_gateway_ttft_seconds is
    `ttft_seconds`. Those named in `collected` are left to a collector of the process's own."""

    def __init__(self, prefix: str, collected: Collection[str] = ()) -> None:
        self.registry = CollectorRegistry()
        for name in METRICS:
            if name.startswith(prefix) and name not in collected:
                setattr(self, name.removeprefix(prefix), build_metric(self.registry, name))
        self.scrapes = ScrapeWatch(self.registry)  # what /metrics serves


class ScrapeWatch:
    """A registry as /metrics reads it, counting the scrapes: a process about to exit can wait
    until a scrape has read its last counts (a drain's are made just before it exits)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._changed = threading.Condition()
        self._begun = 0
        self._ended = 0

    def collect(self) -> Iterator[Metric]:
        with self._changed:
            self._begun += 1
        try:
            yield from self.registry.collect()
        finally:
            with self._changed:
                self._ended += 1
                self._changed.notify_all()

    def restricted_registry(self, names: Collection[str]) -> object:
        """/metrics?name[]=...: only those (prometheus_client's handler asks for this)."""
        return self.registry.restricted_registry(names)

    def next_scrape(self) -> int:
        """A ticket for the next scrape to begin from now on (for `wait`)."""
        with self._changed:
            # Scrapes under way now are among those begun: once one more than that has ended,
            # at least one of those ended began after this call.
            return self._begun + 1

    def wait(self, ticket: int, timeout_s: float) -> bool:
        """Waits until the scrape `ticket` stands for (or a later one) has read every metric.

        Returns: whether one did within `timeout_s`.
        """
        with self._changed:
            return self._changed.wait_for(lambda: self._ended >= ticket, timeout_s)


def build_metric(registry: CollectorRegistry, name: str) -> Counter | Gauge | Histogram:
    """The metric METRICS declares under `name`, on `registry`."""
    spec = METRICS[name]
    if spec.kind in _BUCKETS:
        buckets = _BUCKETS[spec.kind]
        return Histogram(name, spec.documentation, spec.labels, buckets=buckets, registry=registry)
    kind = Counter if spec.kind == "counter" else Gauge
    return kind(name, spec.documentation, spec.labels, registry=registry)


def add_metrics_flags(parser: argparse.ArgumentParser, port_env: str) -> None:
    """Add --metrics-host and --metrics-port (env KVGATE_METRICS_HOST and `port_env`).

    The port defaults to 0 (a free one, logged) so that processes started side by side
    never collide; launchers and manifests give each process its fixed port.
    """
    parser.add_argument(
        "--metrics-host",
        default=env_str("KVGATE_METRICS_HOST", "127.0.0.1"),
        help="address /metrics listens on (env KVGATE_METRICS_HOST)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=env_int(port_env, 0),
        help=f"port of /metrics; 0: a free port, {METRICS_DISABLED}: no metrics (env {port_env})",
    )


def check_metrics_port(port: int) -> None:
    """Raise a ValueError naming --metrics-port unless it is a port, 0 or METRICS_DISABLED."""
    check_range("--metrics-port", port, min_value=METRICS_DISABLED, max_value=65535)


def start_metrics_server(
    registry: CollectorRegistry | ScrapeWatch, host: str, port: int
) -> int | None:
    """Serve `registry` as /metrics over HTTP on a daemon thread, and log the address.

    Args:
        registry: the process's metrics.
        host: address to listen on.
        port: TCP port; 0 picks a free one; METRICS_DISABLED serves nothing.

    Returns:
        The port bound, None when disabled.

    Raises:
        OSError: the port cannot be bound (the message names --metrics-port).
    """
    if port == METRICS_DISABLED:
        log.info("metrics disabled (--metrics-port %d)", METRICS_DISABLED)
        return None
    try:
        server, _ = start_http_server(port, addr=host, registry=registry)
    except OSError as error:
        raise OSError(f"--metrics-port {port}: cannot listen on {host}: {error}") from error
    bound = server.server_port
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return bound
