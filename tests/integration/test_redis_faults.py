"""Redis failing under a running stack: turned read-only for 5 s (what a failover does to
the old master), then killed and restarted on its append-only file under load."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from client.api import KvgateClient, sampling_params
from tests.helpers import wait_for

PROCESSES = ("scheduler", "executor-0", "gateway")


@pytest.fixture(scope="module")
def stack(stack_factory):
    return stack_factory(num_executors=1)


def pids(stack) -> dict[str, int]:
    return {name: stack.procs[name].pid for name in PROCESSES}


def outcome(address: str, prompt: str, max_tokens: int, streaming: list | None = None) -> str:
    """'complete', or the status code and details the call failed with; `streaming` gets an
    item at the first token."""
    params = sampling_params(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    count = 0
    try:
        with KvgateClient(address, timeout_s=60.0, retry=False) as client:
            for chunk in client.generate_stream(prompt, params):
                if streaming is not None and chunk.token_ids and not count:
                    streaming.append(1)
                count += len(chunk.token_ids)
    except grpc.RpcError as error:
        return f"{error.code().name}: {error.details()}"
    return "complete" if count == max_tokens else f"{count} tokens"


def test_redis_read_only_for_5_s_is_unavailable_then_everything_recovers(stack):
    """REPLICAOF (what a failover does to a master): writes fail with READONLY and blocked
    reads with UNBLOCKED. Before, the scheduler exited, the executor's heartbeat thread died
    and the gateway answered UNKNOWN."""
    before = pids(stack)
    client = stack.redis()
    streaming: list = []
    with ThreadPoolExecutor(8) as pool:
        running = pool.submit(outcome, stack.address, "Once upon a time", 300, streaming)
        wait_for(lambda: streaming, "the stream's first token", 60.0)
        client.execute_command("REPLICAOF", "127.0.0.1", "1")  # a master that is not there
        try:
            time.sleep(0.5)
            during = list(pool.map(lambda i: outcome(stack.address, f"The cat {i}", 8), range(4)))
            time.sleep(4.5)
        finally:
            client.execute_command("REPLICAOF", "NO", "ONE")
        assert running.result() == "complete", "a stream running before needs no Redis"
    assert all(o.startswith("UNAVAILABLE: ") for o in during), during
    wait_for(lambda: stack.executor_status("executor-0"), "the executor's heartbeat again")
    assert outcome(stack.address, "The dog", 8) == "complete"
    assert pids(stack) == before, "every process must survive (none restarted)"
    assert all(stack.procs[name].poll() is None for name in PROCESSES)


def test_sessions_and_queued_requests_survive_a_redis_restart_under_load(stack):
    """Redis is killed (kill -9) and started again on its append-only file while 20 streams
    run and 10 requests wait in the request stream (the scheduler paused): every one
    completes, and a session recorded before goes on, its history and its executor's KV
    cache intact."""
    with KvgateClient(stack.address, timeout_s=60.0) as client:
        chat = client.chat()
        chat.ask("Tell me a story", max_tokens=16, temperature=0.0)
        session_id = chat.session_id
        chat.close()
    scheduler = stack.procs["scheduler"]
    streaming: list = []
    with ThreadPoolExecutor(30) as pool:
        running = [
            pool.submit(outcome, stack.address, f"Once upon a time {i}", 200, streaming)
            for i in range(20)
        ]
        wait_for(lambda: len(streaming) == 20, "20 streams running")
        scheduler.send_signal(signal.SIGSTOP)
        try:
            queued = [pool.submit(outcome, stack.address, f"The cat {i}", 8) for i in range(10)]
            wait_for(lambda: stack.redis().xlen(stack.keys.requests) == 10, "10 queued")
            time.sleep(1.1)  # appendfsync everysec: on disk
            stack.stop("redis", sig=signal.SIGKILL)
            time.sleep(1.0)
            stack.start_redis()
        finally:
            scheduler.send_signal(signal.SIGCONT)
        outcomes = [f.result(timeout=120) for f in running + queued]
    assert outcomes == ["complete"] * 30, outcomes
    assert stack.redis().get(stack.keys.session("default", session_id)), (
        "the session did not survive"
    )
    with KvgateClient(stack.address, timeout_s=60.0) as client:
        chat = client.chat(session_id=session_id)
        second = chat.ask("And then?", max_tokens=8, temperature=0.0)
        chat.close()
    assert second.finish_reason == "length", second
    assert second.usage.cached_prompt_tokens > 0, "the session's KV cache was not reused"


def test_the_launcher_runs_redis_with_an_append_only_file(stack):
    config = stack.redis().config_get("appendonly")
    assert config == {"appendonly": "yes"}, config
    assert (stack.redis_dir / "appendonlydir").is_dir()
