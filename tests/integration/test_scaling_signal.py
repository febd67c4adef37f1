"""The executors' scaling signal, proved on a real stack: a real Prometheus scrapes it and
evaluates the very query of deploy/k8s's ScaledObject while the stack is driven past what one
executor should hold, then after the load stops."""

from __future__ import annotations

import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from deploy.scaling import LocalPrometheus, ScalingRule
from tests.helpers import wait_for
from tests.integration.conftest import EXECUTOR_FLAGS, generate

# Long enough that every stream is still in the system for several of Prometheus's 1 s
# scrapes: the query sums three targets scraped at their own moments, so one scrape can catch
# a request between the scheduler's queue and the executor. At 192 tokens (4 to 6 s of load)
# a quiet run once read a peak of 56 of the 96 streams.
MAX_TOKENS = 384

pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None, reason="prometheus comes with make setup (Debian package)"
)


@pytest.fixture(scope="module")
def stack(stack_factory):
    return stack_factory(num_executors=1)


@pytest.fixture
def prometheus(stack, tmp_path):
    prometheus = LocalPrometheus(tmp_path / "prometheus", scrape_interval_s=1.0)
    prometheus.set_targets(stack.metrics_ports)
    yield prometheus
    prometheus.stop()


def test_the_signal_rises_past_the_threshold_under_load_and_falls_after(stack, prometheus):
    rule = ScalingRule.from_manifest()
    wait_for(
        lambda: prometheus.healthy_targets() == 3, "prometheus scraping 3 targets", timeout_s=20.0
    )
    idle = prometheus.query(rule.query)
    assert idle is not None and idle < rule.threshold, f"idle stack reads {idle}"
    streams = 2 * int(rule.threshold)  # twice what one executor should hold
    readings: list[float] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            readings.append(prometheus.query(rule.query) or 0.0)
            time.sleep(0.25)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()

    def one(index: int):
        return generate(stack.address, f"Once upon a time {index}", max_tokens=MAX_TOKENS,
                        ignore_eos=True)  # fmt: skip

    with ThreadPoolExecutor(streams) as pool:
        completions = list(pool.map(one, range(streams)))
    peak = max(readings)
    short = [c for c in completions if len(c.token_ids) != MAX_TOKENS]
    assert not short, f"{len(short)} of {streams} streams did not complete"
    assert peak > rule.threshold, (
        f"{streams} streams on one executor: the signal peaked at {peak}, the threshold is "
        f"{rule.threshold} ({rule.query})"
    )
    assert rule.desired_replicas(peak) >= 2
    # Past the executor's batch slots, what waits counts too: a signal of running requests
    # alone could never read more than the slots.
    slots = int(EXECUTOR_FLAGS[EXECUTOR_FLAGS.index("--max-num-seqs") + 1])
    assert peak > slots, f"the signal peaked at {peak}, no more than the {slots} batch slots"
    wait_for(
        lambda: (prometheus.query(rule.query) or 0.0) < rule.threshold,
        f"the signal back under {rule.threshold} once the load stopped",
        timeout_s=30.0,
    )
    done.set()
    sampler.join()
    assert rule.desired_replicas(prometheus.query(rule.query) or 0.0) == rule.min_replicas
