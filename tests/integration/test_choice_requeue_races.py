"""A choice (or a request) queued again alone meets its restart on one executor: a real executor
process, a real redis-server, and the gateway's real TokenSink servicer and token router on a
real gRPC server, with the scheduler's part (the executor's inbox) played by the test.

When an executor is lost, the gateway queues each unfinished choice again alone (with the
tokens its client has) and the scheduler queues the whole group again from the start (from the
lost executor's inbox). Both may land on one executor, in either order; the gateway refuses
the restarted group's output of a choice past which its client already is, and aborts it.
The order that matters is forced here: the aborts the gateway sends are held back until the
choice run alone has started, as a busy gateway or network may delay them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis
from grpc import aio

from common.keys import PAYLOAD_FIELD, RedisKeys
from deploy.stack import free_port
from engine.faults import FAULTS_ENV
from gateway.token_sink import (
    ExecutorLost,
    RequestEvent,
    TokenRouter,
    TokenSinkServicer,
    TokenUpdate,
)
from protos.kvgate.v1 import inference_pb2, internal_pb2, internal_pb2_grpc
from tests.helpers import REPO, STORIES_260K, WAIT_S, wait_for

KEYS = RedisKeys()
EXECUTOR = "e1"
PROMPT = [1, 403, 407, 261, 378, 275, 263, 271]
CLIENT_TOKENS = [379, 290, 297]  # what choice 1's client got before the first executor was lost
MAX_TOKENS = 8


class HeldSink(TokenSinkServicer):
    """The gateway's TokenSink, whose messages to executors (aborts) wait until released."""

    def __init__(self, router: TokenRouter) -> None:
        super().__init__(router)
        self.held: list[internal_pb2.ConnectResponse] = []
        self.released = asyncio.Event()

    async def Connect(self, request_iterator, context) -> AsyncIterator:  # noqa: N802
        async for response in super().Connect(request_iterator, context):
            self.held.append(response)
            await self.released.wait()
            yield response


class GatewaySide:
    """A token router and its held TokenSink on a gRPC server, on an event loop thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.router = TokenRouter()
        self.address = f"127.0.0.1:{free_port()}"
        self.sink, self.server = self.call(self._serve())
        self.inboxes: dict[str, asyncio.Queue[RequestEvent]] = {}
        self.events: dict[str, list[RequestEvent]] = {}

    def call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(WAIT_S)

    async def _serve(self) -> tuple[HeldSink, aio.Server]:
        sink = HeldSink(self.router)
        server = aio.server()
        internal_pb2_grpc.add_TokenSinkServicer_to_server(sink, server)
        server.add_insecure_port(self.address)
        await server.start()
        return sink, server

    def track_after_a_lost_executor(self, request_id: str, resume_offsets: list[int]) -> None:
        """Tracks the request's choices as a gateway does once their executor was lost:
        attempt 0 ran on "e0" and streamed `resume_offsets[i]` tokens of choice i."""

        async def track() -> None:
            lost = self.router.connect("e0")
            for index, offset in enumerate(resume_offsets):
                choice_id = f"{request_id}#{index}"
                self.inboxes[choice_id] = self.router.track(choice_id, ("default", choice_id))
                entry = internal_pb2.RequestTokens(
                    request_id=choice_id, token_ids=CLIENT_TOKENS[:offset], accepted=True
                )
                self.router.deliver(lost, internal_pb2.TokenBatch(requests=[entry]))
            self.router.disconnect(lost)
            for index, offset in enumerate(resume_offsets):
                self.router.resume_from(f"{request_id}#{index}", offset)

        self.call(track())

    def events_of(self, choice_id: str) -> list[RequestEvent]:
        """The events the router handed to the choice so far."""

        async def drain() -> list[RequestEvent]:
            inbox = self.inboxes[choice_id]
            got = self.events.setdefault(choice_id, [])
            while not inbox.empty():
                got.append(inbox.get_nowait())
            return got

        return list(self.call(drain()))

    def updates(self, choice_id: str) -> list[TokenUpdate]:
        """The token updates the router handed to the choice so far."""
        return [e for e in self.events_of(choice_id) if isinstance(e, TokenUpdate)]

    def held_aborts(self) -> list[internal_pb2.Abort]:
        return [r.abort for r in self.sink.held if r.HasField("abort")]

    def wait_refused(self, request_id: str, what: str) -> list[internal_pb2.Abort]:
        """The held aborts naming `request_id`, once there is one."""
        return wait_for(
            lambda: [a for a in self.held_aborts() if request_id in a.request_ids], what
        )

    def wait_started_at(self, request_id: str, offset: int, what: str) -> None:
        """Until a run of `request_id` is accepted starting at `offset`."""
        wait_for(
            lambda: any(u.accepted and u.offset == offset for u in self.updates(request_id)), what
        )

    def release(self) -> None:
        self.loop.call_soon_threadsafe(self.sink.released.set)

    def stop(self) -> None:
        self.release()
        self.call(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture
def gateway_side() -> Iterator[GatewaySide]:
    side = GatewaySide()
    yield side
    side.stop()


@contextlib.contextmanager
def running_executor(
    redis_url: str, redis_client: redis.Redis, log_path: Path, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen]:
    argv = [
        sys.executable, "-m", "executor", "--model", str(STORIES_260K), "--redis-url", redis_url,
        "--executor-id", EXECUTOR, "--num-gpu-blocks", "64", "--metrics-port", "-1",
        "--health-port", "-1",
    ]  # fmt: skip
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            argv,
            cwd=REPO,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
    try:
        wait_for(
            lambda: redis_client.get(KEYS.executor_status(EXECUTOR)) or process.poll() is not None,
            "the executor's first heartbeat",
            timeout_s=120.0,
        )
        assert process.poll() is None, log_path.read_text()
        yield process
    finally:
        process.terminate()
        process.wait(30)


@pytest.fixture
def executor_process(redis_url: str, redis_client: redis.Redis, tmp_path: Path):
    log_path = tmp_path / "executor.log"
    with running_executor(redis_url, redis_client, log_path):
        yield log_path


@pytest.fixture
def slow_file(redis_url: str, redis_client: redis.Redis, tmp_path: Path) -> Iterator[Path]:
    """A running executor whose forward passes take 0.2 s each while the returned file
    exists (engine/faults.py's slow_while_file)."""
    slow = tmp_path / "slow"
    slow.touch()
    env = {FAULTS_ENV: f"slow_while_file={slow}:0.2"}
    with running_executor(redis_url, redis_client, tmp_path / "executor.log", env):
        yield slow


def assign(client: redis.Redis, queued: internal_pb2.QueuedRequest) -> None:
    """Writes an assignment into the executor's inbox, as the scheduler does."""
    message = internal_pb2.InboxMessage()
    message.assignment.request.CopyFrom(queued)
    message.assignment.executor_id = EXECUTOR
    client.xadd(KEYS.executor_inbox(EXECUTOR), {PAYLOAD_FIELD: message.SerializeToString()})


def queued(
    request_id: str, reply_to: str, n: int, max_tokens: int = MAX_TOKENS, **fields
) -> internal_pb2.QueuedRequest:
    params = inference_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, top_p=1.0, ignore_eos=True, n=n
    )
    return internal_pb2.QueuedRequest(
        request_id=request_id,
        reply_to=reply_to,
        tenant="default",
        prompt_token_ids=PROMPT,
        params=params,
        queue_deadline_unix_ms=int(time.time() * 1000) + 60_000,
        **fields,
    )


def test_a_late_abort_of_the_refused_group_restart_spares_the_choice_run_alone(
    gateway_side: GatewaySide, executor_process: Path, redis_client: redis.Redis
):
    gateway_side.track_after_a_lost_executor("g", [0, len(CLIENT_TOKENS)])
    assign(redis_client, queued("g", gateway_side.address, n=2, attempt=1))
    refused = gateway_side.wait_refused(
        "g#1", "the gateway to refuse the restarted group's choice 1 (its client is past it)"
    )
    assert list(refused[0].attempts) == [1], refused
    alone = queued(
        "g#1", gateway_side.address, n=1, attempt=1, choice_index=1,
        resume_token_ids=CLIENT_TOKENS,
    )  # fmt: skip
    assign(redis_client, alone)
    gateway_side.wait_started_at("g#1", 3, "choice 1 run alone to start where its client is")
    gateway_side.release()  # the abort of the group's choice 1 reaches the executor now

    def finished() -> bool:
        return any(u.finished for u in gateway_side.updates("g#1"))

    wait_for(finished, "choice 1 run alone to finish (a late abort of its group stopped it?)")
    tokens = [t for u in gateway_side.updates("g#1") if u.attempt == 1 for t in u.token_ids]
    assert len(tokens) == MAX_TOKENS - len(CLIENT_TOKENS), tokens
    (last,) = [u for u in gateway_side.updates("g#1") if u.finished]
    assert last.finish_reason is not None and not last.error_message, last


def test_the_gateways_resuming_copy_replaces_a_restart_from_the_start(
    gateway_side: GatewaySide, slow_file: Path, redis_client: redis.Redis
):
    """A request of one sequence (its id the tracked one's, "r#0"): the scheduler's copy from
    the lost executor's inbox starts over on this executor, the gateway refuses its output
    (the abort held back), and the gateway's own copy with the client's tokens arrives while
    that run still runs: it runs (it was dropped as a second assignment, and the abort then
    left the client waiting)."""
    gateway_side.track_after_a_lost_executor("r", [len(CLIENT_TOKENS)])
    restart = queued("r#0", gateway_side.address, n=1, attempt=1, max_tokens=40)
    assign(redis_client, restart)
    gateway_side.wait_refused(
        "r#0", "the gateway to refuse the run that starts over (its client is past it)"
    )
    resuming = queued(
        "r#0", gateway_side.address, n=1, attempt=1, max_tokens=40,
        resume_token_ids=CLIENT_TOKENS,
    )  # fmt: skip
    assign(redis_client, resuming)
    gateway_side.wait_started_at(
        "r#0", 3, "the resuming copy to run beside the restart it replaces"
    )
    slow_file.unlink()
    gateway_side.release()  # the abort of the restart reaches the executor now
    wait_for(
        lambda: any(u.finished for u in gateway_side.updates("r#0")),
        "the resuming run to finish (a late abort of the restart stopped it?)",
    )
    tokens = [t for u in gateway_side.updates("r#0") if u.offset >= 3 for t in u.token_ids]
    assert len(tokens) == 40 - len(CLIENT_TOKENS), tokens


def test_a_choice_run_alone_that_starts_over_behind_its_client_is_not_joined_to_it(
    gateway_side: GatewaySide, slow_file: Path, redis_client: redis.Redis
):
    """Both choices were lost before their clients had a token; the group's restart streams
    choice 0's first tokens to its client, then the gateway's copy of choice 0 alone (queued
    with no tokens) replaces that run on the same executor and starts over at token 0. The
    gateway does not take it (an unseeded choice would then join two runs' tokens): it aborts
    that run and queues choice 0 again from the tokens its client has, while choice 1 goes on
    in the group's run."""
    gateway_side.track_after_a_lost_executor("u", [0, 0])
    assign(redis_client, queued("u", gateway_side.address, n=2, attempt=1, max_tokens=40))
    wait_for(
        lambda: sum(len(u.token_ids) for u in gateway_side.updates("u#0")) >= 2,
        "the group's restart to stream choice 0's first tokens",
    )
    alone = queued("u#0", gateway_side.address, n=1, attempt=1, max_tokens=40, choice_index=0)
    assign(redis_client, alone)
    wait_for(
        lambda: any(
            isinstance(e, ExecutorLost) and e.replaced for e in gateway_side.events_of("u#0")
        ),
        "the gateway to queue choice 0 again from its client's tokens",
    )
    lost = [e for e in gateway_side.events_of("u#0") if isinstance(e, ExecutorLost)]
    assert [(e.replaced, e.attempt) for e in lost] == [(False, 1), (True, 2)], lost
    refused = gateway_side.wait_refused("u#0", "the gateway to abort the run that started over")
    assert len(refused[0].runs) == 1, refused
    starts = [u.offset for u in gateway_side.updates("u#0") if u.accepted]
    assert starts == [0, 0], f"choice 0 took more than the lost run and one restart: {starts}"
    slow_file.unlink()
    gateway_side.release()
    wait_for(
        lambda: any(u.finished for u in gateway_side.updates("u#1")),
        "choice 1 to finish in the group's run",
    )
    tokens = [t for u in gateway_side.updates("u#1") for t in u.token_ids]
    assert len(tokens) == 40, tokens
