"""API fuzzing against a live stack: every field of Generate, Chat, Tokenize and EndSession
drawn by hypothesis (extreme numbers; huge, empty and invalid UTF-8 strings; random ids and
token ids; cancels at any point). Every answer is OK or a client error (a bad field is
INVALID_ARGUMENT naming it); no process dies; the KV cache is idle afterwards.

KVGATE_FUZZ_EXAMPLES sets the number of cases (2,000 here; `make fuzz` runs 20,000).
"""

from __future__ import annotations

import os
import re

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protos.kvgate.v1 import inference_pb2 as pb
from protos.kvgate.v1 import inference_pb2_grpc
from tests.integration.conftest import assert_alive_and_idle

NUM_CASES = int(os.environ.get("KVGATE_FUZZ_EXAMPLES", "2000"))
# Shares of the cases: Generate, Chat, Tokenize, EndSession.
SHARES = {"generate": 0.4, "chat": 0.2, "tokenize": 0.25, "end_session": 0.15}
CLIENT_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
FIELD = re.compile(
    r"^(prompt|prompt_token_ids|session_id|request_id|text|messages|request|turn\.\w+"
    r"|messages\[\d+\]\.\w+|params\.\w+|params\.stop\[\d+\]|turn)(: | )"
)
U32 = st.integers(0, 2**32 - 1)
FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=32)
IDS = st.one_of(
    st.just(""),
    st.from_regex(r"[A-Za-z0-9._:-]{1,128}", fullmatch=True),
    st.text(max_size=300),
)
TEXT = st.one_of(
    st.text(max_size=200),
    st.text(alphabet=st.characters(codec="utf-8"), max_size=2000),
    st.sampled_from(["", " ", "</s>", "<|im_start|>", "\x00", "Once upon a time"]),
    st.builds(lambda n: "story " * n, st.integers(0, 2000)),
)


def settings_for(method: str):
    return settings(
        max_examples=max(1, int(NUM_CASES * SHARES[method])),
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


@st.composite
def sampling(draw) -> pb.SamplingParams:
    params = pb.SamplingParams()
    for name, values in (
        ("max_tokens", st.one_of(st.integers(0, 40), U32)),
        ("temperature", FLOATS),
        ("top_p", FLOATS),
        ("top_k", U32),
        ("min_p", FLOATS),
        ("repetition_penalty", FLOATS),
        ("presence_penalty", FLOATS),
        ("frequency_penalty", FLOATS),
        ("seed", st.integers(0, 2**64 - 1)),
        ("min_tokens", st.one_of(st.integers(0, 40), U32)),
        ("ignore_eos", st.booleans()),
        ("logprobs", st.one_of(st.integers(0, 30), U32)),
    ):
        if draw(st.booleans()):
            setattr(params, name, draw(values))
    params.stop_token_ids.extend(draw(st.lists(st.one_of(st.integers(0, 600), U32), max_size=70)))
    params.stop.extend(draw(st.lists(st.text(max_size=300), max_size=18)))
    return params


def with_bad_utf8(message, draw) -> bytes:
    """The message's wire bytes, sometimes with a string field appended that holds invalid
    UTF-8 (protobuf's Python API cannot build one)."""
    data = message.SerializeToString()
    fields = [f.number for f in message.DESCRIPTOR.fields if f.type == f.TYPE_STRING]
    if fields and draw(st.integers(0, 9)) == 0:
        bad = draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"ok\x80"]))
        data += bytes([draw(st.sampled_from(fields)) << 3 | 2, len(bad)]) + bad
    return data


class Fuzzer:
    """Calls of one kind on the live gateway, each checked for an acceptable answer."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = inference_pb2_grpc.InferenceStub(self.channel)
        self.sessions: set[str] = set()

    def raw(self, method: str, stream_response: bool):
        call = self.channel.unary_stream if stream_response else self.channel.unary_unary
        return call(f"/kvgate.v1.Inference/{method}", request_serializer=lambda b: b)


def check_error(error: grpc.RpcError, cancelled: bool) -> None:
    code, details = error.code(), error.details() or ""
    if cancelled and code == grpc.StatusCode.CANCELLED:
        return
    assert code in CLIENT_ERRORS, f"{code}: {details}"
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        assert FIELD.match(details), f"INVALID_ARGUMENT must start with the field: {details!r}"


def read_then_cancel(call, chunks_to_read: int, on_response) -> None:
    """Reads a streaming call's responses, cancelling it after `chunks_to_read` (or at the
    first when 0), and checks how it ended."""
    cancelled = False
    try:
        for index, response in enumerate(call):
            on_response(response)
            if index + 1 >= chunks_to_read:
                call.cancel()
                cancelled = True
    except grpc.RpcError as error:
        check_error(error, cancelled)


@pytest.fixture(scope="module")
def stack(stack_factory):
    return stack_factory(num_executors=1)


@pytest.fixture(scope="module")
def fuzzer(stack) -> Fuzzer:
    fuzzer = Fuzzer(stack.address)
    yield fuzzer
    fuzzer.channel.close()


@settings_for("generate")
@given(data=st.data())
def test_generate(fuzzer: Fuzzer, data) -> None:
    request = pb.GenerateRequest(
        params=data.draw(sampling()),
        priority=data.draw(st.integers(-(2**31), 2**31 - 1)),
        session_id=data.draw(IDS),
        request_id=data.draw(IDS),
    )
    if data.draw(st.booleans()):
        request.prompt = data.draw(TEXT)
    else:
        request.prompt_token_ids.extend(data.draw(st.lists(st.one_of(st.integers(0, 520), U32))))
    fuzzer.sessions.add(request.session_id)
    call = fuzzer.raw("Generate", True)(with_bad_utf8(request, data.draw), timeout=30)
    read_then_cancel(call, data.draw(st.integers(0, 3)), lambda response: None)


@settings_for("chat")
@given(data=st.data())
def test_chat(fuzzer: Fuzzer, data) -> None:
    actions = data.draw(st.lists(st.booleans(), min_size=1, max_size=4))  # turn or cancel
    requests = []
    for is_turn in actions:
        if is_turn:
            turn = pb.ChatTurn(
                content=data.draw(TEXT),
                params=data.draw(sampling()),
                system_prompt=data.draw(st.one_of(st.just(""), TEXT)),
                session_id=data.draw(IDS),
                priority=data.draw(st.integers(-(2**31), 2**31 - 1)),
                request_id=data.draw(IDS),
            )
            fuzzer.sessions.add(turn.session_id)
            requests.append(pb.ChatRequest(turn=turn))
        else:
            requests.append(pb.ChatRequest(cancel=pb.CancelTurn()))
    raw = [with_bad_utf8(r, data.draw) for r in requests]
    call = fuzzer.channel.stream_stream(
        "/kvgate.v1.Inference/Chat",
        request_serializer=lambda b: b,
        response_deserializer=pb.ChatResponse.FromString,
    )(iter(raw), timeout=30)
    chunks_to_read = data.draw(st.integers(0, 6))
    read_then_cancel(
        call, chunks_to_read, lambda response: fuzzer.sessions.add(response.session_id)
    )


@settings_for("tokenize")
@given(data=st.data())
def test_tokenize(fuzzer: Fuzzer, data) -> None:
    request = pb.TokenizeRequest(add_special_tokens=data.draw(st.booleans()))
    if data.draw(st.booleans()):
        request.text = data.draw(TEXT)
    if data.draw(st.booleans()):
        roles = st.one_of(st.sampled_from(["system", "user", "assistant"]), st.text(max_size=20))
        messages = st.builds(pb.ChatMessage, role=roles, content=TEXT)
        request.messages.extend(data.draw(st.lists(messages, max_size=6)))
    try:
        fuzzer.raw("Tokenize", False)(with_bad_utf8(request, data.draw), timeout=30)
    except grpc.RpcError as error:
        check_error(error, cancelled=False)


@settings_for("end_session")
@given(data=st.data())
def test_end_session(fuzzer: Fuzzer, data) -> None:
    known = sorted(fuzzer.sessions - {""})
    choices = st.one_of(IDS, st.sampled_from(known)) if known else IDS
    request = pb.EndSessionRequest(session_id=data.draw(choices))
    try:
        fuzzer.raw("EndSession", False)(with_bad_utf8(request, data.draw), timeout=30)
    except grpc.RpcError as error:
        check_error(error, cancelled=False)


def test_every_process_lives_and_the_kv_cache_is_idle_afterwards(stack, fuzzer: Fuzzer):
    for session_id in fuzzer.sessions - {""}:
        try:
            fuzzer.stub.EndSession(pb.EndSessionRequest(session_id=session_id), timeout=30)
        except grpc.RpcError as error:
            expected = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
            assert error.code() in expected, error.details()
    assert_alive_and_idle(stack)
