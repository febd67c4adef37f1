"""Plays the executors' autoscaler on a local stack, under a ramp of load.

    kvgate bench scaling executors --out bench/results/scaler.json     (and scaler.png beside it)

What a cluster does, on one machine: a real Prometheus scrapes the stack; every polling
interval the scaler reads the ScaledObject's own query (deploy/k8s, through deploy/scaling.py),
asks for ceil(value / threshold) executors within the min and max, starts new ones at once (the
join path: an executor process that registers its heartbeat) and drains one at a time once the
lower count has held for the scale-down window (the drain path: SIGTERM, as the preStop hook
sends). KEDA's and the HPA's periods are multiplied by --time-scale so that a run takes
minutes. Load: Generate requests arriving at a rate that ramps up, holds, and ramps down to
nothing. The JSON and the plot hold replicas, the signal, the queue and TTFT p90 over time,
and what became of every request sent: finished whole, or failed with its status.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from bench.harness import Benchmark, add_model, scratch_folder
from bench.load import run_jobs
from bench.stats import RequestResult, scaling_timeline
from bench.workloads import GenerateJob
from deploy.models import choose_model
from deploy.scaling import LocalPrometheus, ScalingRule
from deploy.stack import Stack, StackConfig, free_port

QUEUE_QUERY = (
    "(sum(kvgate_scheduler_queue_length) or vector(0)) "
    "+ (sum(kvgate_executor_waiting_requests) or vector(0))"
)
PROMPTS = ["Once upon a time", "The cat", "A big red ball", "Tom had a toy", "The sun was"]
# Width of the windows TTFT p90 is computed over, in seconds.
TTFT_WINDOW_S = 10.0


@dataclass(slots=True)
class Sample:
    """One reading of the scaler."""

    t_s: float
    signal: float  # the ScaledObject's query
    queue: float  # its waiting part: the scheduler's queue and the executors' waiting requests
    desired: int  # what the autoscaler asks for
    replicas: int  # executors serving (started, not draining)
    draining: int  # executors finishing their requests before they exit


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


def ramp_arrivals_s(duration_s: float, peak_rate: float) -> list[float]:
    """Arrival times under a rate that ramps from 0 to peak_rate over the first third of
    duration_s, holds it for the second, and falls back to 0 over the last: request k
    arrives when the integral of the rate reaches k + 1/2."""
    third = duration_s / 3.0
    times = np.linspace(0.0, duration_s, int(duration_s * 100) + 1)
    rate = np.interp(times, [0.0, third, 2 * third, duration_s], [0.0, peak_rate, peak_rate, 0.0])
    arrived = np.concatenate([[0.0], np.cumsum((rate[1:] + rate[:-1]) / 2 * np.diff(times))])
    count = int(arrived[-1])
    return np.interp(np.arange(count) + 0.5, arrived, times).tolist()


@dataclass(slots=True)
class PlayConfig:
    """How the playback runs."""

    model: str
    duration_s: float  # of the load ramp
    peak_rate: float  # requests per second at the ramp's top
    output_len: int  # tokens per request
    time_scale: float  # KEDA's and the HPA's periods are multiplied by this
    max_replicas: int  # the manifest's, or fewer on a small machine
    settle_s: float  # most time after the load for the scale-in to reach the minimum


EXECUTOR_FLAGS = ["--num-gpu-blocks", "1024", "--max-num-seqs", "64"]
# Executors, Prometheus and the load share the machine with the gateway: a Redis call of the
# gateway's may take longer than its default 0.5 s there, which is not what this measures.
GATEWAY_FLAGS = ["--redis-timeout-s", "2"]


def play(config: PlayConfig, rule: ScalingRule, scratch: Path) -> dict:
    """Starts the stack and Prometheus, plays the load and the scaler, stops everything.

    Returns: the report (see `report`).
    """
    stack = Stack(
        StackConfig(
            model=config.model,
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
        return run(config, rule, fleet)
    finally:
        if prometheus is not None:
            prometheus.stop()
        stack.stop_all()


def run(config: PlayConfig, rule: ScalingRule, fleet: Fleet) -> dict:
    """The load on a thread, the scaler on this one, until the load is done and the fleet is
    back at its minimum (or config.settle_s after the load)."""
    arrivals = ramp_arrivals_s(config.duration_s, config.peak_rate)
    jobs = [GenerateJob(f"{PROMPTS[i % len(PROMPTS)]} {i}", config.output_len)
            for i in range(len(arrivals))]  # fmt: skip
    gaps = np.diff([0.0, *arrivals]).tolist()
    outcome: list[list[RequestResult]] = []
    address = fleet.stack.address
    load = threading.Thread(
        target=lambda: outcome.append(run_jobs(address, jobs, gaps, progress=False)[0])
    )
    scaler = Scaler(rule, fleet, config.time_scale)
    samples: list[Sample] = []
    started_s = time.perf_counter()
    load.start()
    give_up_s = config.duration_s + config.settle_s
    while True:
        now_s = time.perf_counter() - started_s
        settled = len(fleet.serving) == rule.min_replicas and not fleet.draining
        if (not load.is_alive() and settled) or now_s > give_up_s:
            break
        fleet.reap()
        value = fleet.prometheus.query(rule.query) or 0.0
        queue = fleet.prometheus.query(QUEUE_QUERY) or 0.0
        desired = scaler.step(now_s, value)
        samples.append(
            Sample(now_s, value, queue, desired, len(fleet.serving), len(fleet.draining))
        )
        time.sleep(scaler.interval_s)
    load.join()
    result = report(config, rule, samples, arrivals, outcome[0], fleet.exits)
    result["settled"] = settled
    return result


def report(
    config: PlayConfig,
    rule: ScalingRule,
    samples: list[Sample],
    arrivals_s: list[float],
    results: list[RequestResult],
    exits: dict[str, int],
) -> dict:
    """What the run shows: the timeline, TTFT p90 by arrival window, and what became of every
    request (finished whole, failed, or lost: sent but never answered)."""
    whole = [r for r in results if r.ok and r.output_tokens == config.output_len]
    errors: dict[str, int] = {}
    for result in results:
        if result not in whole:
            key = result.error or f"{result.output_tokens} of {config.output_len} tokens"
            errors[key] = errors.get(key, 0) + 1
    windows = []
    edges = np.arange(0.0, config.duration_s + TTFT_WINDOW_S, TTFT_WINDOW_S)
    for start in edges[:-1]:
        ttfts = [r.ttft_s for r, t in zip(results, arrivals_s, strict=True)
                 if start <= t < start + TTFT_WINDOW_S and r.ok]  # fmt: skip
        p90 = float(np.percentile(ttfts, 90)) * 1000.0 if ttfts else None
        windows.append({"t_s": float(start + TTFT_WINDOW_S / 2), "ttft_p90_ms": p90,
                        "requests": len(ttfts)})  # fmt: skip
    return {
        "config": asdict(config),
        "rule": asdict(rule),
        "samples": [asdict(s) for s in samples],
        "ttft_p90": windows,
        "requests": {
            "sent": len(arrivals_s),
            "finished": len(whole),
            "failed": sum(errors.values()),
            "errors": errors,
        },
        "drained_executors_exit_status": exits,
        "most_replicas": max(s.replicas for s in samples),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `kvgate bench scaling executors` (--out: the CLI's; the PNG goes beside it)."""
    add_model(parser, "", "model folder (default: make run's)")
    parser.add_argument("--duration-s", type=float, default=180.0, help="of the load ramp")
    parser.add_argument("--peak-rate", type=float, default=12.0, help="requests/s at the top")
    parser.add_argument("--output-len", type=int, default=192)
    parser.add_argument("--time-scale", type=float, default=0.1)
    parser.add_argument(
        "--max-replicas", type=int, default=ScalingRule.from_manifest().max_replicas
    )
    parser.add_argument("--settle-s", type=float, default=120.0)


def run_scaler(args: argparse.Namespace) -> dict:
    """`kvgate bench scaling executors`: plays the scaler, draws its PNG next to --out."""
    rule = ScalingRule.from_manifest()
    config = PlayConfig(
        model=args.model or str(choose_model()),
        duration_s=args.duration_s,
        peak_rate=args.peak_rate,
        output_len=args.output_len,
        time_scale=args.time_scale,
        max_replicas=min(args.max_replicas, rule.max_replicas),
        settle_s=args.settle_s,
    )
    rule = replace(rule, max_replicas=config.max_replicas)
    load_before = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    with scratch_folder("kvgate-scaler-") as scratch:
        result = play(config, rule, scratch)
    result["machine_load_at_start"] = load_before
    result["machine_load_at_end"] = subprocess.run(["uptime"], capture_output=True,
                                                   text=True).stdout.strip()  # fmt: skip
    result["png"] = str(scaling_timeline(result, args.out.with_suffix(".png")))
    return result


def summarize(result: dict) -> None:
    requests = result["requests"]
    print(f"{requests['sent']} sent, {requests['finished']} finished whole, "
          f"{requests['failed']} failed; up to {result['most_replicas']} executors; "
          f"{result['png']}")  # fmt: skip


def failure(result: dict) -> str | None:
    """A lost request, or a fleet not back at its minimum within --settle-s."""
    requests = result["requests"]
    if not result["settled"]:
        return (
            f"the fleet was not back at {result['rule']['min_replicas']} executor(s) within "
            "--settle-s after the load: the scale-in was cut short (raise --settle-s)"
        )
    if requests["finished"] != requests["sent"]:
        unfinished = requests["sent"] - requests["finished"]
        return f"{unfinished} of {requests['sent']} requests did not finish whole"
    return None


BENCHMARKS = {
    "scaling executors": Benchmark(add_arguments, run_scaler, "scaler.json", summarize, failure)
}
