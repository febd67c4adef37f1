"""The executors' autoscaler played on a local stack: what a cluster does, on one machine.

A real Prometheus scrapes the stack; every polling interval the scaler reads the ScaledObject's
own query (deploy/k8s, through deploy/scaling.py), asks for ceil(value / threshold) executors
within the min and max, starts new ones at once (the join path: an executor process that
registers its heartbeat) and drains one at a time once the lower count has held for the
scale-down window (the drain path: SIGTERM, as the preStop hook sends). KEDA's and the HPA's
periods are multiplied by a time scale so that a run takes minutes. `kvgate bench scaling
executors` (bench/scaling.py) puts a ramp of load on it and reports what it did.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from deploy.scaling import LocalPrometheus, ScalingRule
from deploy.stack import Stack, StackConfig, free_port

QUEUE_QUERY = (
    "(sum(kvgate_scheduler_queue_length) or vector(0)) "
    "+ (sum(kvgate_executor_waiting_requests) or vector(0))"
)


@dataclass(slots=True)
class Sample:
    """One reading of the scaler."""

    t_s: float
    signal: float  # the ScaledObject's query
    queue: float  # its waiting part: the scheduler's queue and the executors' waiting requests
    desired: int  # what the autoscaler asks for
    replicas: int  # executors serving (started, not draining)
    draining: int  # executors moving their requests and sessions out before they exit


@dataclass(slots=True)
class Fleet:
    """The stack's executors, as the scaler starts and drains them."""

    stack: Stack
    prometheus: LocalPrometheus
    serving: list[str] = field(default_factory=list)
    draining: list[str] = field(default_factory=list)
    exits: dict[str, int] = field(default_factory=dict)  # exit status of each drained one
    started: int = 0

    def start(self) -> None:
        name = f"executor-{self.started}"
        self.started += 1
        self.stack.start_executor(name, wait=False)
        self.serving.append(name)
        self.retarget()

    def drain_one(self) -> None:
        name = self.serving.pop()  # the newest
        self.stack.procs[name].send_signal(signal.SIGTERM)
        self.draining.append(name)

    def reap(self) -> None:
        """Forgets the drained executors that have exited."""
        for name in list(self.draining):
            status = self.stack.procs[name].poll()
            if status is not None:
                self.exits[name] = status
                self.draining.remove(name)
                self.stack.procs.pop(name)
                self.retarget()

    def retarget(self) -> None:
        """Prometheus scrapes every process of the stack that runs now."""
        ports = {n: p for n, p in self.stack.metrics_ports.items() if n in self.stack.procs}
        self.prometheus.set_targets(ports)


class Scaler:
    """The autoscaler's arithmetic and pacing, with its periods multiplied by time_scale."""

    def __init__(self, rule: ScalingRule, fleet: Fleet, time_scale: float) -> None:
        self.rule = rule
        self.fleet = fleet
        self.interval_s = rule.polling_interval_s * time_scale
        self.window_s = rule.scale_down_window_s * time_scale
        self.down_period_s = rule.scale_down_period_s * time_scale
        self._recent: list[tuple[float, int]] = []  # (time, desired) within the window
        self._last_down_s = -float("inf")

    def step(self, now_s: float, signal_value: float) -> int:
        """Acts on one reading. Returns: the replicas the autoscaler asks for."""
        desired = self.rule.desired_replicas(signal_value)
        self._recent = [(t, d) for t, d in self._recent if now_s - t < self.window_s]
        self._recent.append((now_s, desired))
        current = len(self.fleet.serving)
        if desired > current:
            for _ in range(desired - current):
                self.fleet.start()
        elif max(d for _, d in self._recent) < current:
            if now_s - self._last_down_s >= self.down_period_s:
                self.fleet.drain_one()
                self._last_down_s = now_s
        return desired


EXECUTOR_FLAGS = ["--num-gpu-blocks", "1024", "--max-num-seqs", "64"]
# Executors, Prometheus and the load share the machine with the gateway: a Redis call of the
# gateway's may take longer than its default 0.5 s there, which is not what this measures.
GATEWAY_FLAGS = ["--redis-timeout-s", "2"]


@contextmanager
def local_fleet(model: str, rule: ScalingRule, scratch: Path) -> Iterator[Fleet]:
    """Redis, a scheduler, a gateway and rule.min_replicas executors, scraped by a local
    Prometheus; all stopped when the block ends."""
    stack = Stack(
        StackConfig(
            model=model,
            port=free_port(),
            log_dir=scratch / "logs",
            executor_flags=EXECUTOR_FLAGS,
            gateway_flags=GATEWAY_FLAGS,
            log_format="text",
        )
    )
    prometheus = None
    try:
        stack.start_redis()
        stack.start_scheduler("scheduler")
        prometheus = LocalPrometheus(scratch / "prometheus", scrape_interval_s=1.0)
        fleet = Fleet(stack, prometheus)
        for _ in range(rule.min_replicas):
            fleet.start()
        stack.start_gateway("gateway", stack.config.port)
        for name in fleet.serving:
            stack.wait_executor(name)
        fleet.retarget()
        yield fleet
    finally:
        if prometheus is not None:
            prometheus.stop()
        stack.stop_all()


def play(
    fleet: Fleet,
    rule: ScalingRule,
    time_scale: float,
    load_done: Callable[[], bool],
    give_up_s: float,
) -> tuple[list[Sample], bool]:
    """Plays the autoscaler every polling interval until the load is done and the fleet is
    back at its minimum, or give_up_s after the start.

    Returns: the readings, and whether the fleet settled at its minimum.
    """
    scaler = Scaler(rule, fleet, time_scale)
    samples: list[Sample] = []
    started_s = time.perf_counter()
    while True:
        now_s = time.perf_counter() - started_s
        settled = len(fleet.serving) == rule.min_replicas and not fleet.draining
        if (load_done() and settled) or now_s > give_up_s:
            return samples, settled
        fleet.reap()
        value = fleet.prometheus.query(rule.query) or 0.0
        queue = fleet.prometheus.query(QUEUE_QUERY) or 0.0
        desired = scaler.step(now_s, value)
        samples.append(
            Sample(now_s, value, queue, desired, len(fleet.serving), len(fleet.draining))
        )
        time.sleep(scaler.interval_s)
