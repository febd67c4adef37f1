"""The scheduler's batch order under `--policy lpm` against a real stack (redis-server, a
scheduler process, an executor whose heartbeat reports its cached prefix blocks, a gateway):
requests whose prompt starts with a prefix the executor holds are assigned before an earlier
one that shares nothing; fcfs keeps arrival order; aging bounds the wait of the unshared one.

The order is read from the scheduler's own log ("request assigned ..." lines, one per
assignment, written in the order it assigns)."""

from __future__ import annotations

import itertools
import json
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from client.api import sampling_params
from protos.kvgate.v1 import inference_pb2 as pb
from protos.kvgate.v1 import inference_pb2_grpc
from tests.helpers import wait_for

BLOCK_SIZE = 16  # conftest's EXECUTOR_FLAGS
SHARED = [1, *range(300, 364)]  # four full blocks once cached
NUM_SHARED = 3
WINDOW_MS = 2000  # every request of a scenario is queued within one window
# Each scenario's unshared prompt starts with its own tokens: nothing of it is cached.
UNSHARED_STARTS = itertools.count(5, 70)


@pytest.fixture(scope="module")
def stack(stack_factory):
    stack = stack_factory(num_executors=1, log_format="json")
    with grpc.insecure_channel(stack.address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        list(stub.Generate(generation("warm", SHARED + [2])))

    def prefix_reported() -> bool:
        status = stack.executor_status("executor-0")
        return status is not None and len(status.cached_block_hashes) >= len(SHARED) // BLOCK_SIZE

    wait_for(prefix_reported, "the executor's heartbeat reporting the shared prefix")
    return stack


def generation(request_id: str, prompt_token_ids: list[int]) -> pb.GenerateRequest:
    params = sampling_params(max_tokens=2, temperature=0.0, ignore_eos=True)
    return pb.GenerateRequest(
        prompt_token_ids=prompt_token_ids, params=params, request_id=request_id
    )


def queued_count(stack) -> int:
    """Requests in the request stream: queued and not yet assigned."""
    return stack.redis().xlen(stack.keys.requests)


def assignment_order(stack, scheduler: str) -> list[str]:
    """The client request ids the scheduler assigned, in its order."""
    order = []
    for line in stack.log_path(scheduler).read_text().splitlines():
        entry = json.loads(line) if line.startswith("{") else {}
        if entry.get("msg", "").startswith("request assigned"):
            order.append(entry["request_id"].split("/")[1])
    return order


def run_scenario(stack, name: str, flags: list[str], shared_delay_s: float) -> list[str]:
    """Starts scheduler `name` with `flags`, queues one unshared request, then (after
    `shared_delay_s`) NUM_SHARED requests starting with the cached prefix, all in one window.

    Returns: the order the scheduler assigned them in."""
    for running in [n for n in stack.procs if n.startswith("scheduler")]:
        stack.stop(running)
    window = ["--batch-window-ms", str(WINDOW_MS), "--max-batch-size", "64"]
    stack.start_scheduler(name, extra_flags=[*window, *flags])
    start = next(UNSHARED_STARTS)
    lonely = [1, *range(start, start + 64)]
    requests = [generation("lonely", lonely)]
    requests += [generation(f"shared-{i}", [*SHARED, 400 + i]) for i in range(NUM_SHARED)]
    with (
        grpc.insecure_channel(stack.address) as channel,
        ThreadPoolExecutor(len(requests)) as pool,
    ):
        stub = inference_pb2_grpc.InferenceStub(channel)
        calls = []
        for index, request in enumerate(requests):
            calls.append(pool.submit(lambda r=request: list(stub.Generate(r, timeout=60))))
            wait_for(lambda n=index + 1: queued_count(stack) >= n, f"{index + 1} queued")
            if index == 0:
                time.sleep(shared_delay_s)
        assert queued_count(stack) == len(requests), "a request was assigned before all came"
        for call in calls:
            assert call.result()[-1].finish_reason == pb.FINISH_REASON_LENGTH
    return assignment_order(stack, name)


def test_lpm_assigns_the_cached_prefix_requests_before_an_earlier_unshared_one(stack):
    order = run_scenario(stack, "scheduler-lpm", ["--policy", "lpm", "--lpm-aging-ms", "60000"], 0)
    assert order[-1] == "lonely" and len(order) == NUM_SHARED + 1, (
        f"lpm must assign the cached-prefix requests first: {order}"
    )


def test_fcfs_assigns_in_arrival_order(stack):
    order = run_scenario(stack, "scheduler-fcfs", ["--policy", "fcfs"], 0)
    assert order[0] == "lonely", f"fcfs must assign the first arrival first: {order}"


def test_lpm_aging_puts_a_request_that_waited_past_it_first(stack):
    """The unshared request waits the whole window (2 s), past --lpm-aging-ms (1.5 s); the
    cached-prefix ones, queued 1 s after it, have not aged by then."""
    flags = ["--policy", "lpm", "--lpm-aging-ms", "1500"]
    order = run_scenario(stack, "scheduler-lpm-aging", flags, shared_delay_s=1.0)
    assert order[0] == "lonely", f"an aged request must go before younger ones: {order}"
