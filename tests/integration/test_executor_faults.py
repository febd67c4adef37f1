"""Executors that fail: a poison request, a crash mid-stream, a wedged step loop, a request
that kills every executor it lands on; and a scheduler paused past its leader lock.

Two real executors run stories260K with faults switched on (engine/faults.py): a prompt
holding POISON_TOKEN makes the forward pass raise, one holding CRASH_TOKEN kills the process,
an executor's step stalls for a minute once its stall file exists, and each step sleeps 50 ms
while its slow file exists. Every text is compared with an undisturbed run of the same
requests.
"""

from __future__ import annotations

import json
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import jsonschema
import pytest

from client.api import Completion, KvgateClient, sampling_params
from deploy.stack import Stack, free_port
from engine.faults import CRASH_STATUS
from protos.kvgate.v1 import inference_pb2
from tests.helpers import wait_for
from tests.unit.test_engine_structured import PERSON

# Four bounded PERSON objects: always complete within 400 tokens (each object's JSON is
# under 80 characters), and long enough to be cut by a kill mid-stream.
PEOPLE = {"type": "array", "items": PERSON, "minItems": 4, "maxItems": 4}
T = TypeVar("T")
POISON_TOKEN = 509
CRASH_TOKEN = 510
PROMPTS = ["Once upon a time", "The cat", "A big red ball", "Tom had a toy", "The sun was"]


@pytest.fixture(scope="module")
def stall_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("stall")


def start_faulty_executor(stack: Stack, executor_id: str, stall_dir: Path) -> None:
    faults = (
        f"raise_on_token={POISON_TOKEN},exit_on_token={CRASH_TOKEN},"
        f"stall_when_file={stall_dir / executor_id}:60,"
        f"slow_while_file={stall_dir / executor_id}.slow:0.05"
    )
    stack.start_executor(executor_id, wait=False, extra_env={"KVGATE_FAULTS": faults})


def restart_executors(stack: Stack, stall_dir: Path, *executor_ids: str) -> None:
    for executor_id in executor_ids:
        if executor_id in stack.procs:
            stack.stop(executor_id, sig=signal.SIGKILL)
        start_faulty_executor(stack, executor_id, stall_dir)
    for executor_id in executor_ids:
        stack.wait_executor(executor_id)


@pytest.fixture(scope="module")
def stack(stack_factory, stall_dir):
    stack = stack_factory(num_executors=0)
    restart_executors(stack, stall_dir, "executor-0", "executor-1")
    return stack


def request(index: int, max_tokens: int, seeded: bool, **fields) -> inference_pb2.GenerateRequest:
    params = sampling_params(
        max_tokens=max_tokens,
        temperature=0.8 if seeded else 0.0,
        seed=1000 + index if seeded else None,
        ignore_eos=True,
    )
    prompt = f"{PROMPTS[index % len(PROMPTS)]} number {index}"
    return inference_pb2.GenerateRequest(prompt=prompt, params=params, **fields)


def run(
    address: str, req: inference_pb2.GenerateRequest, streaming: list[int] | None = None
) -> Completion:
    """The whole completion of `req`; `streaming` gets one item at its first token."""
    completion = Completion()
    with KvgateClient(address, timeout_s=120.0) as client:
        for chunk in client.stub.Generate(req, timeout=120.0):
            if streaming is not None and chunk.token_ids and not completion.token_ids:
                streaming.append(1)
            completion.add(chunk)
    return completion


def run_all(address: str, requests: list[inference_pb2.GenerateRequest]) -> list[Completion]:
    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(lambda r: run(address, r), requests))


def assert_same_texts(got: list[Completion], want: list[Completion], what: str) -> None:
    for index, (g, w) in enumerate(zip(got, want, strict=True)):
        assert (g.finish_reason, g.token_ids) == (w.finish_reason, w.token_ids), (
            f"{what}: request {index} differs from its undisturbed run:\n"
            f"want {w.finish_reason} {w.text!r}\ngot  {g.finish_reason} {g.text!r}"
        )


def now_ms() -> int:
    return int(time.time() * 1000)


def running_on(stack: Stack, executor_id: str, since_ms: int = 0) -> int | None:
    """Requests running on the executor by its last heartbeat; None when it has no heartbeat
    taken at or after `since_ms` (a heartbeat is up to a beat old)."""
    status = stack.executor_status(executor_id)
    if status is None or status.heartbeat_unix_ms < since_ms:
        return None
    return status.num_running


def wait_idle(stack: Stack, *executor_ids: str) -> None:
    """Waits for a heartbeat of each executor taken after now that shows nothing running, so
    that the scheduler's view of them is current (both are free to take the next requests)."""
    since_ms = now_ms()
    for executor_id in executor_ids:
        wait_for(
            lambda e=executor_id: running_on(stack, e, since_ms) == 0, f"{executor_id} idle", 30.0
        )


def test_a_poison_request_fails_alone_and_the_executors_stay_up(stack):
    requests = [request(i, 48, seeded=False) for i in range(8)]
    want = run_all(stack.address, requests)
    pids = {name: stack.procs[name].pid for name in ("executor-0", "executor-1")}
    poison = inference_pb2.GenerateRequest(
        prompt_token_ids=[1, 403, POISON_TOKEN, 407],
        params=sampling_params(max_tokens=48, temperature=0.0, ignore_eos=True),
    )
    with ThreadPoolExecutor(9) as pool:
        poisoned = pool.submit(run, stack.address, poison)
        got = list(pool.map(lambda r: run(stack.address, r), requests))
    assert_same_texts(got, want, "beside a poison request")
    failed = poisoned.result()
    assert failed.finish_reason == "error", f"expected the poison request to fail: {failed}"
    assert f"prompt holds token {POISON_TOKEN}" in failed_message(stack.address, poison)
    for name, pid in pids.items():
        assert stack.procs[name].poll() is None and stack.procs[name].pid == pid, f"{name} died"
        wait_serving(stack, name)


def wait_serving(stack: Stack, name: str, timeout_s: float = 60.0) -> None:
    """Waits for `name` to answer SERVING (a probe's 1 s deadline can pass on a busy machine);
    fails naming the statuses it gave and the end of its log, which says why it was not."""
    deadline = time.monotonic() + timeout_s
    seen: list[str] = []
    while (status := stack.health(name)) != "SERVING":
        seen += [status] if not seen or seen[-1] != status else []
        if time.monotonic() > deadline:
            tail = stack.log_path(name).read_text()[-3000:]
            pytest.fail(f"{name} not SERVING within {timeout_s:g} s, it answered {seen}:\n{tail}")
        time.sleep(0.1)


def failed_message(address: str, req: inference_pb2.GenerateRequest) -> str:
    """The error message on the last chunk of `req` run once more."""
    with KvgateClient(address, timeout_s=60.0) as client:
        return list(client.stub.Generate(req, timeout=60.0))[-1].error_message


def test_kill_9_of_an_executor_mid_stream_greedy_and_seeded_texts_are_undisturbed(stack, stall_dir):
    """20 streams, 10 greedy and 10 seeded at temperature 0.8: one of the two executors is
    killed once they all stream; each resumes on the other and equals its undisturbed run."""
    requests = [request(i, 300, seeded=i % 2 == 1) for i in range(20)]
    want = run_all(stack.address, requests)
    streaming: list[int] = []
    with ThreadPoolExecutor(20) as pool:
        futures = [pool.submit(run, stack.address, r, streaming) for r in requests]
        wait_for(lambda: len(streaming) == 20, "all 20 streams streaming", timeout_s=60.0)
        victim = max(("executor-0", "executor-1"), key=lambda name: running_on(stack, name) or 0)
        stack.stop(victim, sig=signal.SIGKILL)
        got = [f.result(timeout=120) for f in futures]
    assert_same_texts(got, want, f"{victim} killed mid-stream")
    restart_executors(stack, stall_dir, victim)


def run_choices(
    address: str, req: inference_pb2.GenerateRequest, streaming: list[int] | None = None
) -> dict[int, tuple[list[int], str]]:
    """(tokens, finish reason) of each choice of `req`; `streaming` gets an item per chunk
    with tokens."""
    choices: dict[int, tuple[list[int], str]] = {}
    with KvgateClient(address, timeout_s=120.0) as client:
        for chunk in client.stub.Generate(req, timeout=120.0):
            tokens, reason = choices.setdefault(chunk.index, ([], ""))
            tokens.extend(chunk.token_ids)
            if chunk.finish_reason:
                choices[chunk.index] = (
                    tokens,
                    inference_pb2.FinishReason.Name(chunk.finish_reason),
                )
            if streaming is not None and chunk.token_ids:
                streaming.append(1)
    return choices


def kill_mid_stream(
    stack: Stack, stall_dir: Path, call: Callable[[list], T], streamed: int
) -> tuple[T, str, int]:
    """Runs call(streaming) on a thread with both executors slowed; once `streaming` holds
    `streamed` items, kills with SIGKILL the executor a heartbeat shows running the call's
    work and lets the other run at full speed. Returns: the call's result, the executor
    killed, and how many items `streaming` held at the kill."""
    wait_idle(stack, "executor-0", "executor-1")
    slow = [stall_dir / f"executor-{i}.slow" for i in (0, 1)]
    for path in slow:
        path.touch()
    streaming: list = []
    try:
        with ThreadPoolExecutor(1) as pool:
            sent_ms = now_ms()
            future = pool.submit(call, streaming)
            wait_for(lambda: len(streaming) >= streamed, "the request streaming", 60.0)
            victim = wait_for(
                lambda: next((name for name in ("executor-0", "executor-1")
                              if (running_on(stack, name, sent_ms) or 0) > 0), None),
                "a heartbeat showing the request running",
                30.0,
            )  # fmt: skip
            stack.stop(victim, sig=signal.SIGKILL)
            streamed_at_kill = len(streaming)
            for path in slow:
                path.unlink()
            return future.result(timeout=120), victim, streamed_at_kill
    finally:
        for path in slow:
            path.unlink(missing_ok=True)


def test_kill_9_mid_stream_resumes_each_choice_of_a_request_alone(stack, stall_dir):
    """A seeded request of three choices (one sequence group on one executor) streams slowly;
    its executor is killed: each choice is re-queued alone with its own tokens and seed, and
    every choice equals its undisturbed run."""
    req = request(3, 120, seeded=True)
    req.params.n = 3
    want = run_choices(stack.address, req)
    got, victim, _ = kill_mid_stream(
        stack, stall_dir, lambda streaming: run_choices(stack.address, req, streaming), 6
    )
    assert sorted(got) == [0, 1, 2], got
    for index in range(3):
        assert got[index] == want[index], f"choice {index} differs after {victim} was killed"
    restart_executors(stack, stall_dir, victim)


def counted(
    chunks: Iterator[inference_pb2.GenerateResponse], streamed: list[int]
) -> Iterator[inference_pb2.GenerateResponse]:
    """The chunks, each chunk's token ids added to `streamed` as it comes."""
    for chunk in chunks:
        streamed.extend(chunk.token_ids)
        yield chunk


def run_counted(address: str, req: inference_pb2.GenerateRequest, streamed: list[int]):
    with KvgateClient(address, timeout_s=120.0) as client:
        return Completion.of(counted(client.stub.Generate(req, timeout=120.0), streamed))


def test_kill_9_mid_stream_a_constrained_stream_resumes_and_still_validates(stack, stall_dir):
    """A seeded request held to a JSON schema streams slowly; its executor is killed in the
    middle of the JSON: the request resumes on the other executor, whose matcher replays the
    tokens already streamed, and the output equals its undisturbed run and validates."""
    params = inference_pb2.SamplingParams(
        max_tokens=400, temperature=1.0, seed=11, json_schema=json.dumps(PEOPLE)
    )
    req = inference_pb2.GenerateRequest(prompt=PROMPTS[0], params=params)
    want = run(stack.address, req)
    assert want.finish_reason == "stop", f"the undisturbed run did not finish: {want}"
    got, victim, streamed_at_kill = kill_mid_stream(
        stack, stall_dir, lambda streaming: run_counted(stack.address, req, streaming), 5
    )
    assert streamed_at_kill < len(got.token_ids), f"{victim} was killed after the last token"
    assert (got.finish_reason, got.token_ids) == (want.finish_reason, want.token_ids), (
        f"after {victim} was killed at token {streamed_at_kill}:\n"
        f"want {want.finish_reason} {want.text!r}\ngot  {got.finish_reason} {got.text!r}"
    )
    jsonschema.validate(json.loads(got.text), PEOPLE)
    restart_executors(stack, stall_dir, victim)


def test_a_wedged_executor_loses_its_requests_to_the_other(stack, stall_dir):
    """An executor's step stalls for a minute: within --step-stall-s it withdraws its
    heartbeat and reports NOT_SERVING, its requests resume on the other executor, and every
    text equals its undisturbed run. Both executors run slowly while the requests are sent, so
    they are still running when one wedges; the one wedged is the one a heartbeat taken after
    they were sent shows running the most of them (the scheduler may place them all on one:
    its view of the executors' load is up to one registry poll old)."""
    names = ("executor-0", "executor-1")
    requests = [request(i, 300, seeded=i % 2 == 0) for i in range(10)]
    want = run_all(stack.address, requests)
    wait_idle(stack, *names)
    slow = [stall_dir / f"{name}.slow" for name in names]
    for path in slow:
        path.touch()
    victim = None
    try:
        with ThreadPoolExecutor(10) as pool:
            sent_ms = now_ms()
            futures = [pool.submit(run, stack.address, r) for r in requests]
            victim = wait_for(
                lambda: max(
                    (n for n in names if (running_on(stack, n, sent_ms) or 0) > 0),
                    key=lambda n: running_on(stack, n, sent_ms) or 0,
                    default=None,
                ),
                "a heartbeat showing the requests running",
                60.0,
            )
            (stall_dir / victim).touch()
            for path in slow:
                path.unlink()
            got = [f.result(timeout=120) for f in futures]
            wait_for(  # a stuck step loop must show (within its minute-long stall)
                lambda: stack.health(victim) == "NOT_SERVING", f"{victim} NOT_SERVING", 30.0
            )
        assert_same_texts(got, want, f"{victim} wedged mid-stream")
        assert stack.executor_status(victim) is None, f"the wedged {victim} still beats"
    finally:
        for path in slow:
            path.unlink(missing_ok=True)
        if victim is not None:
            (stall_dir / victim).unlink(missing_ok=True)
            restart_executors(stack, stall_dir, victim)


def test_a_request_that_kills_executors_stops_at_max_attempts(stack, stall_dir):
    """With --max-attempts 1, a request that kills its executor is not run again: the next
    executor it is handed to refuses it, and the client gets FINISH_REASON_ERROR saying why.
    (Its executor dies before the gateway hears that it took the request, so the cap is the
    executor's to keep: the scheduler hands the dead executor's inbox back as attempt 1.)"""
    port = free_port()
    stack.start_gateway("gateway-1-attempt", port, ["--max-attempts", "1"])
    crash = inference_pb2.GenerateRequest(
        prompt_token_ids=[1, 403, CRASH_TOKEN, 407],
        params=sampling_params(max_tokens=16, temperature=0.0, ignore_eos=True),
    )
    with KvgateClient(f"127.0.0.1:{port}", timeout_s=60.0) as client:
        last = list(client.stub.Generate(crash, timeout=60.0))[-1]
    assert last.finish_reason == inference_pb2.FINISH_REASON_ERROR, last
    assert "lost its executor 1 times; it is not run again" in last.error_message, last
    # The gateway hears of the loss when the executor's links drop, which can be before its
    # process has finished exiting.
    names = ("executor-0", "executor-1")
    wait_for(
        lambda: any(stack.procs[name].poll() is not None for name in names),
        "the executor the request crashed to exit",
        60.0,
    )
    exits = {name: stack.procs[name].poll() for name in names}
    assert sorted(exits.values(), key=str) == [CRASH_STATUS, None], f"one died: {exits}"
    stack.stop("gateway-1-attempt")
    restart_executors(stack, stall_dir, *[name for name, code in exits.items() if code])


def admitted(stack: Stack, client_id: str) -> int:
    """How many times any executor admitted the request the client sent as `client_id`."""
    scoped = f"default/{client_id}/"
    count = 0
    for name in ("executor-0", "executor-1"):
        for line in stack.log_path(name).read_text().splitlines():
            record = json.loads(line) if line.startswith("{") else {}
            if record.get("request_id", "").startswith(scoped):
                count += record["msg"].startswith("request admitted")
    return count


def test_a_leader_paused_past_its_lock_runs_nothing_twice(stack):
    """The leader holds 50 seeded requests in a 1.5 s window when it is stopped (SIGSTOP)
    for 3 s; the standby takes the lock and runs them; the old leader wakes up with the same
    requests in its window and, fenced, assigns none. Each runs once and equals its
    undisturbed run."""
    tag = uuid.uuid4().hex[:8]
    requests = [request(i, 24, seeded=True, request_id=f"split-{tag}-{i}") for i in range(50)]
    want = run_all(stack.address, [request(i, 24, seeded=True) for i in range(50)])
    stack.stop("scheduler")
    window = ["--batch-window-ms", "1500"]
    stack.start_scheduler("scheduler-a", extra_flags=window)
    stack.start_scheduler("scheduler-b", wait=False, extra_flags=window)
    leader = stack.procs["scheduler-a"]
    pending = stack.redis()
    with ThreadPoolExecutor(50) as pool:
        futures = [pool.submit(run, stack.address, r) for r in requests]
        wait_for(
            lambda: pending.xpending(stack.keys.requests, "schedulers")["pending"] == 50,
            "the leader holding 50 requests",
        )
        leader.send_signal(signal.SIGSTOP)
        time.sleep(3.0)
        leader.send_signal(signal.SIGCONT)
        got = [f.result(timeout=120) for f in futures]
    assert_same_texts(got, want, "a leader paused past its lock")
    counts = {r.request_id: admitted(stack, r.request_id) for r in requests}
    assert set(counts.values()) == {1}, f"each request must run once: {counts}"
    assert stack.redis().get(stack.keys.scheduler_leader) == b"scheduler-b"
