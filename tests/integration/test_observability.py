"""Observability of a running stack: /metrics of every process (checked by promtool) and
JSON logs in which one request is followed by its id through gateway, scheduler and executor."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
import uuid
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from client.api import KvgateClient, sampling_params
from deploy.stack import Stack
from kernels import cpu_build
from protos.kvgate.v1 import inference_pb2
from tests.helpers import wait_for
from tests.integration.conftest import generate, scrape

PROCESSES = ("gateway", "scheduler", "executor-0")
NUM_REQUESTS = 3
MAX_TOKENS = 8
INFERENCE = "kvgate.v1.Inference"
KVGATE = "kvgate"  # the api label of calls through the gRPC front
EXPECTED_METRICS = {
    "gateway": [
        "kvgate_gateway_requests_total",
        "kvgate_gateway_active_streams",
        "kvgate_gateway_ttft_seconds_bucket",
        "kvgate_gateway_itl_seconds_bucket",
        "kvgate_gateway_e2e_seconds_bucket",
        "kvgate_gateway_output_tokens_total",
    ],
    "scheduler": [
        "kvgate_scheduler_queue_length",
        "kvgate_scheduler_queue_wait_seconds_bucket",
        "kvgate_scheduler_batch_size_bucket",
        "kvgate_scheduler_batch_tokens_bucket",
        "kvgate_scheduler_window_releases_total",
        "kvgate_scheduler_executors_alive",
    ],
    "executor-0": [
        "kvgate_executor_running_requests",
        "kvgate_executor_waiting_requests",
        "kvgate_executor_kv_usage_ratio",
        "kvgate_executor_prefix_cache_hit_tokens_total",
        "kvgate_executor_session_pins",
        "kvgate_executor_evicted_blocks_total",
        "kvgate_executor_preemptions_total",
        "kvgate_executor_step_seconds_bucket",
        "kvgate_executor_step_tokens_bucket",
        "kvgate_executor_kernels",
    ],
}

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(scope="module")
def slow_file(tmp_path_factory) -> Path:
    """While this file exists each step of the executor takes 0.05 s (engine/faults.py)."""
    return tmp_path_factory.mktemp("faults") / "slow"


@pytest.fixture(scope="module")
def stack(stack_factory, slow_file) -> Stack:
    faults = {"KVGATE_FAULTS": f"slow_while_file={slow_file}:0.05"}
    return stack_factory(log_format="json", executor_env=faults)


def parse(text: str) -> Samples:
    """Every sample of a scrape: (name, sorted labels) -> value."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """A sample's value; 0 when the process has not exported it yet."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def run_requests(stack: Stack) -> int:
    """Sends NUM_REQUESTS generations. Returns: the tokens they produced."""
    completions = [
        generate(stack.address, f"Once upon a time {i}", max_tokens=MAX_TOKENS)
        for i in range(NUM_REQUESTS)
    ]
    return sum(len(c.token_ids) for c in completions)


def send_invalid_request(stack: Stack) -> None:
    with KvgateClient(stack.address, timeout_s=30.0) as client:
        request = inference_pb2.GenerateRequest(prompt="", params=sampling_params(max_tokens=4))
        with pytest.raises(grpc.RpcError) as raised:
            list(client.stub.Generate(request, timeout=30.0))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def increase(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool missing (make promtool)")
def test_every_process_serves_metrics_that_promtool_accepts(stack: Stack) -> None:
    run_requests(stack)
    for name in PROCESSES:
        text = scrape(stack, name)
        check = subprocess.run(
            ["promtool", "check", "metrics"], input=text, capture_output=True, text=True
        )
        assert check.returncode == 0, (
            f"promtool check metrics of {name}: expected no problems, got status "
            f"{check.returncode}: {check.stdout}{check.stderr}"
        )
        names = {sample_name for sample_name, _ in parse(text)}
        missing = [m for m in EXPECTED_METRICS[name] if m not in names]
        assert not missing, f"{name} /metrics: expected {missing} among {sorted(names)}"
        foreign = sorted(n for n in names if not n.startswith("kvgate_"))
        assert not foreign, f"{name} /metrics: every metric should start with kvgate_: {foreign}"


def test_gateway_metrics_count_calls_tokens_and_latencies(stack: Stack) -> None:
    before = parse(scrape(stack, "gateway"))
    num_tokens = run_requests(stack)
    send_invalid_request(stack)
    calls = "kvgate_gateway_requests_total"

    def scraped_once_all_are_counted() -> Samples | None:
        # A call is counted after its status went out: the client may see it end first.
        after = parse(scrape(stack, "gateway"))
        counted = sum(
            increase(
                before, after, calls, service=INFERENCE, method="Generate", code=code, api=KVGATE
            )
            for code in ("OK", "INVALID_ARGUMENT", "UNKNOWN", "CANCELLED")
        )
        return after if counted >= NUM_REQUESTS + 1 else None

    after = wait_for(scraped_once_all_are_counted, "every Generate call counted")
    ok = increase(before, after, calls, service=INFERENCE, method="Generate", code="OK", api=KVGATE)
    assert ok == NUM_REQUESTS, f"expected {NUM_REQUESTS} OK Generate calls counted, got {ok}"
    invalid = increase(
        before,
        after,
        calls,
        service=INFERENCE,
        method="Generate",
        code="INVALID_ARGUMENT",
        api=KVGATE,
    )
    assert invalid == 1, f"expected 1 INVALID_ARGUMENT Generate call counted, got {invalid}"
    for histogram in ("ttft", "e2e"):
        count = increase(before, after, f"kvgate_gateway_{histogram}_seconds_count", api=KVGATE)
        assert count == NUM_REQUESTS, f"{histogram}: expected {NUM_REQUESTS} samples, got {count}"
    itl = increase(before, after, "kvgate_gateway_itl_seconds_count", api=KVGATE)
    assert itl == num_tokens - NUM_REQUESTS, f"expected a gap per token after the first, got {itl}"
    tokens = increase(before, after, "kvgate_gateway_output_tokens_total", api=KVGATE)
    assert tokens == num_tokens, f"expected {num_tokens} output tokens counted, got {tokens}"
    assert value(after, "kvgate_gateway_active_streams", method="Generate", api=KVGATE) == 0


# The deadline of a Chat left waiting for its first turn. The test waits until the gateway
# holds the call before it relies on the deadline passing there: a call still unseen when
# its deadline passes is ended by gRPC core, uncounted (a 0.5 s deadline, at load 9-13).
IDLE_CHAT_DEADLINE_S = 5.0


def test_calls_closed_cancelled_or_past_their_deadline_count_by_their_code(
    stack: Stack, slow_file: Path
) -> None:
    calls = "kvgate_gateway_requests_total"
    before = parse(scrape(stack, "gateway"))
    open_chats = value(before, "kvgate_gateway_active_streams", method="Chat", api=KVGATE)
    with KvgateClient(stack.address, timeout_s=60.0) as client:
        # no turn sent: the call waits for one until its deadline
        idle_chat = client.stub.Chat(
            iter(threading.Event().wait, True), timeout=IDLE_CHAT_DEADLINE_S
        )
        wait_for(
            lambda: (
                value(
                    parse(scrape(stack, "gateway")),
                    "kvgate_gateway_active_streams",
                    method="Chat",
                    api=KVGATE,
                )
                == open_chats + 1
            ),
            "the gateway to hold the idle Chat",
            IDLE_CHAT_DEADLINE_S,
        )
        chat = client.chat()
        assert chat.ask("Tell me a story.", max_tokens=4).token_ids, "the turn produced tokens"
        chat.close(wait_s=30.0)  # a loaded machine may take its time; the client waits
        # Slowed, the request is still streaming when the cancel arrives (at full speed its
        # 400 tokens can end within a loaded client's pause between first chunk and cancel).
        params = sampling_params(max_tokens=400, ignore_eos=True)
        slow_file.touch()
        try:
            call = client.stub.Generate(
                inference_pb2.GenerateRequest(prompt="Once upon a time", params=params),
                timeout=60.0,
            )
            next(call)  # the first chunk: the request is running
            call.cancel()
        finally:
            slow_file.unlink()
        with pytest.raises(grpc.RpcError) as raised:
            next(idle_chat)
        assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    def counts(method: str) -> dict[str, float]:
        after = parse(scrape(stack, "gateway"))
        return {
            code: increase(
                before, after, calls, service=INFERENCE, method=method, code=code, api=KVGATE
            )
            for code in ("OK", "CANCELLED", "DEADLINE_EXCEEDED", "UNKNOWN")
        }

    # A loaded machine may take its time to close the calls: wait long, count exactly.
    wanted = {
        "Chat": {"OK": 1, "CANCELLED": 0, "DEADLINE_EXCEEDED": 1, "UNKNOWN": 0},
        "Generate": {"OK": 0, "CANCELLED": 1, "DEADLINE_EXCEEDED": 0, "UNKNOWN": 0},
    }
    for method, want in wanted.items():
        deadline = time.monotonic() + 30.0
        while (got := counts(method)) != want:
            if time.monotonic() > deadline:
                pytest.fail(f"{method} calls by code: expected {want} within 30 s, got {got}")
            time.sleep(0.05)
    after = parse(scrape(stack, "gateway"))
    unknown = sum(
        v for (n, labels), v in after.items() if n == calls and ("code", "UNKNOWN") in labels
    )
    assert unknown == 0, f"calls counted with code UNKNOWN: {unknown}"


def test_scheduler_metrics_count_batches_and_queue_waits(stack: Stack) -> None:
    before = parse(scrape(stack, "scheduler"))
    run_requests(stack)

    # The scheduler records an assignment right after handing it over: poll until it has.
    def counted() -> bool:
        after = parse(scrape(stack, "scheduler"))
        waits = increase(before, after, "kvgate_scheduler_queue_wait_seconds_count")
        return waits == NUM_REQUESTS and value(after, "kvgate_scheduler_queue_length") == 0

    wait_for(counted, f"{NUM_REQUESTS} queue waits and an empty scheduler queue", timeout_s=10.0)
    after = parse(scrape(stack, "scheduler"))
    batched = increase(before, after, "kvgate_scheduler_batch_size_sum")
    assert batched == NUM_REQUESTS, f"expected {NUM_REQUESTS} requests in batches, got {batched}"
    releases = sum(
        increase(before, after, "kvgate_scheduler_window_releases_total", reason=reason)
        for reason in ("window", "max_batch_size", "max_batch_tokens")
    )
    assert releases == increase(before, after, "kvgate_scheduler_batch_size_count")
    assert value(after, "kvgate_scheduler_executors_alive") == 1
    assert value(after, "kvgate_scheduler_is_leader") == 1


def test_executor_metrics_count_steps_and_tokens(stack: Stack) -> None:
    before = parse(scrape(stack, "executor-0"))
    num_tokens = run_requests(stack)
    after = parse(scrape(stack, "executor-0"))
    steps = increase(before, after, "kvgate_executor_step_seconds_count")
    assert steps >= num_tokens / NUM_REQUESTS, f"expected a step per token at least, got {steps}"
    step_tokens = increase(before, after, "kvgate_executor_step_tokens_sum")
    assert step_tokens >= num_tokens, f"expected >= {num_tokens} tokens stepped, got {step_tokens}"
    assert value(after, "kvgate_executor_kv_blocks") == 512
    assert 0.0 <= value(after, "kvgate_executor_kv_usage_ratio") <= 1.0
    kernels = {key: v for (name, key), v in after.items() if name == "kvgate_executor_kernels"}
    expected = (("backend", "cpu"), ("cpu_isa", cpu_build.isa_level()))
    assert kernels == {expected: 1.0}, f"expected the C kernels' level {expected}, got {kernels}"


def test_executor_gauges_return_to_idle(stack: Stack) -> None:
    run_requests(stack)

    def idle() -> bool:
        samples = parse(scrape(stack, "executor-0"))
        running = value(samples, "kvgate_executor_running_requests")
        return running == 0 and value(samples, "kvgate_executor_waiting_requests") == 0

    wait_for(idle, "executor metrics showing no running or waiting request", timeout_s=10.0)


def log_lines(stack: Stack, name: str) -> list[dict]:
    """Every line of a process's log, each parsed as JSON (fails on a line that is not)."""
    lines = []
    path = stack.config.log_dir / f"{name}.log"
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        try:
            lines.append(json.loads(line))
        except json.JSONDecodeError:
            pytest.fail(f"{path}:{number}: expected a JSON log line, got {line!r}")
    return lines


def test_a_request_is_followed_through_every_log_by_its_id(stack: Stack) -> None:
    request_id = f"trace-{uuid.uuid4().hex}"
    session_id = f"session-{uuid.uuid4().hex}"
    with KvgateClient(stack.address, timeout_s=60.0) as client:
        request = inference_pb2.GenerateRequest(
            prompt="Once upon a time",
            params=sampling_params(max_tokens=MAX_TOKENS, temperature=0.0),
            request_id=request_id,
            session_id=session_id,
        )
        chunks = list(client.stub.Generate(request, timeout=60.0))
    assert chunks[-1].request_id == request_id

    # Between the processes a request's id is the client's scoped to its tenant and its call
    # (gateway.generation.internal_request_id): one id in every process's lines.
    scoped = {
        line["request_id"]
        for line in log_lines(stack, "gateway")
        if line.get("request_id", "").startswith(f"default/{request_id}/")
    }
    assert len(scoped) == 1, (
        f"expected one scoped id of {request_id} in the gateway's log: {scoped}"
    )

    def mentions(name: str) -> list[dict]:
        return [line for line in log_lines(stack, name) if line.get("request_id") in scoped]

    for name in PROCESSES:
        wait_for(
            lambda name=name: bool(mentions(name)), f"{name} logging {request_id}", timeout_s=10.0
        )
        for line in mentions(name):
            assert line.get("session_id") == session_id, (
                f"{name}: a line about {request_id} should carry session_id {session_id}: {line}"
            )
    for line in mentions("executor-0"):
        assert line.get("executor_id") == "executor-0", f"the executor's line lacks its id: {line}"
        assert line["logger"].startswith("executor."), f"a module's logger name: {line}"
