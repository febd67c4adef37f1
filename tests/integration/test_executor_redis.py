"""The executor's Redis I/O against a real redis-server: drain hand-back and Redis outages."""

from __future__ import annotations

import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis
import torch
from gguf import GGMLQuantizationType as Q

from common.keys import PAYLOAD_FIELD, RedisKeys
from common.redis_conn import connect_sync
from executor import streams
from executor.heartbeat import Heartbeat, StatusBoard
from executor.streams import InboxEntry, InboxReader
from protos.kvgate.v1 import internal_pb2
from tests.helpers import REPO, STORIES_260K, redis_server, wait_for
from tests.tiny_gguf import write_tiny_llama

KEYS = RedisKeys()
EXECUTOR = "e1"


def assign(client: redis.Redis, request_id: str, deadline_unix_ms: int = 0) -> None:
    message = internal_pb2.InboxMessage()
    request = message.assignment.request
    request.request_id = request_id
    request.queue_deadline_unix_ms = deadline_unix_ms
    message.assignment.executor_id = EXECUTOR
    client.xadd(KEYS.executor_inbox(EXECUTOR), {PAYLOAD_FIELD: message.SerializeToString()})


def release(client: redis.Redis, session_id: str) -> None:
    message = internal_pb2.InboxMessage()
    message.release_session.session_id = session_id
    client.xadd(KEYS.executor_inbox(EXECUTOR), {PAYLOAD_FIELD: message.SerializeToString()})


def requeued(client: redis.Redis) -> dict[str, internal_pb2.QueuedRequest]:
    """The requests on the request stream, by id."""
    entries = client.xrange(KEYS.requests)
    parsed = [internal_pb2.QueuedRequest.FromString(f[PAYLOAD_FIELD.encode()]) for _, f in entries]
    return {r.request_id: r for r in parsed}


def test_a_draining_reader_hands_back_assignments_and_still_delivers_releases(redis_client):
    delivered: queue.SimpleQueue[InboxEntry] = queue.SimpleQueue()
    reader = InboxReader(redis_client, KEYS, EXECUTOR, delivered)
    reader.start()
    try:
        assign(redis_client, "before-drain")
        first = delivered.get(timeout=5.0)
        assert first.message.assignment.request.request_id == "before-drain"
        reader.handled(first.entry_id)
        reader.hand_back_assignments()
        deadline_unix_ms = int(time.time() * 1000) + 60_000
        assign(redis_client, "during-drain", deadline_unix_ms)
        release(redis_client, "s1")
        entry = delivered.get(timeout=5.0)
        assert entry.message.release_session.session_id == "s1", "a release was not delivered"
        reader.handled(entry.entry_id)
        back = wait_for(lambda: requeued(redis_client).get("during-drain"), "the hand-back")
    finally:
        reader.stop()
    assert back.attempt == 0, f"a request handed back unrun keeps its attempt, got {back.attempt}"
    assert back.queue_deadline_unix_ms == deadline_unix_ms, "the queue deadline changed"
    assert "before-drain" not in requeued(redis_client), (
        "an assignment taken before the drain came back"
    )
    assert delivered.empty(), "an assignment read during the drain was delivered to the engine"
    assert redis_client.xlen(KEYS.executor_inbox(EXECUTOR)) == 0, (
        "handled entries stayed in the inbox"
    )


def drained(delivered: queue.SimpleQueue[InboxEntry]) -> list[str]:
    ids = []
    while not delivered.empty():
        ids.append(delivered.get().message.assignment.request.request_id)
    return ids


def later(seconds: float, action) -> threading.Timer:
    timer = threading.Timer(seconds, action)
    timer.start()
    return timer


def test_an_idle_step_loop_reads_entries_itself_while_the_thread_pauses(redis_client):
    delivered: queue.SimpleQueue[InboxEntry] = queue.SimpleQueue()
    reader = InboxReader(redis_client, KEYS, EXECUTOR, delivered)
    reader.start()
    try:
        reader.read_while_idle(400)  # the thread's own read ends meanwhile, and it pauses
        assert drained(delivered) == []
        later(0.1, lambda: assign(redis_client, "idle"))
        reader.read_while_idle(5000)
        assert drained(delivered) == ["idle"], "the idle read did not take the entry itself"
        assign(redis_client, "unread")
        time.sleep(0.5)
        assert drained(delivered) == [], "the paused thread read an entry"
        reader.read_on_thread()
        assert delivered.get(timeout=5.0).message.assignment.request.request_id == "unread"
    finally:
        reader.stop()


def test_an_entry_both_readers_get_is_delivered_once(redis_client, monkeypatch):
    # The thread's read outlasts each round, so both readers surely wait when the entry comes.
    monkeypatch.setattr(streams, "INBOX_BLOCK_MS", 2000)
    delivered: queue.SimpleQueue[InboxEntry] = queue.SimpleQueue()
    reader = InboxReader(redis_client, KEYS, EXECUTOR, delivered)
    reader.start()
    try:
        for index in range(10):
            reader.read_on_thread()
            time.sleep(0.05)  # the thread waits on the stream now
            later(0.05, lambda i=index: assign(redis_client, f"r{i}"))
            reader.read_while_idle(500)
            first = delivered.get(timeout=30.0).message.assignment.request.request_id
            time.sleep(0.3)  # a second delivery, by the other reader, would be here by now
            assert [first, *drained(delivered)] == [f"r{index}"], "not delivered exactly once"
    finally:
        reader.stop()


def test_the_idle_read_does_not_wait_while_an_entry_is_queued(redis_client):
    """An entry the thread queued just before the idle read is not left waiting behind it."""
    delivered: queue.SimpleQueue[InboxEntry] = queue.SimpleQueue()
    reader = InboxReader(redis_client, KEYS, EXECUTOR, delivered)
    assign(redis_client, "queued-first")
    reader._read(None, "0")  # the thread's last read, just before the step loop went idle
    idle_read = threading.Thread(target=reader.read_while_idle, args=(60_000,), daemon=True)
    idle_read.start()
    idle_read.join(20.0)
    assert not idle_read.is_alive(), "the idle read waited with an entry queued"
    assert drained(delivered) == ["queued-first"]


def test_the_idle_read_waits_out_redis_errors_and_logs_once(tmp_path: Path, caplog):
    client = connect_sync(f"unix://{tmp_path}/no-redis.sock", timeout_s=0.5)
    reader = InboxReader(client, KEYS, EXECUTOR, queue.SimpleQueue())
    with caplog.at_level("WARNING", logger="executor.streams"):
        for _ in range(3):
            reader.read_while_idle(10)
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "inbox: redis unreachable" in caplog.records[0].message


def test_an_outage_logs_once_and_no_recovery_while_redis_is_still_down(
    tmp_path: Path, caplog, monkeypatch
):
    """The step loop reads the inbox itself while idle, and fails; the reader's thread, paused
    meanwhile, sends Redis nothing and must not log a recovery (it did, once per pass: the
    outage was logged again and again)."""
    monkeypatch.setattr(streams, "INBOX_BLOCK_MS", 50)
    client = connect_sync(f"unix://{tmp_path}/no-redis.sock", timeout_s=0.5)
    reader = InboxReader(client, KEYS, EXECUTOR, queue.SimpleQueue())
    with caplog.at_level("INFO", logger="executor.streams"):
        reader.start()
        try:
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline:
                reader.read_while_idle(50)
        finally:
            reader.stop()
    messages = [r.message for r in caplog.records]
    assert sum("inbox: redis unreachable" in m for m in messages) == 1, messages
    assert not any("reachable again" in m for m in messages), messages


def test_stop_hands_back_the_assignments_left_unread(redis_client):
    assign(redis_client, "r1")
    assign(redis_client, "r2")
    release(redis_client, "s1")
    reader = InboxReader(redis_client, KEYS, EXECUTOR, queue.SimpleQueue())
    reader.stop()
    assert sorted(requeued(redis_client)) == ["r1", "r2"]
    assert all(r.attempt == 0 for r in requeued(redis_client).values()), "they never ran"
    assert redis_client.xlen(KEYS.executor_inbox(EXECUTOR)) == 0, "the inbox was not emptied"


def test_heartbeat_and_inbox_survive_redis_being_down(tmp_path: Path):
    client = connect_sync(f"unix://{tmp_path}/no-redis.sock", timeout_s=0.5)
    board = StatusBoard()
    board.post(internal_pb2.ExecutorStatus(executor_id=EXECUTOR))
    heartbeat = Heartbeat(client, KEYS, board)
    reader = InboxReader(client, KEYS, EXECUTOR, queue.SimpleQueue())
    heartbeat.start()
    reader.start()
    reader.hand_back_assignments()
    assert heartbeat.try_beat() is False
    reader.stop()
    heartbeat.stop()


def wait_or_dump_stacks(process: subprocess.Popen, timeout_s: float, log_path: Path) -> int:
    """The process's exit status; if it has not exited in time, fail with its threads' stacks
    (SIGUSR1, see common/startup.py) and its log."""
    try:
        return process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGUSR1)
        time.sleep(1.0)
        pytest.fail(f"still running {timeout_s:g} s after SIGTERM:\n{log_path.read_text()}")


def test_an_executor_started_before_redis_registers_once_redis_is_up(tmp_path: Path):
    socket_path = tmp_path / "redis.sock"
    argv = [
        sys.executable, "-m", "executor", "--model", str(STORIES_260K),
        "--redis-url", f"unix://{socket_path}", "--executor-id", EXECUTOR,
        "--num-gpu-blocks", "64", "--metrics-port", "-1",
    ]  # fmt: skip
    log_path = tmp_path / "executor.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(argv, cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        serving_by = time.monotonic() + 60.0  # loading torch and the model on a busy machine
        while "serving" not in log_path.read_text() and time.monotonic() < serving_by:
            time.sleep(0.1)
        time.sleep(1.0)  # a few failed beats and reads
        assert process.poll() is None, f"the executor exited without redis:\n{log_path.read_text()}"
        with redis_server(tmp_path) as url:
            up = redis.Redis.from_url(url)
            wait_for(lambda: up.get(KEYS.executor_status(EXECUTOR)), "the executor's heartbeat")
            process.send_signal(signal.SIGTERM)
            assert wait_or_dump_stacks(process, 30.0, log_path) == 0, log_path.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    log_text = log_path.read_text()
    assert "Traceback" not in log_text, log_text
    assert log_text.count("heartbeat: redis unreachable") == 1, f"expected one line:\n{log_text}"


def test_an_executor_whose_id_a_live_executor_has_exits_naming_the_flag(tmp_path: Path):
    with redis_server(tmp_path) as url:
        client = redis.Redis.from_url(url)
        stop = threading.Event()

        def beat() -> None:  # a live executor "dup-1": its status key refreshed every 0.3 s
            while not stop.is_set():
                client.set(KEYS.executor_status("dup-1"), b"", px=2000)
                stop.wait(0.3)

        beater = threading.Thread(target=beat, daemon=True)
        beater.start()
        try:
            done = subprocess.run(
                [sys.executable, "-m", "executor", "--model", str(STORIES_260K), "--redis-url", url,
                 "--executor-id", "dup-1", "--num-gpu-blocks", "64", "--metrics-port", "-1"],
                cwd=REPO, capture_output=True, text=True, timeout=120,
            )  # fmt: skip
        finally:
            stop.set()
            beater.join()
    assert done.returncode == 2, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert "--executor-id dup-1: another live executor has this id" in done.stderr, done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_a_cuda_device_on_a_machine_without_one_is_a_flag_error():
    from executor.config import ExecutorConfig

    for device in ("cuda", "cuda:1"):
        with pytest.raises(ValueError, match=f"--device {device}: .* no CUDA device"):
            ExecutorConfig.from_args(["--model", str(STORIES_260K), "--device", device])


@pytest.mark.parametrize("broken", ["tensor_type", "not_gguf"])
def test_a_model_the_executor_cannot_load_is_one_line_naming_it(tmp_path: Path, broken: str):
    path = tmp_path / "bad.gguf"
    if broken == "tensor_type":
        write_tiny_llama(path, {"blk.1.attn_v": Q.Q8_1})  # the gguf package has no Q8_1 reader
        expected = r"tensor blk\.1\.attn_v\.weight has type Q8_1"
    else:
        path.write_bytes(b"not a gguf file at all")
        expected = "not a readable GGUF file"
    with redis_server(tmp_path) as url:
        done = subprocess.run(
            [sys.executable, "-m", "executor", "--model", str(path), "--redis-url", url,
             "--num-gpu-blocks", "64", "--metrics-port", "-1"],
            cwd=REPO, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert done.returncode == 2, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert "Traceback" not in done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"executor: --model {path}: "), done.stderr
    assert re.search(expected, last), done.stderr
