"""Admission and failover: deadlines, a full queue, no executor, a scheduler killed mid-queue.

The scheduler holds requests for a 3 s window here, so requests are reliably
queued (read by the scheduler, not yet placed) while a test acts on them.
"""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from common.keys import SCHEDULER_GROUP
from deploy.stack import free_port
from tests.helpers import wait_for
from tests.integration.conftest import generate

MAX_QUEUE_LEN = 6


@pytest.fixture(scope="module")
def stack(stack_factory):
    return stack_factory(
        scheduler_flags=["--batch-window-ms", "3000"],
        gateway_flags=["--max-queue-len", str(MAX_QUEUE_LEN)],
    )


def queued(stack) -> int:
    """Requests in the request stream: not yet placed on an executor."""
    return stack.redis().xlen(stack.keys.requests)


def held_by_scheduler(stack) -> int:
    """Requests the scheduler read and holds in its window, not yet placed."""
    return stack.redis().xpending(stack.keys.requests, SCHEDULER_GROUP)["pending"]


def leader(stack) -> str:
    raw = stack.redis().get(stack.keys.scheduler_leader)
    return raw.decode() if raw else ""


def run_in_background(pool, stack, count: int) -> list:
    prompts = [f"Once upon a time there was a cat called {i}" for i in range(count)]
    return [pool.submit(generate, stack.address, p, max_tokens=8, ignore_eos=True) for p in prompts]


def assert_all_complete(futures) -> None:
    completions = [f.result(timeout=120) for f in futures]
    short = [c for c in completions if len(c.token_ids) != 8]
    assert not short, f"{len(short)} of {len(completions)} queued requests did not complete"


def test_a_request_queued_past_queue_timeout_s_is_deadline_exceeded_by_the_server(stack):
    """The scheduler's 3 s window holds the request past a 1 s queue_timeout_s; the client
    would wait 60 s, so DEADLINE_EXCEEDED naming queue_timeout_s can only come from the
    gateway."""
    port = free_port()
    stack.start_gateway("gateway-impatient", port, ["--queue-timeout-s", "1"])
    address = f"{stack.config.host}:{port}"
    with pytest.raises(grpc.RpcError) as caught:
        generate(address, "Once upon a time", timeout_s=60.0, max_tokens=8)
    code, details = caught.value.code(), caught.value.details()
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED, f"{code}: {details}"
    assert "queue_timeout_s" in details, f"expected the gateway's queue timeout, got {details!r}"
    wait_for(lambda: queued(stack) == 0, "the expired request to leave the queue", timeout_s=10.0)
    stack.stop("gateway-impatient")
    completion = generate(stack.address, "Once upon a time", max_tokens=1)
    assert completion.finish_reason == "length", "the service stopped answering"


def test_requests_held_by_a_killed_scheduler_complete_under_the_standby(stack):
    stack.start_scheduler("scheduler-standby", wait=False)
    with ThreadPoolExecutor(4) as pool:
        futures = run_in_background(pool, stack, 4)
        wait_for(
            lambda: held_by_scheduler(stack) == 4,
            "4 requests held by the scheduler",
            timeout_s=10.0,
        )
        assert leader(stack) == "scheduler", "the standby took the lock from a live leader"
        stack.stop("scheduler", sig=signal.SIGKILL)
        assert_all_complete(futures)
    assert leader(stack) == "scheduler-standby"


def test_a_full_queue_is_resource_exhausted_and_drains_after_a_restart(stack):
    stack.stop("scheduler-standby", sig=signal.SIGKILL)
    with ThreadPoolExecutor(MAX_QUEUE_LEN) as pool:
        futures = run_in_background(pool, stack, MAX_QUEUE_LEN)
        wait_for(
            lambda: queued(stack) == MAX_QUEUE_LEN,
            f"{MAX_QUEUE_LEN} queued requests",
            timeout_s=10.0,
        )
        with pytest.raises(grpc.RpcError) as caught:
            generate(stack.address, "One more", timeout_s=10.0, max_tokens=8)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        stack.start_scheduler("scheduler-restarted")
        assert_all_complete(futures)


def test_no_live_executor_is_unavailable_before_the_clients_deadline(stack):
    """The gateway answers UNAVAILABLE itself (the client would wait 60 s, and end with
    DEADLINE_EXCEEDED)."""
    stack.stop("executor-0", sig=signal.SIGTERM, timeout_s=30.0)
    with pytest.raises(grpc.RpcError) as caught:
        generate(stack.address, "Once upon a time", timeout_s=60.0, max_tokens=8)
    code, details = caught.value.code(), caught.value.details()
    assert code == grpc.StatusCode.UNAVAILABLE and "no executor is alive" in details, details
