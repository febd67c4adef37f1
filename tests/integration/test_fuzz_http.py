"""API fuzzing of the OpenAI-compatible HTTP front against a live stack: bodies of every
field the front reads (and unknown ones) drawn by hypothesis with wrong types, extreme and
non-finite numbers, huge and odd strings, nested junk; raw bytes that are not JSON; streams
read in part and dropped. Every answer is 200 or a client error in OpenAI's shape (a 400
names a field of the body in `param`); no process dies; the KV cache is idle afterwards.

KVGATE_FUZZ_EXAMPLES sets the number of cases as for the gRPC fuzz (test_fuzz.py), of which
this module takes a share.
"""

from __future__ import annotations

import json
import os

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from client.api import KvgateClient
from deploy.stack import Stack, free_port
from tests.integration.conftest import assert_alive_and_idle

NUM_CASES = max(1, int(os.environ.get("KVGATE_FUZZ_EXAMPLES", "2000")) // 10)
MODEL_ID = "stories260K"
SESSIONS: set[str] = set()  # session ids sent: ended before the KV cache is checked idle
CLIENT_ERRORS = {400, 404, 405, 413, 429}
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.integers(-3, 40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.sampled_from(["", "Once upon a time", "<s>", "\x00", MODEL_ID]),
)
JSON_VALUES = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner)
)
FIELDS = {
    "max_tokens": st.one_of(st.integers(-2, 40), SCALARS),
    "max_completion_tokens": st.one_of(st.integers(-2, 40), SCALARS),
    "temperature": st.one_of(st.floats(-1, 3), SCALARS),
    "top_p": st.one_of(st.floats(-1, 2), SCALARS),
    "top_k": st.one_of(st.integers(-2, 600), SCALARS),
    "min_p": SCALARS,
    "repetition_penalty": SCALARS,
    "presence_penalty": st.one_of(st.floats(-3, 3), SCALARS),
    "frequency_penalty": st.one_of(st.floats(-3, 3), SCALARS),
    "seed": st.one_of(st.integers(-1, 2**65), SCALARS),
    "min_tokens": st.one_of(st.integers(-1, 50), SCALARS),
    "stop": st.one_of(st.text(max_size=300), st.lists(st.text(max_size=20), max_size=20), SCALARS),
    "stop_token_ids": st.one_of(st.lists(st.integers(-1, 2**33), max_size=70), SCALARS),
    "ignore_eos": SCALARS,
    "priority": st.one_of(st.integers(-(2**32), 2**32), SCALARS),
    "logprobs": st.one_of(st.integers(-1, 25), SCALARS),
    "top_logprobs": st.one_of(st.integers(-1, 25), SCALARS),
    "n": st.one_of(st.integers(0, 3), SCALARS),
    "user": SCALARS,
    "session_id": st.one_of(st.from_regex(r"[A-Za-z0-9._:-]{1,20}", fullmatch=True), SCALARS),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": SCALARS}), JSON_VALUES),
    "logit_bias": JSON_VALUES,
    "tools": st.one_of(
        JSON_VALUES,
        st.lists(
            st.fixed_dictionaries(
                {
                    "type": st.just("function"),
                    "function": st.fixed_dictionaries(
                        {"name": st.sampled_from(["f", "g", "bad name"])},
                        optional={
                            "parameters": st.one_of(st.just({"type": "object"}), JSON_VALUES)
                        },
                    ),
                }
            ),
            max_size=3,
        ),
    ),
    "tool_choice": st.one_of(
        st.sampled_from(["none", "auto", "required"]),
        st.fixed_dictionaries(
            {
                "type": st.just("function"),
                "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "g"])}),
            }
        ),
        JSON_VALUES,
    ),
    "parallel_tool_calls": SCALARS,
    "response_format": st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema"])}),
        JSON_VALUES,
    ),
    "structured_outputs": JSON_VALUES,
    "allowed_token_ids": st.one_of(st.lists(st.integers(-1, 600), max_size=4), SCALARS),
    "unknown_field": JSON_VALUES,
}
PROMPTS = st.one_of(
    st.text(max_size=200),
    st.lists(st.text(max_size=50), max_size=3),
    st.lists(st.integers(-1, 600), max_size=50),
    st.lists(st.lists(st.integers(0, 600), max_size=20), max_size=3),
    JSON_VALUES,
)
MESSAGES = st.one_of(
    st.lists(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["system", "user", "assistant", "developer", "tool", ""]),
                "content": st.one_of(
                    st.text(max_size=200),
                    st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": SCALARS})),
                    SCALARS,
                ),
            }
        ),
        max_size=4,
    ),
    JSON_VALUES,
)


@pytest.fixture(scope="module")
def stack(stack_factory) -> Stack:
    return stack_factory(num_executors=1, http_port=free_port())


@pytest.fixture(scope="module")
def http(stack: Stack):
    with httpx.Client(base_url=stack.http_url, timeout=60.0) as client:
        yield client


@st.composite
def bodies(draw) -> tuple[str, dict]:
    chat = draw(st.booleans())
    body = {"model": draw(st.one_of(st.just(MODEL_ID), SCALARS))}
    if chat:
        body["messages"] = draw(MESSAGES)
    else:
        body["prompt"] = draw(PROMPTS)
    for name in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=6, unique=True)):
        body[name] = draw(FIELDS[name])
    if draw(st.booleans()):
        body["stream"] = draw(st.one_of(st.just(True), SCALARS))
    return ("/chat/completions" if chat else "/completions"), body


def check_answer(answer: httpx.Response, body: dict | None, text: str) -> None:
    if answer.status_code == 200:
        return
    assert answer.status_code in CLIENT_ERRORS, f"{answer.status_code}: {text[:500]}"
    error = json.loads(text)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    if answer.status_code == 400 and error["param"] not in (None, "body"):
        top = error["param"].split("[")[0].split(".")[0]
        if top == "tool_choice" and body is not None and "tools" in body:
            return  # tool_choice's default ("auto" with tools) is refused naming it
        assert body is not None and top in body, f"param {error['param']!r} not in {body}"


@settings(
    max_examples=NUM_CASES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(case=bodies(), chunks_to_read=st.integers(0, 3))
def test_bodies(http: httpx.Client, case, chunks_to_read: int) -> None:
    path, body = case
    if isinstance(body.get("session_id"), str):
        SESSIONS.add(body["session_id"])
    content = json.dumps(body, allow_nan=True).encode()
    with http.stream("POST", path, content=content) as answer:
        if answer.status_code != 200 or "text/event-stream" not in answer.headers["content-type"]:
            check_answer(answer, body, answer.read().decode())
            return
        for index, line in enumerate(answer.iter_lines()):
            if line.startswith("data: {"):
                json.loads(line[6:])  # each event is JSON (a chunk, or an error after one)
            if index >= chunks_to_read * 2:
                return  # drops the stream: the request is cancelled


@settings(max_examples=max(1, NUM_CASES // 4), deadline=None, derandomize=True, database=None)
@given(
    content=st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode)),
    path=st.sampled_from(["/completions", "/chat/completions", "/models", "/nope"]),
)
def test_raw_bytes(http: httpx.Client, content: bytes, path: str) -> None:
    answer = http.post(path, content=content)
    check_answer(answer, None, answer.text)


def test_every_process_lives_and_the_kv_cache_is_idle_afterwards(stack: Stack):
    with KvgateClient(stack.address, timeout_s=30.0, retry=False) as kvgate:
        for session_id in SESSIONS:
            try:
                kvgate.end_session(session_id)
            except grpc.RpcError as error:  # an id the front refused opens no session
                assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert_alive_and_idle(stack)
