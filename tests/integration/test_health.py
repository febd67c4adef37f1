"""grpc.health.v1 tells the truth: real processes, a real Redis paused, a real executor killed."""

from __future__ import annotations

import os
import signal
import urllib.request

import pytest

from common.health import LIVENESS_SERVICE
from tests.helpers import wait_for
from tests.integration.conftest import generate

PROCESSES = ("gateway", "scheduler", "executor-0")


@pytest.fixture(scope="module")
def stack(stack_factory):
    return stack_factory(num_executors=1)


def statuses(stack, service: str = "") -> dict[str, str]:
    return {name: stack.health(name, service) for name in PROCESSES}


def redis_up_sample(stack, name: str) -> str:
    """The kvgate_redis_up line of process `name`'s /metrics."""
    url = f"http://127.0.0.1:{stack.metrics_ports[name]}/metrics"
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    return next(line for line in text.splitlines() if line.startswith("kvgate_redis_up "))


def every_process_says(stack, status: str, service: str = "") -> None:
    """Waits for every process to answer `status` for `service` (a probe of a busy machine
    can time out: UNREACHABLE, then the next one answers)."""
    wait_for(
        lambda: set(statuses(stack, service).values()) == {status},
        f"every process {status} for {service or 'the server'} (now {statuses(stack, service)})",
        timeout_s=30.0,
    )


def test_every_process_answers_serving_and_live(stack):
    every_process_says(stack, "SERVING")
    every_process_says(stack, "SERVING", LIVENESS_SERVICE)


def test_while_redis_is_unreachable_every_process_is_not_serving_but_live(stack):
    redis_pid = stack.procs["redis"].pid
    os.kill(redis_pid, signal.SIGSTOP)  # what a hung or partitioned Redis looks like
    try:
        every_process_says(stack, "NOT_SERVING")
        every_process_says(stack, "SERVING", LIVENESS_SERVICE)
        for name in PROCESSES:
            assert redis_up_sample(stack, name) == "kvgate_redis_up 0.0", name
    finally:
        os.kill(redis_pid, signal.SIGCONT)
    every_process_says(stack, "SERVING")  # again, once Redis answers
    assert all(redis_up_sample(stack, name) == "kvgate_redis_up 1.0" for name in PROCESSES)
    completion = generate(stack.address, "Once upon a time", max_tokens=8)
    assert len(completion.token_ids) == 8, completion


def test_the_gateway_is_not_serving_once_no_executor_has_been_alive_for_5_s(stack):
    stack.stop("executor-0", sig=signal.SIGKILL)
    wait_for(
        lambda: stack.health("gateway") == "NOT_SERVING",
        "the gateway NOT_SERVING with its only executor killed",
        timeout_s=20.0,
    )
    wait_for(lambda: stack.health("gateway", LIVENESS_SERVICE) == "SERVING", "gateway live")
    log = (stack.config.log_dir / "gateway.log").read_text()
    assert "NOT_SERVING (no executor has been alive for 5 s)" in log, log[-2000:]
    stack.start_executor("executor-0")
    wait_for(
        lambda: stack.health("gateway") == "SERVING",
        "the gateway SERVING again once an executor is alive",
        timeout_s=30.0,
    )
