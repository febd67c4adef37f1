"""Integration tests: a real redis-server on a free port, real processes, real gRPC channels."""

from __future__ import annotations

import json
import shutil
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import redis

from client.api import Completion, KvgateClient, sampling_params
from common.model_text import ModelText
from common.tenants import DEFAULT_TENANT
from deploy.certs import Pem
from deploy.stack import Stack, StackConfig, free_port
from protos.kvgate.v1 import inference_pb2, internal_pb2
from tests.helpers import STORIES_260K, redis_server, wait_for
from tests.integration.gateway_harness import ExecutorPeer, GatewayThread, make_gateway

MODEL = STORIES_260K
# A small, fixed KV cache: fast to start, and free blocks are easy to compare.
EXECUTOR_FLAGS = ["--num-gpu-blocks", "512", "--block-size", "16", "--max-num-seqs", "64"]

if shutil.which("redis-server") is None or not (MODEL / "config.json").is_file():
    pytest.skip(
        "integration tests need redis-server and ../shared/models/stories260K",
        allow_module_level=True,
    )


def tls_flags(ca: str, public: Pem, sink: Pem, executor: Pem) -> dict[str, list[str]]:
    """start_stack's gateway_flags and executor_flags for TLS on the public port (`public`)
    and mutual TLS on the TokenSink (`sink` the gateway's, `executor` the executors')."""
    return {
        "gateway_flags": [
            "--tls-cert", public.cert, "--tls-key", public.key,
            "--internal-tls-cert", sink.cert, "--internal-tls-key", sink.key,
            "--internal-tls-client-ca", ca,
        ],
        "executor_flags": [
            "--sink-tls-ca", ca, "--sink-tls-cert", executor.cert, "--sink-tls-key", executor.key,
        ],
    }  # fmt: skip


def start_stack(
    log_dir: Path,
    num_executors: int = 1,
    gateway_flags: list[str] | None = None,
    scheduler_flags: list[str] | None = None,
    log_format: str | None = None,
    executor_flags: list[str] | None = None,
    model: Path = MODEL,
    **stack_fields,
) -> Stack:
    """Starts redis, a scheduler, executors and a gateway; returns once all serve.

    `executor_flags` come after EXECUTOR_FLAGS; `stack_fields` are more StackConfig fields.
    """
    config = StackConfig(
        model=str(model),
        port=free_port(),
        log_dir=log_dir,
        executor_flags=EXECUTOR_FLAGS + (executor_flags or []),
        scheduler_flags=scheduler_flags or ["--batch-window-ms", "2"],
        gateway_flags=gateway_flags or [],
        **stack_fields,
    )
    config.log_format = log_format or config.log_format  # None: the default (json, or the env's)
    stack = Stack(config)
    try:
        stack.start_all(num_executors=num_executors)
    except BaseException:
        stack.stop_all()
        raise
    return stack


# Lines of each process's log a failed test's report ends with (CI keeps only the report).
FAILURE_LOG_LINES = 25


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A failed test that used a stack gets the last lines of each of its processes' logs
    in its report, so that a failure in CI says what the processes did."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    stacks = [v for v in getattr(item, "funcargs", {}).values() if isinstance(v, Stack)]
    for stack in stacks:
        for path in sorted(stack.config.log_dir.glob("*.log")):
            lines = path.read_text(errors="replace").splitlines()[-FAILURE_LOG_LINES:]
            report.sections.append((f"log {path.name}", "\n".join(map(compact, lines))))


def compact(line: str) -> str:
    """A JSON log line as `time level message {fields}`; other lines as they are."""
    try:
        record = json.loads(line)
    except ValueError:
        return line
    if not isinstance(record, dict):
        return line
    head = [str(record.pop(k, "")) for k in ("ts", "level", "msg")]
    record.pop("process", None)
    record.pop("logger", None)
    return " ".join(head) + (f" {record}" if record else "")


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A private redis-server for the test module (a unix socket): its URL."""
    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    """A client of the module's redis-server, emptied for each test."""
    client = redis.Redis.from_url(redis_url)
    client.flushall()
    yield client
    client.close()


@pytest.fixture(scope="module")
def stack_factory(tmp_path_factory) -> Iterator[Callable[..., Stack]]:
    """Starts stacks for one test module and stops them all after it."""
    stacks: list[Stack] = []

    def make(**kwargs) -> Stack:
        stack = start_stack(tmp_path_factory.mktemp("stack-logs"), **kwargs)
        stacks.append(stack)
        return stack

    yield make
    for stack in stacks:
        stack.stop_all()


def generate(
    address: str, prompt: str, timeout_s: float = 120.0, session_id: str = "", **params
) -> Completion:
    """The whole greedy completion of `prompt` (keyword arguments as client.sampling_params);
    a failure is the gateway's own answer (the client does not retry it)."""
    params.setdefault("temperature", 0.0)
    completion = Completion()
    with KvgateClient(address, timeout_s=timeout_s, retry=False) as client:
        stream = client.generate_stream(prompt, sampling_params(**params), session_id=session_id)
        for chunk in stream:
            completion.add(chunk)
    return completion


def scrape(stack: Stack, name: str) -> str:
    """The /metrics text of one process of the stack."""
    url = f"http://127.0.0.1:{stack.metrics_ports[name]}/metrics"
    with urllib.request.urlopen(url, timeout=10.0) as reply:
        return reply.read().decode()


def kv_cache_idle(stack: Stack, executor_id: str = "executor-0") -> bool:
    """Whether the executor holds no KV block: no request and no session pins one."""
    status = stack.executor_status(executor_id)
    return (
        status is not None
        and not status.session_ids
        and status.num_free_blocks == status.num_total_blocks
    )


def assert_alive_and_idle(stack: Stack) -> None:
    """A one-executor stack's processes all run, and its KV cache goes idle."""
    for name in ("scheduler", "executor-0", "gateway"):
        assert stack.procs[name].poll() is None, f"{name} died"
    wait_for(
        lambda: kv_cache_idle(stack),
        "every KV block free (no request or session holding one)",
        timeout_s=30.0,
    )


def log_lines(stack: Stack, name: str, *needles: str) -> list[str]:
    """Lines of process `name`'s log holding every needle (none when it never ran)."""
    path = stack.config.log_dir / f"{name}.log"
    text = path.read_text() if path.exists() else ""
    return [line for line in text.splitlines() if all(n in line for n in needles)]


def session_executor(stack: Stack, session_id: str, tenant: str = DEFAULT_TENANT) -> str:
    """Returns: the executor that ran the session's last turn, as the gateway recorded it."""
    raw = stack.redis().get(stack.keys.session(tenant, session_id))
    assert raw is not None, f"session {session_id} is not in redis"
    return internal_pb2.SessionState.FromString(raw).executor_id


def open_stream(client: KvgateClient, prompt: str, **params) -> grpc.Future:
    """Starts a Generate stream and returns the call (an iterator of chunks, cancellable)."""
    params.setdefault("temperature", 0.0)
    request = inference_pb2.GenerateRequest(prompt=prompt, params=sampling_params(**params))
    return client.stub.Generate(request, timeout=120.0)


# The gateway alone, with the executor's side of the wire played by the test.
@pytest.fixture(scope="module")
def model_text() -> ModelText:
    return ModelText(STORIES_260K)


@pytest.fixture
def gateway_overrides() -> dict:
    """GatewayConfig fields the `gateway` fixture sets; a module overrides it (auth on...)."""
    return {}


@pytest.fixture
def gateway(redis_url: str, redis_client: redis.Redis, gateway_overrides: dict):
    running = make_gateway(redis_url, **gateway_overrides)
    yield running
    running.stop()


@pytest.fixture
def executor(redis_client: redis.Redis, gateway: GatewayThread):
    peer = ExecutorPeer.attached(redis_client, gateway)
    yield peer
    peer.link.close()
