"""The executors' scaling signal, proved on a real stack: a real Prometheus scrapes it and
evaluates the very query of deploy/k8s's ScaledObject while the stack is driven past what one
executor should hold, then after the load stops."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from deploy.scaling import LocalPrometheus, ScalingRule
from tests.helpers import wait_for
from tests.integration.conftest import EXECUTOR_FLAGS, generate

MAX_TOKENS = 128
# While the file exists each step of the executor takes this long (engine/faults.py), so the
# streams stay in the system until the test has seen the signal they make: 128 tokens take at
# least 32 s then, and the signal is awaited, never sampled for a peak.
SLOW_STEP_S = 0.25

pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None, reason="prometheus comes with make setup (Debian package)"
)


@pytest.fixture(scope="module")
def slow_file(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("faults") / "slow"


@pytest.fixture(scope="module")
def stack(stack_factory, slow_file):
    faults = {"KVGATE_FAULTS": f"slow_while_file={slow_file}:{SLOW_STEP_S}"}
    return stack_factory(num_executors=1, executor_env=faults)


@pytest.fixture
def prometheus(stack, tmp_path):
    prometheus = LocalPrometheus(tmp_path / "prometheus", scrape_interval_s=1.0)
    prometheus.set_targets(stack.metrics_ports)
    yield prometheus
    prometheus.stop()


def test_the_signal_rises_past_the_threshold_under_load_and_falls_after(
    stack, prometheus, slow_file
):
    """Twice the threshold's streams on one executor: the signal (Prometheus evaluating the
    ScaledObject's query) reads more than the threshold and more than the executor's batch
    slots (what waits counts too) while they run slowly, every stream completes once they run
    at full speed, and the signal falls back under the threshold after."""
    rule = ScalingRule.from_manifest()
    wait_for(
        lambda: prometheus.healthy_targets() == 3, "prometheus scraping 3 targets", timeout_s=20.0
    )
    idle = prometheus.query(rule.query)
    assert idle is not None and idle < rule.threshold, f"idle stack reads {idle}"
    streams = 2 * int(rule.threshold)  # twice what one executor should hold
    slots = int(EXECUTOR_FLAGS[EXECUTOR_FLAGS.index("--max-num-seqs") + 1])
    assert streams > slots, "the load must exceed the batch slots"
    bar = max(rule.threshold, slots)

    def one(index: int):
        return generate(stack.address, f"Once upon a time {index}", max_tokens=MAX_TOKENS,
                        ignore_eos=True)  # fmt: skip

    slow_file.touch()
    try:
        with ThreadPoolExecutor(streams) as pool:
            futures = [pool.submit(one, i) for i in range(streams)]
            peak = wait_for(
                lambda: (reading := prometheus.query(rule.query) or 0.0) > bar and reading,
                f"{streams} streams on one executor: the signal past {bar} (the threshold "
                f"{rule.threshold}, the {slots} batch slots; {rule.query})",
                timeout_s=120.0,
            )
            slow_file.unlink()
            completions = [f.result(timeout=120.0) for f in futures]
    finally:
        slow_file.unlink(missing_ok=True)
    short = [c for c in completions if len(c.token_ids) != MAX_TOKENS]
    assert not short, f"{len(short)} of {streams} streams did not complete"
    assert rule.desired_replicas(peak) >= 2
    wait_for(
        lambda: (prometheus.query(rule.query) or 0.0) < rule.threshold,
        f"the signal back under {rule.threshold} once the load stopped",
        timeout_s=30.0,
    )
    assert rule.desired_replicas(prometheus.query(rule.query) or 0.0) == rule.min_replicas
