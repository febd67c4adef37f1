"""One stack, one executor: correctness, sessions, errors and cancellation through the gateway."""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from transformers import AutoModelForCausalLM, AutoTokenizer

from client.api import KvgateClient
from deploy.stack import free_port
from protos.kvgate.v1 import inference_pb2, inference_pb2_grpc
from tests.helpers import wait_for
from tests.integration.conftest import MODEL, generate, open_stream

EXECUTOR = "executor-0"
PROMPTS = ["Once upon a time", "The little dog", "Lily and Ben went", "One day, a bird"]


# The cancellation tests slow every step to this while they hold a stream, so that the request
# still holds its blocks when the test looks (400 fast stories260K steps could all end before
# the first probe on a loaded machine: seen once in a full CI run).
SLOW_STEP_S = 0.02


@pytest.fixture(scope="module")
def slow_file(tmp_path_factory):
    """While this file exists, every step of the executor takes SLOW_STEP_S at least."""
    return tmp_path_factory.mktemp("faults") / "slow"


@pytest.fixture(scope="module")
def stack(stack_factory, slow_file):
    return stack_factory(
        executor_env={"KVGATE_FAULTS": f"slow_while_file={slow_file}:{SLOW_STEP_S}"}
    )


@pytest.fixture
def slow_steps(slow_file):
    slow_file.touch()
    yield
    slow_file.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def reference():
    """Greedy completions by transformers on the same weights: prompt ids -> new token ids."""
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(MODEL)

    def complete(prompt_ids: list[int], max_tokens: int) -> tuple[list[int], str]:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False
            )
        new_ids = out[0, len(prompt_ids) :].tolist()
        full = tokenizer.decode(prompt_ids + new_ids, skip_special_tokens=True)
        prefix = tokenizer.decode(prompt_ids, skip_special_tokens=True)
        return new_ids, full[len(prefix) :]

    return complete


def idle_free_blocks(stack) -> int:
    """Free blocks once nothing runs (session pins of earlier tests stay held)."""

    def idle() -> bool:
        status = stack.executor_status(EXECUTOR)
        return status.num_running == 0 and status.num_waiting == 0

    wait_for(idle, "an idle executor", timeout_s=10.0)
    return free_blocks(stack)


def free_blocks(stack) -> int:
    return stack.executor_status(EXECUTOR).num_free_blocks


def wait_until_holding_blocks(stack, idle: int) -> None:
    """Waits until the executor reports fewer free blocks than `idle`: the request runs there."""
    wait_for(
        lambda: free_blocks(stack) < idle,
        f"the request to hold blocks (idle {idle})",
        timeout_s=10.0,
    )


def test_health_is_serving(stack):
    with grpc.insecure_channel(stack.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_generate_streams_the_transformers_greedy_text(stack, reference):
    with KvgateClient(stack.address, timeout_s=60) as client:
        prompt_ids = client.tokenize(PROMPTS[0])
    expected_ids, expected_text = reference(prompt_ids, 40)
    completion = generate(stack.address, PROMPTS[0], max_tokens=40)
    assert completion.token_ids == expected_ids, "token ids differ from transformers greedy"
    assert completion.text == expected_text, f"expected {expected_text!r}, got {completion.text!r}"
    assert completion.usage.prompt_tokens == len(prompt_ids)
    timings = completion.timings
    assert 0 < timings.queue_ms < timings.ttft_ms, (
        f"queue time must end when the executor accepts, before its prefill: {timings}"
    )


def test_32_concurrent_streams_are_all_correct(stack, reference):
    with KvgateClient(stack.address, timeout_s=60) as client:
        expected = {p: reference(client.tokenize(p), 24)[0] for p in PROMPTS}
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(32)]
    with ThreadPoolExecutor(32) as pool:
        completions = list(pool.map(lambda p: generate(stack.address, p, max_tokens=24), prompts))
    wrong = [p for p, c in zip(prompts, completions, strict=True) if c.token_ids != expected[p]]
    assert not wrong, f"{len(wrong)} of 32 streams differ from greedy, e.g. for {wrong[:1]}"


def test_chat_turns_reuse_the_session_cache_and_match_a_cold_run(stack):
    turns = ["Tell me a story.", "What happened next?", "How did it end?"]
    messages: list[inference_pb2.ChatMessage] = []
    with KvgateClient(stack.address, timeout_s=60) as client:
        session = client.chat()
        for index, content in enumerate(turns):
            reply = session.ask(content, max_tokens=24, temperature=0.0)
            messages.append(inference_pb2.ChatMessage(role="user", content=content))
            cold_ids = client.stub.Tokenize(inference_pb2.TokenizeRequest(messages=messages))
            cold = client.stub.Generate(
                inference_pb2.GenerateRequest(
                    prompt_token_ids=cold_ids.token_ids,
                    params=inference_pb2.SamplingParams(max_tokens=24, temperature=0.0),
                )
            )
            cold_text = "".join(chunk.text for chunk in cold)
            assert reply.text == cold_text, f"turn {index + 1}: session and cold run differ"
            if index > 0:
                assert reply.usage.cached_prompt_tokens > 0, f"turn {index + 1} reused no cache"
            messages.append(inference_pb2.ChatMessage(role="assistant", content=reply.text))
        session.close()


def test_stop_string_trims_the_text(stack):
    full = generate(stack.address, PROMPTS[0], max_tokens=30)
    stop = full.text[10:14]
    trimmed = generate(stack.address, PROMPTS[0], max_tokens=30, stop=[stop])
    assert trimmed.text == full.text[: full.text.index(stop)], f"stop {stop!r} did not trim"
    assert trimmed.finish_reason == "stop"


@pytest.mark.parametrize(
    ("field", "request_"),
    [
        ("prompt", inference_pb2.GenerateRequest()),
        (
            "max_tokens",
            inference_pb2.GenerateRequest(
                prompt="x", params=inference_pb2.SamplingParams(max_tokens=0)
            ),
        ),
        (
            "temperature",
            inference_pb2.GenerateRequest(
                prompt="x", params=inference_pb2.SamplingParams(temperature=-1.0)
            ),
        ),
        (
            "top_p",
            inference_pb2.GenerateRequest(
                prompt="x", params=inference_pb2.SamplingParams(top_p=1.5)
            ),
        ),
        ("prompt_token_ids", inference_pb2.GenerateRequest(prompt_token_ids=[10**6])),
    ],
)
def test_bad_fields_are_invalid_argument_naming_the_field(stack, field, request_):
    with grpc.insecure_channel(stack.address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(request_, timeout=30))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in caught.value.details(), f"{caught.value.details()!r} does not name {field}"
    assert generate(stack.address, "Hi", max_tokens=2).finish_reason, (
        "the service stopped answering"
    )


def test_cancel_mid_stream_frees_the_executor_blocks(stack, slow_steps):
    idle = idle_free_blocks(stack)
    with KvgateClient(stack.address) as client:
        call = open_stream(client, PROMPTS[1], max_tokens=400, ignore_eos=True)
        next(call)
        wait_until_holding_blocks(stack, idle)
        call.cancel()
    wait_for(
        lambda: free_blocks(stack) == idle,
        f"free blocks back to {idle} after cancel",
        timeout_s=2.0,
    )


def test_killed_gateway_mid_stream_frees_the_executor_blocks(stack, slow_steps):
    idle = idle_free_blocks(stack)
    port = free_port()
    stack.start_gateway("gateway-doomed", port)
    with KvgateClient(f"{stack.config.host}:{port}") as client:
        call = open_stream(client, PROMPTS[2], max_tokens=400, ignore_eos=True)
        next(call)
        wait_until_holding_blocks(stack, idle)
        stack.stop("gateway-doomed", sig=signal.SIGKILL)
        wait_for(
            lambda: free_blocks(stack) == idle,
            f"free blocks back to {idle} after the gateway died",
            timeout_s=2.0,
        )
