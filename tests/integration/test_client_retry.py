"""KvgateClient's retries against a real gateway process: killed and started again, or
answering UNAVAILABLE while its Redis is read-only."""

from __future__ import annotations

import subprocess
import sys
import threading

import grpc
import redis

from client.api import KvgateClient
from common.keys import RedisKeys
from common.tenants import DEFAULT_TENANT
from deploy.stack import free_port
from protos.kvgate.v1 import internal_pb2
from tests.helpers import STORIES_260K, wait_for
from tests.integration.gateway_harness import ExecutorPeer

CALL_TIMEOUT_S = 60.0


def start_gateway(redis_url: str, port: int) -> subprocess.Popen:
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway", "--model", str(STORIES_260K), "--redis-url", redis_url,
         "--port", str(port), "--log-format", "json", "--auth", "off"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    for line in process.stderr:
        if "gateway serving on" in line:
            return process
    raise AssertionError(f"the gateway exited with status {process.wait()} before serving")


def test_a_call_whose_gateway_is_killed_ends_with_a_status_within_its_deadline(
    redis_url: str, redis_client: redis.Redis
):
    """A stream waits in the queue (an executor is alive but takes nothing), its gateway is
    killed (kill -9) and started again on the same port with no executor alive: the client's
    retries end the call UNAVAILABLE. Under gRPC's own retry policy (a service config) such
    a call never ended, not even at its deadline."""
    keys = RedisKeys()
    peer = ExecutorPeer(redis_client, keys)
    peer.register()
    port = free_port()
    gateway = start_gateway(redis_url, port)
    outcome: list[str] = []

    def call() -> None:
        try:
            with KvgateClient(f"127.0.0.1:{port}", timeout_s=CALL_TIMEOUT_S) as client:
                list(client.generate_stream("Once upon a time"))
            outcome.append("OK")
        except grpc.RpcError as error:
            outcome.append(error.code().name)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    try:
        wait_for(lambda: redis_client.xlen(keys.requests) == 1, "the call queued")
        gateway.kill()
        gateway.wait()
        redis_client.delete(keys.executor_status(peer.executor_id))
        gateway = start_gateway(redis_url, port)
        thread.join(2 * CALL_TIMEOUT_S)
        assert not thread.is_alive(), f"the call did not end, past its {CALL_TIMEOUT_S} s deadline"
        assert outcome == ["UNAVAILABLE"], outcome
    finally:
        gateway.kill()
        gateway.wait()


def rejected_deletes(client: redis.Redis) -> int:
    """DEL commands Redis refused (READONLY) since its statistics were reset."""
    stats = client.info("commandstats").get("cmdstat_del", {})
    return int(stats.get("rejected_calls", 0))


def test_a_unary_call_refused_unavailable_is_retried_by_the_service_config(
    redis_url: str, redis_client: redis.Redis
):
    """EndSession while Redis refuses writes (a replica, READONLY, as during a failover): the
    gateway answers UNAVAILABLE. Redis is made writable again once it has refused the
    session's DEL, and the call, sent again by gRPC under the client's service config (the
    client sends unary calls once itself), ends the session. Without the service config the
    call fails UNAVAILABLE (checked)."""
    keys = RedisKeys()
    session = internal_pb2.SessionState(session_id="s-retried", tenant=DEFAULT_TENANT)
    redis_client.set(keys.session(DEFAULT_TENANT, "s-retried"), session.SerializeToString())
    port = free_port()
    gateway = start_gateway(redis_url, port)
    ended: list[object] = []
    try:
        with KvgateClient(f"127.0.0.1:{port}", timeout_s=CALL_TIMEOUT_S) as client:
            client.model_info()  # connected: the call below meets the gateway, not a connect
            redis_client.replicaof("127.0.0.1", free_port())  # a master that is not there
            redis_client.config_resetstat()
            thread = threading.Thread(target=lambda: ended.append(end_session(client)))
            thread.start()
            wait_for(lambda: rejected_deletes(redis_client) >= 1, "a DEL refused as READONLY")
            redis_client.replicaof("NO", "ONE")
            thread.join(CALL_TIMEOUT_S)
    finally:
        redis_client.replicaof("NO", "ONE")
        gateway.kill()
        gateway.wait()
    assert ended == [True], f"expected the retried EndSession to end the session: {ended}"
    assert redis_client.exists(keys.session(DEFAULT_TENANT, "s-retried")) == 0


def end_session(client: KvgateClient) -> object:
    """EndSession's `ended`, or the status code name of its failure."""
    try:
        return client.end_session("s-retried")
    except grpc.RpcError as error:
        return error.code().name
