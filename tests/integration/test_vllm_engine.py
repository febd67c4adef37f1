"""vLLM's gRPC engine API (vllm.grpc.engine.VllmEngine) on the gateway's public port, driven
with the stubs of the published `smg-grpc-proto` package: against a real stack (redis,
scheduler, executor, gateway processes, API keys on) and against a gateway with no executor."""

from __future__ import annotations

import hashlib
import io
import zipfile
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc
from tokenizers import Tokenizer

from client import admin
from client.api import KvgateClient
from common.keys import RedisKeys
from tests.helpers import wait_for
from tests.integration.conftest import MODEL
from tests.integration.gateway_harness import (
    ExecutorPeer,
    GatewayThread,
    make_gateway,
    status_of,
)

pb = vllm_engine_pb2
PROMPT = "Once upon a time"
CALL_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def stack(stack_factory):
    return stack_factory(gateway_flags=["--auth", "keys"])


@pytest.fixture(scope="module")
def keys(stack) -> dict[str, tuple[tuple[str, str]]]:
    """Call metadata of an API key of tenant "acme" and of tenant "other"."""
    client = stack.redis()
    made = {}
    for tenant in ("acme", "other"):
        api_key = admin.create_key(client, stack.keys, tenant, lambda _: None)
        made[tenant] = (("authorization", f"Bearer {api_key}"),)
    return made


@pytest.fixture(scope="module")
def engine(stack) -> vllm_engine_pb2_grpc.VllmEngineStub:
    channel = grpc.insecure_channel(stack.address)
    yield vllm_engine_pb2_grpc.VllmEngineStub(channel)
    channel.close()


def story_ids(stack, keys, max_tokens: int) -> tuple[list[int], list[int]]:
    """The prompt's ids and the greedy completion's ids, through kvgate.v1."""
    api_key = keys["acme"][0][1].split()[1]
    with KvgateClient(stack.address, CALL_TIMEOUT_S, retry=False, api_key=api_key) as client:
        prompt_ids = client.tokenize(PROMPT)
        completion = client.generate(
            PROMPT, max_tokens=max_tokens, temperature=0.0, ignore_eos=True
        )
    return prompt_ids, completion.token_ids


def greedy(max_tokens: int, **fields) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **fields)


def test_stream_sends_a_chunk_per_step_then_a_complete(engine, stack, keys):
    prompt_ids, expected = story_ids(stack, keys, 12)
    request = pb.GenerateRequest(
        request_id="stream-1",
        tokenized=pb.TokenizedInput(original_text=PROMPT, input_ids=prompt_ids),
        sampling_params=greedy(12),
        stream=True,
    )
    responses = list(engine.Generate(request, metadata=keys["acme"], timeout=CALL_TIMEOUT_S))
    kinds = [r.WhichOneof("response") for r in responses]
    assert kinds[-1] == "complete" and set(kinds[:-1]) == {"chunk"}, kinds
    chunks = [r.chunk for r in responses[:-1]]
    streamed = [token for chunk in chunks for token in chunk.token_ids]
    assert streamed == expected, f"streamed {streamed}, kvgate.v1 gave {expected}"
    for chunk in chunks:
        assert chunk.token_ids and chunk.completion_tokens == len(chunk.token_ids), chunk
        assert chunk.prompt_tokens == len(prompt_ids), chunk
    complete = responses[-1].complete
    assert complete.finish_reason == "length", complete
    assert (complete.prompt_tokens, complete.completion_tokens) == (len(prompt_ids), 12)
    assert list(complete.output_ids) == [], "a stream's ids come in its chunks only"


def test_unary_sends_one_complete_with_every_id_and_the_cached_prefix(engine, stack, keys):
    prompt_ids, expected = story_ids(stack, keys, 10)
    request = pb.GenerateRequest(
        request_id="unary-1",
        tokenized=pb.TokenizedInput(input_ids=prompt_ids),
        sampling_params=greedy(10),
    )
    responses = list(engine.Generate(request, metadata=keys["acme"], timeout=CALL_TIMEOUT_S))
    assert [r.WhichOneof("response") for r in responses] == ["complete"], responses
    complete = responses[0].complete
    assert list(complete.output_ids) == expected, (list(complete.output_ids), expected)
    assert complete.completion_tokens == 10 and complete.finish_reason == "length", complete


def test_text_input_stops_at_a_stop_string_and_names_it(engine, keys):
    params = pb.SamplingParams(temperature=0.0, max_tokens=40, stop=["Lily"])
    request = pb.GenerateRequest(request_id="stop-1", text=PROMPT, sampling_params=params)
    (response,) = engine.Generate(request, metadata=keys["acme"], timeout=CALL_TIMEOUT_S)
    complete = response.complete
    assert complete.finish_reason == "stop", complete
    assert complete.matched_stop_str == "Lily", complete
    assert complete.WhichOneof("matched_stop") == "matched_stop_str"


def key_metadata(redis_client: redis.Redis, tenant: str) -> tuple[tuple[str, str]]:
    api_key = admin.create_key(redis_client, RedisKeys(), tenant, lambda _: None)
    return (("authorization", f"Bearer {api_key}"),)


def test_abort_ends_the_callers_stream_and_not_another_tenants(redis_url, redis_client):
    gateway = make_gateway(redis_url, auth="keys")
    executor = ExecutorPeer.attached(redis_client, gateway)
    try:
        acme, other = key_metadata(redis_client, "acme"), key_metadata(redis_client, "other")
        stub = vllm_engine_pb2_grpc.VllmEngineStub(gateway.channel)
        request = pb.GenerateRequest(
            request_id="abort-me", text=PROMPT, sampling_params=greedy(400), stream=True
        )
        call = stub.Generate(request, metadata=acme, timeout=CALL_TIMEOUT_S)
        queued = executor.take_request()
        executor.send(queued.request_id, 0, [5])
        assert list(next(call).chunk.token_ids) == [5]
        # The same id from another tenant names no request of theirs: nothing happens.
        stub.Abort(pb.AbortRequest(request_ids=["abort-me"]), metadata=other)
        executor.send(queued.request_id, 1, [6])
        after = next(call)
        assert list(after.chunk.token_ids) == [6], f"another tenant's abort ended it: {after}"
        stub.Abort(pb.AbortRequest(request_ids=["abort-me", "unknown"]), metadata=acme)
        (last,) = list(call)
        assert last.complete.finish_reason == "abort", last
        assert last.complete.completion_tokens == 2, last
        wait_for(lambda: queued.request_id in executor.aborted_ids(), "the executor's abort")
    finally:
        executor.link.close()
        gateway.stop()


def test_calls_without_a_key_are_unauthenticated(engine):
    request = pb.GenerateRequest(request_id="nokey", text=PROMPT, sampling_params=greedy(2))
    code, details = status_of(engine.Generate(request, timeout=CALL_TIMEOUT_S))
    assert code == grpc.StatusCode.UNAUTHENTICATED, details
    with pytest.raises(grpc.RpcError) as raised:
        engine.GetModelInfo(pb.GetModelInfoRequest())
    assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_model_info_loads_and_server_info(engine, stack, keys):
    info = engine.GetModelInfo(pb.GetModelInfoRequest(), metadata=keys["acme"])
    assert info.served_model_name == MODEL.name and info.is_generation, info
    assert info.max_context_length == 512 and info.vocab_size == 512, info
    assert list(info.architectures) == ["LlamaForCausalLM"] and info.model_type == "llama", info
    assert list(info.eos_token_ids) == [2] and info.bos_token_id == 1, info
    loads = engine.GetLoads(pb.GetLoadsRequest(), metadata=keys["acme"])
    assert loads.dp_rank_count == 1 and len(loads.loads) == 1, loads
    assert loads.loads[0].max_total_num_tokens == 512 * 16, loads
    server = engine.GetServerInfo(pb.GetServerInfoRequest(), metadata=keys["acme"])
    assert server.server_type == "kvgate" and server.block_size == 16, server
    health = engine.HealthCheck(pb.HealthCheckRequest(), metadata=keys["acme"])
    assert health.healthy, health


def test_tokenizer_zip_unpacks_into_the_gateways_tokenizer(engine, stack, keys, tmp_path: Path):
    chunks = list(engine.GetTokenizer(common_pb2.GetTokenizerRequest(), metadata=keys["acme"]))
    data = b"".join(chunk.data for chunk in chunks)
    assert [bool(c.sha256) for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    zipfile.ZipFile(io.BytesIO(data)).extractall(tmp_path)
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    api_key = keys["acme"][0][1].split()[1]
    text = "Once upon a time, Lily saw 3 dogs! Ünïcödé"
    with KvgateClient(stack.address, CALL_TIMEOUT_S, retry=False, api_key=api_key) as client:
        expected = client.tokenize(text)
    assert tokenizer.encode(text).ids == expected
    assert (tmp_path / "chat_template.jinja").is_file(), "stories260K's default template"


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"sampling_params": pb.SamplingParams(n=2)}, "sampling_params.n"),
        ({"sampling_params": pb.SamplingParams(logit_bias={5: 1.0})}, "sampling_params.logit_bias"),
        ({"sampling_params": pb.SamplingParams(json_schema="{}")}, "sampling_params.json_schema"),
        (
            {"sampling_params": pb.SamplingParams(choice=pb.ChoiceConstraint(choices=["a"]))},
            "sampling_params.choice",
        ),
        ({"sampling_params": pb.SamplingParams(top_p=1.5)}, "sampling_params.top_p"),
        (
            {"sampling_params": pb.SamplingParams(temperature=float("nan"))},
            "sampling_params.temperature",
        ),
        ({"sampling_params": pb.SamplingParams(stop=["a", ""])}, "sampling_params.stop[1]"),
        ({"sampling_params": pb.SamplingParams(max_tokens=100000)}, "sampling_params.max_tokens"),
        ({"sampling_params": pb.SamplingParams(logprobs=-1)}, "sampling_params.logprobs"),
        ({"tokenized": pb.TokenizedInput(input_ids=[1, 9999])}, "tokenized.input_ids"),
        ({"tokenized": pb.TokenizedInput(input_ids=[])}, "tokenized.input_ids"),
        ({"request_id": "has space", "text": PROMPT}, "request_id"),
        ({}, "input"),
        ({"mm_inputs": pb.MultimodalInputs(mm_hashes=["x"])}, "mm_inputs"),
    ],
)
def test_bad_input_is_invalid_argument_naming_the_field(vllm_gateway: GatewayThread, fields, field):
    fields = {"text": PROMPT} | fields if "tokenized" not in fields and fields else fields
    stub = vllm_engine_pb2_grpc.VllmEngineStub(vllm_gateway.channel)
    code, details = status_of(stub.Generate(pb.GenerateRequest(**fields), timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, f"{code}: {details}"
    assert details.startswith(f"{field}:"), details


@pytest.fixture
def vllm_gateway(gateway: GatewayThread) -> GatewayThread:
    """A gateway whose Redis knows no executor."""
    return gateway


def test_without_an_executor_health_is_false_and_generate_unavailable(vllm_gateway):
    stub = vllm_engine_pb2_grpc.VllmEngineStub(vllm_gateway.channel)
    health = stub.HealthCheck(pb.HealthCheckRequest())
    assert not health.healthy and "no executor" in health.message, health
    request = pb.GenerateRequest(request_id="none", text=PROMPT, sampling_params=greedy(2))
    code, details = status_of(stub.Generate(request, timeout=10))
    assert code == grpc.StatusCode.UNAVAILABLE, details
    standard = health_pb2_grpc.HealthStub(vllm_gateway.channel)
    service = "vllm.grpc.engine.VllmEngine"
    wait_for(
        lambda: (
            standard.Check(health_pb2.HealthCheckRequest(service=service)).status
            == health_pb2.HealthCheckResponse.NOT_SERVING
        ),
        what="grpc.health.v1 to say NOT_SERVING for VllmEngine with no executor",
    )


def test_reflection_lists_both_services_and_embed_is_unimplemented(vllm_gateway):
    reflection = reflection_pb2_grpc.ServerReflectionStub(vllm_gateway.channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    (answer,) = reflection.ServerReflectionInfo(iter([request]))
    names = {service.name for service in answer.list_services_response.service}
    assert {"kvgate.v1.Inference", "vllm.grpc.engine.VllmEngine"} <= names, names
    stub = vllm_engine_pb2_grpc.VllmEngineStub(vllm_gateway.channel)
    with pytest.raises(grpc.RpcError) as raised:
        stub.Embed(pb.EmbedRequest())
    assert raised.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "embeddings" in raised.value.details()
