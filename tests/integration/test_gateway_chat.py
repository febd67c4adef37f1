"""Chat and sessions through the gateway's gRPC API (a real redis-server, the executor's side
of the wire driven by the test), and session turns recorded under concurrent writes."""

from __future__ import annotations

import asyncio
import logging
import queue

import grpc
import pytest
import redis

from common.keys import RedisKeys
from common.model_text import ModelText
from common.redis_conn import connect
from common.templates import Message
from gateway import errors
from gateway.sessions import MAX_TURN_WRITES, Session, SessionStore
from protos.kvgate.v1 import inference_pb2 as pb
from protos.kvgate.v1 import internal_pb2
from tests.helpers import wait_for
from tests.integration.gateway_harness import (
    CALL_TIMEOUT_S,
    ExecutorPeer,
    GatewayThread,
    status_of,
    story_ids,
)


def test_chat_opens_a_session_and_routes_later_turns_to_its_executor(
    gateway: GatewayThread, executor: ExecutorPeer, model_text: ModelText, redis_client
):
    turns = ChatTurns(["hi", "tell me more"])
    responses = gateway.stub.Chat(turns.requests(), timeout=CALL_TIMEOUT_S)
    first = executor.take_request()
    reply = story_ids(model_text)[:5]
    executor.send(first.request_id, 0, reply, finished=True, finish_reason=pb.FINISH_REASON_STOP)
    first_chunks = read_turn(responses)
    session_id = first_chunks[0].session_id
    assert session_id and first.session_id == session_id
    turns.next()
    second = executor.take_request()
    assert second.session_executor_id == "e1", "the session's next turn must prefer its executor"
    assert second.prompt_token_ids[: len(first.prompt_token_ids)] == first.prompt_token_ids
    executor.send(second.request_id, 0, reply, finished=True, finish_reason=pb.FINISH_REASON_STOP)
    second_chunks = read_turn(responses)
    assert second_chunks[-1].turn_index == 1
    turns.close()
    stored = redis_client.get(f"kvgate:session:default:{session_id}")
    state = internal_pb2.SessionState.FromString(stored)
    assert [m.role for m in state.messages] == ["user", "assistant", "user", "assistant"]
    assert state.executor_id == "e1" and state.tenant == "default"


def test_chat_cancel_ends_the_turn_with_abort_and_keeps_the_stream(
    gateway: GatewayThread, executor: ExecutorPeer, model_text: ModelText
):
    turns = ChatTurns(["hi", "again"])
    responses = gateway.stub.Chat(turns.requests(), timeout=CALL_TIMEOUT_S)
    first = executor.take_request()
    executor.send(first.request_id, 0, story_ids(model_text)[:2])
    next(responses)
    turns.outgoing.put(pb.ChatRequest(cancel=pb.CancelTurn()))
    assert read_turn(responses)[-1].chunk.finish_reason == pb.FINISH_REASON_ABORT
    wait_for(lambda: first.request_id in executor.aborted_ids(), "an abort")
    turns.next()
    second = executor.take_request()
    executor.send(second.request_id, 0, [2], finished=True, finish_reason=pb.FINISH_REASON_STOP)
    assert read_turn(responses)[-1].turn_index == 1
    turns.close()


def test_chat_turns_sent_past_max_queued_turns_are_refused_naming_it(
    gateway: GatewayThread, executor: ExecutorPeer, caplog
):
    """Six turns sent at once: one runs, at most --max-queued-turns (4) wait behind it, and
    the call ends RESOURCE_EXHAUSTED naming the flag once the running turn is done. The
    running turn ends only once the gateway has read the sixth (on a loaded machine it could
    end first, and the turns behind it would then fit)."""
    caplog.set_level(logging.INFO, logger="gateway.service")
    turn = pb.ChatTurn(content="hi", params=pb.SamplingParams(max_tokens=8))
    requests = iter([pb.ChatRequest(turn=turn)] * 6)
    responses = gateway.stub.Chat(requests, timeout=CALL_TIMEOUT_S)
    first = executor.take_request()
    wait_for(lambda: "(--max-queued-turns)" in caplog.text, "the gateway to read the 6th turn")
    executor.send(first.request_id, 0, [2], finished=True, finish_reason=pb.FINISH_REASON_STOP)
    assert read_turn(responses)[-1].turn_index == 0
    code, details = status_of(responses)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, f"{code}: {details}"
    assert "--max-queued-turns" in details, details
    refused = gateway.metrics.registry.get_sample_value(
        "kvgate_gateway_refused_total", {"limit": "max_queued_turns", "api": "kvgate"}
    )
    assert refused == 1.0, f"the refusal must be counted: {refused}"


def test_a_bad_first_chat_turn_leaves_no_session_behind(
    gateway: GatewayThread, redis_client: redis.Redis
):
    turn = pb.ChatTurn(content="hi", params=pb.SamplingParams(temperature=-1.0))
    responses = gateway.stub.Chat(iter([pb.ChatRequest(turn=turn)]), timeout=CALL_TIMEOUT_S)
    code, details = status_of(responses)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, f"{code}: {details}"
    assert "params.temperature" in details, f"expected the message to name the field: {details!r}"
    orphans = redis_client.keys("kvgate:session:*")
    assert orphans == [], f"a rejected first turn left sessions in redis: {orphans}"


def test_end_session_releases_it_on_its_executor(gateway: GatewayThread, redis_client):
    state = internal_pb2.SessionState(session_id="mine", tenant="default", executor_id="e7")
    redis_client.set("kvgate:session:default:mine", state.SerializeToString())
    ended = gateway.stub.EndSession(pb.EndSessionRequest(session_id="mine"))
    assert ended.ended and not redis_client.exists("kvgate:session:default:mine")
    (_, fields), *_ = redis_client.xrange("kvgate:exec:e7:inbox")
    message = internal_pb2.InboxMessage.FromString(fields[b"pb"])
    assert message.release_session.session_id == "mine"
    with pytest.raises(grpc.RpcError) as again:
        gateway.stub.EndSession(pb.EndSessionRequest(session_id="mine"))
    assert again.value.code() == grpc.StatusCode.NOT_FOUND, again.value.details()
    assert again.value.details().startswith("session_id: "), again.value.details()


class ChatTurns:
    """Feeds a Chat stream one turn at a time."""

    def __init__(self, contents: list[str]) -> None:
        self.contents = list(contents)
        self.outgoing: queue.Queue = queue.Queue()
        self.next()

    def next(self) -> None:
        turn = pb.ChatTurn(content=self.contents.pop(0), params=pb.SamplingParams(max_tokens=8))
        self.outgoing.put(pb.ChatRequest(turn=turn))

    def close(self) -> None:
        self.outgoing.put(None)

    def requests(self):
        return iter(self.outgoing.get, None)


def read_turn(responses) -> list[pb.ChatResponse]:
    chunks = []
    for response in responses:
        chunks.append(response)
        if response.chunk.finish_reason:
            return chunks
    raise AssertionError(f"the turn ended without a last chunk: {chunks}")


def test_turns_recorded_by_two_streams_on_one_session_are_all_kept(redis_url: str, redis_client):
    """Two Chat streams hold copies of one session; each records a turn. The second must not
    overwrite the first's turn (each used to save its whole copy)."""
    store_a = SessionStore(connect(redis_url, timeout_s=2.0), RedisKeys(), ttl_s=60.0)
    store_b = SessionStore(connect(redis_url, timeout_s=2.0), RedisKeys(), ttl_s=60.0)

    async def two_streams() -> tuple[Session, Session, Session]:
        opened = await store_a.create("default")
        copy_a = await store_a.load(opened.session_id, "default")
        copy_b = await store_b.load(opened.session_id, "default")
        apple = [Message("user", "apple"), Message("assistant", "red")]
        banana = [Message("user", "banana"), Message("assistant", "yellow")]
        await store_a.record_turn(copy_a, apple, "e1")
        await store_b.record_turn(copy_b, banana, "")
        return copy_a, copy_b, await store_a.load(opened.session_id, "default")

    copy_a, copy_b, stored = asyncio.run(two_streams())
    assert [m.content for m in stored.messages] == ["apple", "red", "banana", "yellow"]
    assert (stored.num_turns, stored.executor_id) == (2, "e1"), stored
    assert copy_b.messages == stored.messages, "the recording copy is brought up to date"
    assert [m.content for m in copy_a.messages] == ["apple", "red"]


def test_a_turn_whose_write_races_another_is_retried_on_the_new_state(
    redis_url: str, redis_client, monkeypatch
):
    """Another stream writes the session between this turn's read and its write: the write
    is tried again on top of the other one's, and nothing is doubled."""
    store = SessionStore(connect(redis_url, timeout_s=2.0), RedisKeys(), ttl_s=60.0)
    session = Session("s-race", "default", [Message("user", "hi"), Message("assistant", "yo")])
    key = RedisKeys().session("default", "s-race")
    other = Session("s-race", "default", [Message("user", "other")], "e9", num_turns=4)
    redis_client.set(key, session.to_pb().SerializeToString())
    original_to_pb = Session.to_pb
    writes = []

    def to_pb_racing(self):
        if not writes:  # the first attempt: the other stream writes just before our EXEC
            writes.append(other)
            redis_client.set(key, original_to_pb(other).SerializeToString())
        return original_to_pb(self)

    monkeypatch.setattr(Session, "to_pb", to_pb_racing)
    turn = [Message("user", "again"), Message("assistant", "sure")]
    asyncio.run(store.record_turn(session, turn, ""))
    stored = Session.from_pb(internal_pb2.SessionState.FromString(redis_client.get(key)))
    assert [m.content for m in stored.messages] == ["other", "again", "sure"], stored
    assert (stored.num_turns, stored.executor_id) == (5, "e9"), stored
    assert session.messages == stored.messages and session.num_turns == 5


def test_a_turn_whose_session_is_ended_under_it_does_not_bring_it_back(
    redis_url: str, redis_client, monkeypatch
):
    store = SessionStore(connect(redis_url, timeout_s=2.0), RedisKeys(), ttl_s=60.0)
    key = RedisKeys().session("default", "s-gone")
    stored_before = Session("s-gone", "default", [Message("user", "hi")], "e1", num_turns=1)
    redis_client.set(key, stored_before.to_pb().SerializeToString())
    session = Session("s-gone", "default", [Message("user", "hi")], "e1", num_turns=1)
    original_to_pb = Session.to_pb
    deleted = []

    def to_pb_racing(self):
        if not deleted:  # EndSession on another stream, just before our EXEC
            deleted.append(redis_client.delete(key))
        return original_to_pb(self)

    monkeypatch.setattr(Session, "to_pb", to_pb_racing)
    asyncio.run(store.record_turn(session, [Message("assistant", "yo")], ""))
    assert deleted == [1], "the session was deleted between the read and the write"
    assert redis_client.get(key) is None, "an ended session must stay ended"
    assert [m.content for m in session.messages] == ["hi"], session


def test_a_turn_that_keeps_losing_the_race_gives_up_with_aborted(
    redis_url: str, redis_client, monkeypatch
):
    """Another stream writes the session before every one of this turn's writes: after
    MAX_TURN_WRITES tries the turn gives up with ABORTED instead of trying forever."""
    store = SessionStore(connect(redis_url, timeout_s=2.0), RedisKeys(), ttl_s=60.0)
    key = RedisKeys().session("default", "s-busy")
    session = Session("s-busy", "default", [Message("user", "hi")])
    redis_client.set(key, session.to_pb().SerializeToString())
    original_to_pb = Session.to_pb
    tries = []

    def to_pb_always_racing(self):
        tries.append(1)
        redis_client.set(key, original_to_pb(session).SerializeToString())
        return original_to_pb(self)

    monkeypatch.setattr(Session, "to_pb", to_pb_always_racing)
    with pytest.raises(errors.Aborted, match="kept changing"):
        asyncio.run(store.record_turn(session, [Message("assistant", "yo")], ""))
    assert len(tries) == MAX_TURN_WRITES, f"{len(tries)} writes tried"
    assert [m.content for m in session.messages] == ["hi"], session
