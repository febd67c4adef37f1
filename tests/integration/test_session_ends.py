"""Sessions whose end races their calls and turns, on a real stack with one executor: a Chat
call that fails before a turn completed ends the session it opened, and a turn that finishes
after its session was ended leaves nothing pinned."""

from __future__ import annotations

import queue

import grpc
import pytest

from client.api import sampling_params
from protos.kvgate.v1 import inference_pb2 as pb
from protos.kvgate.v1 import inference_pb2_grpc
from tests.helpers import wait_for

EXECUTOR = "executor-0"
LONG_TURN = sampling_params(max_tokens=400, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def stack(stack_factory):
    return stack_factory(num_executors=1)


@pytest.fixture
def stub(stack):
    with grpc.insecure_channel(stack.address) as channel:
        yield inference_pb2_grpc.InferenceStub(channel)


def session_keys(stack) -> list[bytes]:
    return stack.redis().keys("kvgate:session:*")


def executor_idle(stack) -> bool:
    """No request running or waiting, no session pinned, every KV block free."""
    status = stack.executor_status(EXECUTOR)
    return (
        status is not None
        and status.num_running + status.num_waiting == 0
        and not status.session_ids
        and status.num_free_blocks == status.num_total_blocks
    )


def chat_turn(content: str, request_id: str = "") -> pb.ChatRequest:
    turn = pb.ChatTurn(content=content, params=LONG_TURN, request_id=request_id)
    return pb.ChatRequest(turn=turn)


def test_a_chat_call_that_fails_before_its_first_turn_ends_the_session_it_opened(stack, stub):
    """The turn's request_id is already streaming: the call fails FAILED_PRECONDITION after
    the gateway opened a session for it, and the client never hears the session's id."""
    running = stub.Generate(pb.GenerateRequest(prompt="Once", params=LONG_TURN, request_id="r1"))
    next(running)
    with pytest.raises(grpc.RpcError) as failed:
        list(stub.Chat(iter([chat_turn("Hi", request_id="r1")]), timeout=60))
    running.cancel()
    assert failed.value.code() == grpc.StatusCode.FAILED_PRECONDITION, failed.value.details()
    wait_for(lambda: not session_keys(stack), "the failed call's session ended", timeout_s=10)
    wait_for(lambda: executor_idle(stack), "an idle executor", timeout_s=10)


def test_a_chat_call_cancelled_during_its_first_turn_ends_the_session_it_opened(stack, stub):
    turns: queue.Queue = queue.Queue()
    turns.put(chat_turn("Tell me a story"))
    call = stub.Chat(iter(turns.get, None), timeout=60)
    wait_for(lambda: session_keys(stack), "the call's session opened", timeout_s=10)
    call.cancel()
    wait_for(lambda: not session_keys(stack), "the cancelled call's session ended", timeout_s=10)
    wait_for(lambda: executor_idle(stack), "an idle executor", timeout_s=10)


def test_a_turn_that_finishes_after_its_session_ended_leaves_nothing_pinned(stack, stub):
    """EndSession arrives while the session's first turn runs (its executor not yet recorded
    in the session): the turn finishes, and neither it nor the ended session keeps blocks."""
    turns: queue.Queue = queue.Queue()
    turns.put(chat_turn("Tell me a story"))
    responses = stub.Chat(iter(turns.get, None), timeout=60)
    first = next(responses)
    ended = stub.EndSession(pb.EndSessionRequest(session_id=first.session_id), timeout=10)
    chunks = [first.chunk]
    while not chunks[-1].finish_reason:
        chunks.append(next(responses).chunk)
    turns.put(None)
    assert list(responses) == [] and ended.ended
    num_tokens = sum(len(chunk.token_ids) for chunk in chunks)
    assert (chunks[-1].finish_reason, num_tokens) == (pb.FINISH_REASON_LENGTH, 400), chunks[-1]
    key = stack.keys.session("default", first.session_id)
    assert not stack.redis().exists(key), "the ended session came back"
    wait_for(lambda: executor_idle(stack), "an idle executor (the ended session unpinned)")
