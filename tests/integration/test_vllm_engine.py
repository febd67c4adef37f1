"""vLLM's gRPC engine API (vllm.grpc.engine.VllmEngine) on the gateway's public port, driven
with the stubs of the published `smg-grpc-proto` package: against a real stack (redis,
scheduler, executor, gateway processes, API keys on) and against a gateway with no executor."""

from __future__ import annotations

import hashlib
import io
import queue
import re
import shutil
import zipfile
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc
from tokenizers import Tokenizer

from client import admin
from client.api import KvgateClient
from common.keys import RedisKeys
from deploy.stack import free_port
from protos.kvgate.v1 import inference_pb2 as kvgate_pb
from protos.kvgate.v1 import inference_pb2_grpc as kvgate_grpc
from protos.kvgate.v1 import internal_pb2 as kvgate_internal_pb
from tests.helpers import wait_for
from tests.integration.conftest import MODEL, scrape
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


def test_unary_sends_one_complete_with_every_id(engine, stack, keys):
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


def test_n_streams_each_choice_with_its_index(engine, stack, keys):
    """n = 3 greedy: a complete per choice, each with its index and the greedy ids."""
    prompt_ids, expected = story_ids(stack, keys, 8)
    request = pb.GenerateRequest(
        request_id="n-3",
        tokenized=pb.TokenizedInput(input_ids=prompt_ids),
        sampling_params=greedy(8, n=3),
        stream=True,
    )
    responses = list(engine.Generate(request, metadata=keys["acme"], timeout=CALL_TIMEOUT_S))
    streamed: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for chunk in (r.chunk for r in responses if r.WhichOneof("response") == "chunk"):
        streamed[chunk.index].extend(chunk.token_ids)
    completes = [r.complete for r in responses if r.WhichOneof("response") == "complete"]
    assert sorted(c.index for c in completes) == [0, 1, 2], completes
    assert streamed == {0: expected, 1: expected, 2: expected}, streamed
    assert sum(c.completion_tokens for c in completes) == 24, completes


def test_a_constraint_that_ends_before_min_tokens_completes_with_stop(engine, keys):
    request = pb.GenerateRequest(
        request_id="short-regex",
        text=PROMPT,
        sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=8, min_tokens=4, regex="0"),
    )
    responses = list(engine.Generate(request, metadata=keys["acme"], timeout=CALL_TIMEOUT_S))
    complete = responses[-1].complete
    assert complete.finish_reason == "stop", responses
    assert complete.completion_tokens == 1, complete


def test_logprobs_come_as_output_logprobs(engine, keys):
    request = pb.GenerateRequest(
        request_id="logprobs-1", text=PROMPT, sampling_params=greedy(6, logprobs=2)
    )
    (response,) = engine.Generate(request, metadata=keys["acme"], timeout=CALL_TIMEOUT_S)
    complete = response.complete
    logprobs = complete.output_logprobs
    assert list(logprobs.token_ids) == list(complete.output_ids), logprobs
    assert len(logprobs.token_logprobs) == 6 and all(lp <= 0 for lp in logprobs.token_logprobs)
    for top, token_id in zip(logprobs.top_logprobs, complete.output_ids, strict=True):
        assert len(top.token_ids) == 2 and top.token_ids[0] == token_id, top  # greedy: the top


def test_request_metrics_say_the_vllm_front(engine, stack, keys):
    request = pb.GenerateRequest(request_id="metrics-1", text=PROMPT, sampling_params=greedy(3))
    list(engine.Generate(request, metadata=keys["acme"], timeout=CALL_TIMEOUT_S))
    families = list(text_string_to_metric_families(scrape(stack, "gateway")))
    finished = [
        s for f in families for s in f.samples if s.name == "kvgate_gateway_finished_requests_total"
    ]
    assert any(s.labels.get("api") == "vllm" and s.value >= 1 for s in finished), finished
    calls = [s for f in families for s in f.samples if s.name == "kvgate_gateway_requests_total"]
    generate = {"service": "vllm.grpc.engine.VllmEngine", "method": "Generate", "api": "vllm"}
    assert any(generate.items() <= s.labels.items() for s in calls), calls


def refused_counts(stack, gateway: str) -> dict[str, float]:
    """kvgate_gateway_refused_total at --max-concurrent-streams, by api, from /metrics."""
    families = text_string_to_metric_families(scrape(stack, gateway))
    return {
        s.labels["api"]: s.value
        for f in families
        for s in f.samples
        if s.name == "kvgate_gateway_refused_total"
        and s.labels["limit"] == "max_concurrent_streams"
    }


def test_a_stream_past_max_concurrent_streams_is_refused_and_counted_as_vllm(stack, keys):
    """One stream allowed: while a kvgate.v1 Chat stream is open, a VllmEngine Generate is
    refused naming the flag, and the refusal is counted under api="vllm"."""
    port = free_port()
    stack.start_gateway("gateway-1-stream", port, ["--max-concurrent-streams", "1"])
    turns: queue.Queue = queue.Queue()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        chat = kvgate_grpc.InferenceStub(channel).Chat(
            iter(turns.get, None), metadata=keys["acme"], timeout=CALL_TIMEOUT_S
        )
        wait_for(
            lambda: (
                'kvgate_gateway_active_streams{api="kvgate",method="Chat"} 1.0'
                in scrape(stack, "gateway-1-stream")
            ),
            "the open Chat stream",
        )
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        request = pb.GenerateRequest(request_id="over", text=PROMPT, sampling_params=greedy(3))
        code, details = status_of(stub.Generate(request, metadata=keys["acme"], timeout=60))
        turns.put(None)
        list(chat)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, f"{code}: {details}"
    assert "--max-concurrent-streams" in details, details
    counts = refused_counts(stack, "gateway-1-stream")
    assert counts.get("vllm") == 1 and counts.get("kvgate", 0) == 0, counts


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


def test_an_abort_with_a_bad_id_cancels_none_of_its_ids(redis_url, redis_client):
    gateway = make_gateway(redis_url)
    executor = ExecutorPeer.attached(redis_client, gateway)
    try:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(gateway.channel)
        request = pb.GenerateRequest(
            request_id="keep-me", text=PROMPT, sampling_params=greedy(400), stream=True
        )
        call = stub.Generate(request, timeout=CALL_TIMEOUT_S)
        queued = executor.take_request()
        executor.send(queued.request_id, 0, [5])
        assert list(next(call).chunk.token_ids) == [5]
        with pytest.raises(grpc.RpcError) as raised:
            stub.Abort(pb.AbortRequest(request_ids=["keep-me", "x", "y", "has space"]))
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value.details()
        assert raised.value.details().startswith("request_ids[3]:"), raised.value.details()
        executor.send(queued.request_id, 1, [6])
        after = next(call)
        assert list(after.chunk.token_ids) == [6], f"the refused abort ended it: {after}"
        call.cancel()
    finally:
        executor.link.close()
        gateway.stop()


def test_a_tokenizer_zip_that_fails_says_why_and_is_built_again(
    redis_url, redis_client, tmp_path: Path
):
    model = tmp_path / "model"
    shutil.copytree(MODEL, model)
    gateway = make_gateway(redis_url, model=str(model))
    try:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(gateway.channel)
        (model / "vocab.json").symlink_to("/proc/self/mem")  # a file whose read fails (EIO)
        code, details = status_of(stub.GetTokenizer(common_pb2.GetTokenizerRequest()))
        assert code == grpc.StatusCode.INTERNAL, f"{code}: {details}"
        assert "failed to build" in details and "Input/output error" in details, details
        (model / "vocab.json").unlink()
        chunks = list(stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=10))
        names = zipfile.ZipFile(io.BytesIO(b"".join(c.data for c in chunks))).namelist()
        assert "tokenizer.json" in names and "vocab.json" not in names, names
    finally:
        gateway.stop()


def test_a_tenants_open_streams_quota_counts_both_apis(redis_url, redis_client):
    """One stream allowed: while a kvgate.v1 Generate runs, a VllmEngine one is refused with
    the quota's RESOURCE_EXHAUSTED and retry-after-ms."""
    gateway = make_gateway(redis_url, auth="keys")
    executor = ExecutorPeer.attached(redis_client, gateway)
    try:
        admin.set_limits(redis_client, RedisKeys(), "acme", {"max_streams": 1}, lambda _: None)
        acme = key_metadata(redis_client, "acme")
        stub = vllm_engine_pb2_grpc.VllmEngineStub(gateway.channel)
        request = pb.GenerateRequest(request_id="q", text=PROMPT, sampling_params=greedy(4))
        native = gateway.stub.Generate(
            kvgate_pb.GenerateRequest(prompt=PROMPT), metadata=acme, timeout=CALL_TIMEOUT_S
        )
        queued = executor.take_request()
        with pytest.raises(grpc.RpcError) as raised:
            list(stub.Generate(request, metadata=acme, timeout=CALL_TIMEOUT_S))
        error = raised.value
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
        assert "open streams" in error.details(), error.details()
        assert int(dict(error.trailing_metadata())["retry-after-ms"]) > 0
        executor.send(
            queued.request_id, 0, [2], finished=True, finish_reason=kvgate_pb.FINISH_REASON_STOP
        )
        list(native)
    finally:
        executor.link.close()
        gateway.stop()


def test_a_request_the_executors_cannot_run_ends_internal_with_their_message(
    redis_url, redis_client
):
    gateway = make_gateway(redis_url)
    executor = ExecutorPeer.attached(redis_client, gateway)
    try:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(gateway.channel)
        request = pb.GenerateRequest(request_id="poison", text=PROMPT, sampling_params=greedy(4))
        call = stub.Generate(request, timeout=CALL_TIMEOUT_S)
        queued = executor.take_request()
        executor.send(
            queued.request_id,
            0,
            [],
            finished=True,
            finish_reason=kvgate_pb.FINISH_REASON_ERROR,
            error_message="model step raised: boom",
        )
        code, details = status_of(call)
        assert code == grpc.StatusCode.INTERNAL and "boom" in details, f"{code}: {details}"
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
        ({"sampling_params": pb.SamplingParams(n=17)}, "sampling_params.n"),
        (
            {"sampling_params": pb.SamplingParams(logit_bias={-5: 1.0})},
            "sampling_params.logit_bias",
        ),
        ({"sampling_params": pb.SamplingParams(json_schema="{")}, "sampling_params.json_schema"),
        (
            {"sampling_params": pb.SamplingParams(choice=pb.ChoiceConstraint(choices=[""]))},
            "sampling_params.choice",
        ),
        (
            {"sampling_params": pb.SamplingParams(structural_tag="{}")},
            "sampling_params.structural_tag",
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


def test_a_3_mb_request_is_refused_by_its_size(vllm_gateway: GatewayThread):
    stub = vllm_engine_pb2_grpc.VllmEngineStub(vllm_gateway.channel)
    request = pb.GenerateRequest(request_id="big", text="x" * (3 << 20))
    code, details = status_of(stub.Generate(request, timeout=10))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, f"{code}: {details}"
    assert "--max-receive-message-bytes" in details, details


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


def test_health_follows_whether_an_executor_can_take_work(
    vllm_gateway: GatewayThread, redis_client: redis.Redis
):
    stub = vllm_engine_pb2_grpc.VllmEngineStub(vllm_gateway.channel)
    executor = ExecutorPeer(redis_client, RedisKeys())
    executor.register()
    assert stub.HealthCheck(pb.HealthCheckRequest()).healthy
    draining = kvgate_internal_pb.ExecutorStatus(executor_id=executor.executor_id, draining=True)
    status_key = RedisKeys().executor_status(executor.executor_id)
    redis_client.set(status_key, draining.SerializeToString())
    health = stub.HealthCheck(pb.HealthCheckRequest())
    assert not health.healthy and "draining" in health.message, health


def test_health_without_redis_is_unhealthy_and_says_why(tmp_path: Path):
    gateway = make_gateway(f"unix://{tmp_path}/no-redis.sock")
    try:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(gateway.channel)
        health = stub.HealthCheck(pb.HealthCheckRequest(), timeout=10)
        assert not health.healthy and "redis unreachable" in health.message, health
    finally:
        gateway.stop()


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


VLLM_FIELD = re.compile(
    r"^(sampling_params\.\w+|sampling_params\.stop\[\d+\]|tokenized\.input_ids|text|input"
    r"|request_id|request|mm_inputs|extra_mm_inputs|media_refs|kv_transfer_params\w*"
    r"|data_parallel_rank): "
)
ANSWERS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
I32 = st.integers(-(2**31), 2**31 - 1)
U32 = st.integers(0, 2**32 - 1)
FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=32)
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty")
PENALTIES = ("presence_penalty", "frequency_penalty")
SAMPLING_FIELDS = {name: FLOATS for name in FLOAT_FIELDS + PENALTIES} | {
    "max_tokens": st.one_of(st.integers(0, 20), U32),
    "min_tokens": st.one_of(st.integers(0, 20), U32),
    "top_k": U32,
    "seed": I32,
    "logprobs": st.one_of(st.integers(-1, 25), I32),
    "n": st.integers(0, 3),
    "ignore_eos": st.booleans(),
    "json_schema": st.text(max_size=20),
    "regex": st.text(max_size=20),
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
}


@st.composite
def vllm_requests(draw) -> pb.GenerateRequest:
    params = pb.SamplingParams()
    for name, values in SAMPLING_FIELDS.items():
        if draw(st.integers(0, 3)) == 0:
            setattr(params, name, draw(values))
    params.stop.extend(draw(st.lists(st.text(max_size=40), max_size=3)))
    params.stop_token_ids.extend(draw(st.lists(st.integers(0, 600), max_size=3)))
    request = pb.GenerateRequest(
        request_id=draw(st.one_of(st.just(""), st.from_regex(r"[a-z0-9]{1,20}", fullmatch=True))),
        sampling_params=params,
        stream=draw(st.booleans()),
    )
    if draw(st.booleans()):
        request.text = draw(st.text(max_size=300))
    else:
        ids = draw(st.lists(st.integers(0, 600), max_size=40))
        request.tokenized.CopyFrom(pb.TokenizedInput(input_ids=ids))
    return request


@given(request=vllm_requests())
@settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
def test_fuzzed_generates_complete_or_name_the_bad_field(engine, keys, request):
    try:
        responses = list(engine.Generate(request, metadata=keys["acme"], timeout=CALL_TIMEOUT_S))
    except grpc.RpcError as error:
        assert error.code() in ANSWERS, f"{error.code()}: {error.details()}"
        if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
            assert VLLM_FIELD.match(error.details()), error.details()
        return
    assert responses[-1].WhichOneof("response") == "complete", responses[-1]
    assert responses[-1].complete.finish_reason in ("stop", "length"), responses[-1]


def test_after_the_fuzz_every_process_lives_and_the_kv_cache_is_idle(stack):
    for name in ("scheduler", "executor-0", "gateway"):
        assert stack.procs[name].poll() is None, f"{name} died"

    def idle() -> bool:
        status = stack.executor_status("executor-0")
        return status is not None and status.num_free_blocks == status.num_total_blocks

    wait_for(idle, "every KV block free", timeout_s=30.0)
