"""The gateway as a process (SIGTERM, a taken port) and the kvgate command against a real
gateway, with the executor's side of the wire driven by the test."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import threading
from concurrent import futures

import grpc
import pytest
import redis

from client import cli
from common.keys import RedisKeys
from common.model_text import ModelText
from protos.kvgate.v1 import inference_pb2 as pb
from tests.helpers import STORIES_260K
from tests.integration.gateway_harness import (
    PROMPT,
    STORY,
    ExecutorPeer,
    GatewayThread,
    story_ids,
)


def test_sigterm_stops_the_gateway_process_with_an_executor_connected(
    redis_url: str, redis_client: redis.Redis
):
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway", "--model", str(STORIES_260K), "--redis-url", redis_url,
         "--port", "0", "--log-format", "json"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    serving = read_log_until(process, "gateway serving on")
    peer = ExecutorPeer(redis_client, RedisKeys())
    peer.connect(serving.split("token sink ")[1].split(",")[0])
    read_log_until(process, "connected its token stream")
    process.send_signal(signal.SIGTERM)
    remaining_log = process.stderr.read()
    assert process.wait(timeout=30) == 0, remaining_log
    assert "gateway stopped" in remaining_log, remaining_log
    peer.link.close()


def read_log_until(process: subprocess.Popen, text: str) -> str:
    """The message of the first JSON log line holding `text`."""
    for line in process.stderr:
        if text in line:
            return json.loads(line)["msg"]
    raise AssertionError(f"the process exited before logging {text!r}")


def answer_in_background(executor: ExecutorPeer, token_ids: list[int], turns: int = 1):
    """Answer the next `turns` queued requests with `token_ids`, from a thread."""

    def answer() -> None:
        for _ in range(turns):
            queued = executor.take_request()
            executor.send(
                queued.request_id, 0, token_ids, finished=True,
                finish_reason=pb.FINISH_REASON_STOP,
            )  # fmt: skip

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    return thread


def test_kvgate_generate_prints_the_completion(
    gateway: GatewayThread, executor: ExecutorPeer, model_text: ModelText, capsys
):
    answering = answer_in_background(executor, story_ids(model_text))
    exit_code = cli.main(
        ["generate", PROMPT, "--max-tokens", "20", "--temperature", "0",
         "--target", gateway.gateway.address],
    )  # fmt: skip
    answering.join()
    assert exit_code == 0
    assert capsys.readouterr().out == STORY + "\n"


def test_kvgate_generate_says_why_a_completion_is_empty(
    gateway: GatewayThread, executor: ExecutorPeer, capsys
):
    answering = answer_in_background(executor, [])  # the model's first token ends it
    exit_code = cli.main(["generate", PROMPT, "--target", gateway.gateway.address])
    answering.join()
    printed = capsys.readouterr()
    assert exit_code == 0 and printed.out == "\n"
    assert "the completion is empty: the model stopped" in printed.err, printed.err
    assert "kvgate chat" in printed.err, printed.err


@pytest.mark.parametrize(("flag", "value"), [("--max-tokens", "-1"), ("--seed", "-3")])
def test_kvgate_generate_names_an_out_of_range_flag_without_a_traceback(
    flag: str, value: str, capsys
):
    with pytest.raises(SystemExit) as exited:
        cli.main(["generate", PROMPT, flag, value, "--target", "127.0.0.1:1"])
    err = capsys.readouterr().err
    assert exited.value.code == 2, f"expected exit status 2, got {exited.value.code}: {err}"
    assert flag in err and value in err, f"the error must name {flag} and {value}: {err!r}"
    assert "Traceback" not in err, err


def test_kvgate_chat_streams_replies_and_ends_its_session(
    gateway: GatewayThread, executor: ExecutorPeer, model_text: ModelText, capsys, monkeypatch
):
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\nmore\n"))
    answering = answer_in_background(executor, story_ids(model_text), turns=2)
    exit_code = cli.main(["chat", "--target", gateway.gateway.address])
    answering.join()
    assert exit_code == 0
    assert capsys.readouterr().out.count(STORY) == 2
    assert executor.client.keys("kvgate:session:*") == [], "the REPL must end its session"


def test_a_gateway_on_a_taken_port_exits_naming_the_flag(redis_url: str):
    """gRPC servers share a port by default (SO_REUSEPORT): a second gateway on a taken
    port used to start and take half of the first one's connections."""
    holder = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = holder.add_insecure_port("127.0.0.1:0")
    holder.start()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "gateway", "--model", str(STORIES_260K),
             "--redis-url", redis_url, "--port", str(port), "--metrics-port", "-1"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    finally:
        holder.stop(grace=None)
    assert done.returncode == 2, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert f"--host/--port: cannot listen on 127.0.0.1:{port}" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
