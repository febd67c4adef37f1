"""vLLM's gRPC engine API (`vllm.grpc.engine.VllmEngine`, the stubs of `smg-grpc-proto`) on the
gateway's public port, beside kvgate.v1.Inference, so that routers that speak it (sgl-model-
gateway's `smg`, llm-d) drive kvgate unchanged.

The servicer only translates: a Generate is validated into the same GenerationSpec as
kvgate.v1's and runs as a Generation under the same keys, tenants, quotas, metrics and
status codes (the interceptors of the port wrap both services).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import redis
from grpc import aio
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc

from common.finish_reason import FinishReason
from common.gguf_metadata import GgufFile
from common.model_files import gguf_file
from common.model_text import ModelText
from common.redis_conn import describe
from gateway.auth import tenant_of
from gateway.choices import ChoiceGroup
from gateway.errors import InvalidArgument, ServiceError
from gateway.generation import Chunk, Generation
from gateway.quotas import clamp_priority
from gateway.service import InferenceServicer
from gateway.tokenizer_zip import TokenizerZip, build_tokenizer_zip
from gateway.validation import GenerationSpec, check_id, resolve_request_id
from gateway.vllm_params import (
    checked_token_input,
    checked_vllm_sampling,
    refuse_unsupported_request_fields,
    renamed,
)
from protos.kvgate.v1 import inference_pb2, internal_pb2

log = logging.getLogger(__name__)
VLLM_SERVICE = vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"].full_name
SERVER_TYPE = "kvgate"
API = "vllm"  # the `api` label of this front's request metrics
FINISH_REASONS = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
}


class EngineError(ServiceError):
    """The executors could not run the request (kvgate.v1's FINISH_REASON_ERROR): vLLM's
    servicer answers an engine failure with INTERNAL and its message, and so does this one."""

    code = grpc.StatusCode.INTERNAL


class TokenizerZipFailed(ServiceError):
    """GetTokenizer could not build the zip: INTERNAL, with what failed."""

    code = grpc.StatusCode.INTERNAL


def output_logprobs(logprobs: list[inference_pb2.TokenLogprob]) -> vllm_engine_pb2.OutputLogProbs:
    """kvgate's per-token log-probabilities in vLLM's shape."""
    return vllm_engine_pb2.OutputLogProbs(
        token_logprobs=[entry.logprob for entry in logprobs],
        token_ids=[entry.token_id for entry in logprobs],
        top_logprobs=[
            vllm_engine_pb2.TopLogProbs(
                values=[top.logprob for top in entry.top],
                token_ids=[top.token_id for top in entry.top],
            )
            for entry in logprobs
        ],
    )


def input_logprobs(
    prompt_token_ids: list[int], logprobs: list[inference_pb2.TokenLogprob]
) -> vllm_engine_pb2.InputLogProbs:
    """The prompt's log-probabilities in vLLM's shape: the first token's has no value."""
    return vllm_engine_pb2.InputLogProbs(
        token_logprobs=[vllm_engine_pb2.InputTokenLogProb()]
        + [vllm_engine_pb2.InputTokenLogProb(value=entry.logprob) for entry in logprobs],
        token_ids=prompt_token_ids,
        top_logprobs=[vllm_engine_pb2.TopLogProbs()]
        + [
            vllm_engine_pb2.TopLogProbs(
                values=[top.logprob for top in entry.top],
                token_ids=[top.token_id for top in entry.top],
            )
            for entry in logprobs
        ],
    )


def model_description(model: str) -> tuple[str, list[str]]:
    """The model's type and architectures: config.json's, or the GGUF file's architecture."""
    gguf = gguf_file(model)
    if gguf is not None:
        architecture = GgufFile(gguf).architecture
        return architecture, [architecture]
    config = Path(model) / "config.json"
    fields = _read_json(config)
    return fields.get("model_type", ""), list(fields.get("architectures", []))


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


class GenerateCall:
    """One Generate call's responses: vLLM's chunks and a complete message per choice
    (SamplingParams.n), each with the choice's index."""

    def __init__(
        self, generation: Generation | ChoiceGroup, spec: GenerationSpec, stream: bool
    ) -> None:
        self.generation = generation
        self.choices = generation.choices if isinstance(generation, ChoiceGroup) else [generation]
        self.spec = spec
        self.stream = stream
        self.token_ids: dict[int, list[int]] = {i: [] for i in range(len(self.choices))}
        self.logprobs: dict[int, list[inference_pb2.TokenLogprob]] = {
            i: [] for i in range(len(self.choices))
        }
        self.prompt_logprobs: dict[int, list[inference_pb2.TokenLogprob]] = {}

    async def responses(self) -> AsyncIterator[vllm_engine_pb2.GenerateResponse]:
        async for chunk in self.generation.stream():
            self.token_ids[chunk.index].extend(chunk.token_ids)
            self.logprobs[chunk.index].extend(chunk.logprobs)
            if chunk.prompt_logprobs is not None:
                self.prompt_logprobs[chunk.index] = chunk.prompt_logprobs
            if self.stream and chunk.token_ids:
                yield vllm_engine_pb2.GenerateResponse(chunk=self._stream_chunk(chunk))
            if chunk.finish_reason is not None:
                yield vllm_engine_pb2.GenerateResponse(complete=self._complete(chunk))

    def _stream_chunk(self, chunk: Chunk) -> vllm_engine_pb2.GenerateStreamChunk:
        """This step's ids; completion_tokens counts them (vLLM's chunks carry deltas)."""
        message = vllm_engine_pb2.GenerateStreamChunk(
            token_ids=chunk.token_ids,
            prompt_tokens=len(self.spec.prompt_token_ids),
            completion_tokens=len(chunk.token_ids),
            cached_tokens=self.choices[chunk.index].num_cached_tokens,
            index=chunk.index,
        )
        if chunk.logprobs:
            message.output_logprobs.CopyFrom(output_logprobs(chunk.logprobs))
        if chunk.prompt_logprobs is not None:  # a choice's first chunk
            message.input_logprobs.CopyFrom(self._input_logprobs(chunk.prompt_logprobs))
        return message

    def _input_logprobs(self, logprobs: list) -> vllm_engine_pb2.InputLogProbs:
        return input_logprobs(self.spec.prompt_token_ids, logprobs)

    def _complete(self, chunk: Chunk) -> vllm_engine_pb2.GenerateComplete:
        if chunk.finish_reason == FinishReason.ERROR:
            raise EngineError(chunk.error_message or "the executors could not run the request")
        usage = chunk.usage
        token_ids, logprobs = self.token_ids[chunk.index], self.logprobs[chunk.index]
        message = vllm_engine_pb2.GenerateComplete(
            output_ids=[] if self.stream else token_ids,
            finish_reason=FINISH_REASONS[chunk.finish_reason],
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            cached_tokens=usage.cached_prompt_tokens,
            index=chunk.index,
        )
        if logprobs and not self.stream:
            message.output_logprobs.CopyFrom(output_logprobs(logprobs))
        prompt_logprobs = self.prompt_logprobs.get(chunk.index)
        if prompt_logprobs is not None and not self.stream:
            message.input_logprobs.CopyFrom(self._input_logprobs(prompt_logprobs))
        self._set_matched_stop(message, chunk)
        return message

    def _set_matched_stop(self, message: vllm_engine_pb2.GenerateComplete, chunk: Chunk) -> None:
        """The stop string, or the stop token id (not an end-of-sequence one), that ended it."""
        if chunk.finish_reason != FinishReason.STOP:
            return
        token_ids = self.token_ids[chunk.index]
        matched = self.choices[chunk.index].stops.matched
        if matched:
            message.matched_stop_str = matched
        elif token_ids and token_ids[-1] in self.spec.sampling.stop_token_ids:
            message.matched_token_id = token_ids[-1]


class VllmEngineServicer(vllm_engine_pb2_grpc.VllmEngineServicer):
    """Generate, Abort, HealthCheck, GetModelInfo, GetServerInfo, GetLoads and GetTokenizer
    over kvgate.v1's servicer (its queue, quotas, tokenizer and limits)."""

    def __init__(self, kvgate: InferenceServicer, model: str) -> None:
        self.kvgate = kvgate
        self.deps = kvgate.deps
        self.model = model
        self.model_text: ModelText = kvgate.model_text
        self.model_type, self.architectures = model_description(model)
        self.started_at = time.time()
        self.last_request_at = 0.0
        self._tokenizer_zip: asyncio.Future[TokenizerZip] | None = None

    async def _prompt_of(self, request: vllm_engine_pb2.GenerateRequest) -> list[int]:
        limits = self.model_text.limits
        which = request.WhichOneof("input")
        if which == "tokenized":
            return checked_token_input(list(request.tokenized.input_ids), limits)
        if which == "text" and request.text:
            token_ids = await self.kvgate.text.encode("text", request.text)
            return checked_token_input(token_ids, limits)
        raise InvalidArgument("input", "set tokenized (input_ids) or text")

    async def _spec(self, request: vllm_engine_pb2.GenerateRequest, limits) -> GenerationSpec:
        refuse_unsupported_request_fields(request)
        prompt = await self._prompt_of(request)
        sampling, stop = checked_vllm_sampling(
            request.sampling_params,
            len(prompt),
            self.model_text.limits,
            self.kvgate.stop_limits,
        )
        try:
            await self.kvgate.text.check_constraint(sampling.constraint)
            await self.kvgate.check_num_sequences(sampling)
        except InvalidArgument as error:
            raise renamed(error) from None
        priority, clamped = clamp_priority(0, limits)
        return GenerationSpec(
            request_id=resolve_request_id("request_id", request.request_id),
            prompt_token_ids=prompt,
            sampling=sampling,
            stop=stop,
            priority=priority,
            session_id="",
            priority_clamped=clamped,
            api=API,
        )

    async def Generate(  # noqa: N802 (gRPC method name)
        self, request: vllm_engine_pb2.GenerateRequest, context: aio.ServicerContext
    ) -> AsyncIterator[vllm_engine_pb2.GenerateResponse]:
        self.last_request_at = time.time()
        tenant = tenant_of(context)
        limits = await self.kvgate.quotas.limits(tenant)
        admission = self.kvgate.call_admission(tenant, limits, request.sampling_params.n)
        try:
            spec = await self._spec(request, limits)
            kind = ChoiceGroup if spec.sampling.num_sequences > 1 else Generation
            generation = kind(spec, self.deps, tenant, "", admission)
            async for response in GenerateCall(generation, spec, request.stream).responses():
                yield response
        finally:
            self.kvgate.end_call(admission)

    async def Abort(  # noqa: N802 (gRPC method name)
        self, request: vllm_engine_pb2.AbortRequest, context: aio.ServicerContext
    ) -> vllm_engine_pb2.AbortResponse:
        """Cancels the caller's own requests of these ids streaming through this gateway; an
        id it does not have (finished, unknown, another tenant's) is passed over. Every id is
        checked before any is cancelled: a refused call cancels nothing."""
        tenant = tenant_of(context)
        for index, request_id in enumerate(request.request_ids):
            check_id(f"request_ids[{index}]", request_id)
        for request_id in request.request_ids:
            self.deps.router.cancel_client_request((tenant, request_id))
        return vllm_engine_pb2.AbortResponse()

    async def HealthCheck(  # noqa: N802 (gRPC method name)
        self, request: vllm_engine_pb2.HealthCheckRequest, context: aio.ServicerContext
    ) -> vllm_engine_pb2.HealthCheckResponse:
        """Healthy while an executor that is alive and not draining can take work."""
        try:
            statuses = await self.deps.queue.executor_statuses()
        except redis.RedisError as error:
            message = f"redis unreachable: {describe(error)}; no request can be queued"
            return vllm_engine_pb2.HealthCheckResponse(healthy=False, message=message)
        taking_work = sum(not status.draining for status in statuses)
        if taking_work:
            message = f"serving: {taking_work} executors take work"
        elif statuses:
            message = "every executor is draining: no request can run"
        else:
            message = "no executor is alive: no request can run"
        return vllm_engine_pb2.HealthCheckResponse(healthy=bool(taking_work), message=message)

    async def GetModelInfo(  # noqa: N802 (gRPC method name)
        self, request: vllm_engine_pb2.GetModelInfoRequest, context: aio.ServicerContext
    ) -> vllm_engine_pb2.GetModelInfoResponse:
        limits = self.model_text.limits
        return vllm_engine_pb2.GetModelInfoResponse(
            # The served name, not a path: a router takes the tokenizer from GetTokenizer (with
            # the chat template the gateway renders with), not from files on its own host.
            model_path=self.model_text.model_id,
            is_generation=True,
            max_context_length=limits.max_model_len,
            vocab_size=limits.vocab_size,
            supports_vision=False,
            served_model_name=self.model_text.model_id,
            tokenizer_path=self.model_text.model_id,
            model_type=self.model_type,
            architectures=self.architectures,
            eos_token_ids=list(limits.eos_token_ids),
            pad_token_id=self.model_text.hf_tokenizer.pad_token_id or 0,
            bos_token_id=limits.bos_token_id,
            max_req_input_len=limits.max_model_len - 1,
        )

    async def GetServerInfo(  # noqa: N802 (gRPC method name)
        self, request: vllm_engine_pb2.GetServerInfoRequest, context: aio.ServicerContext
    ) -> vllm_engine_pb2.GetServerInfoResponse:
        """This gateway's view: its streaming requests, uptime, and the executors' sizes."""
        statuses = await self.deps.queue.executor_statuses()
        return vllm_engine_pb2.GetServerInfoResponse(
            active_requests=self.deps.router.num_requests,
            is_paused=False,
            last_receive_timestamp=self.last_request_at,
            uptime_seconds=time.time() - self.started_at,
            server_type=SERVER_TYPE,
            data_parallel_size=len(statuses),
            block_size=statuses[0].block_size if statuses else 0,
            max_num_seqs=sum(s.max_num_seqs for s in statuses),
        )

    async def GetLoads(  # noqa: N802 (gRPC method name)
        self, request: vllm_engine_pb2.GetLoadsRequest, context: aio.ServicerContext
    ) -> vllm_engine_pb2.GetLoadsResponse:
        """One SchedulerLoad per live executor (its dp_rank is its place in id order), from
        the status each one's heartbeat last wrote."""
        statuses = await self.deps.queue.executor_statuses()
        loads = [_load_of(rank, status) for rank, status in enumerate(statuses)]
        if request.HasField("dp_rank"):
            loads = [load for load in loads if load.dp_rank == request.dp_rank]
        return vllm_engine_pb2.GetLoadsResponse(
            timestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            version=SERVER_TYPE,
            dp_rank_count=len(statuses),
            loads=loads,
        )

    async def GetTokenizer(  # noqa: N802 (gRPC method name)
        self, request: common_pb2.GetTokenizerRequest, context: aio.ServicerContext
    ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        for data, sha256 in (await self._zip()).chunks():
            yield common_pb2.GetTokenizerChunk(data=data, sha256=sha256)

    async def _zip(self) -> TokenizerZip:
        """Built once, off the event loop, on the first call; a failed build is not kept, so
        the next call builds again.

        Raises:
            TokenizerZipFailed: the build raised; the message says what failed.
        """
        if self._tokenizer_zip is None:
            loop = asyncio.get_running_loop()
            self._tokenizer_zip = loop.run_in_executor(
                None, build_tokenizer_zip, self.model, self.model_text
            )
        building = self._tokenizer_zip
        try:
            return await asyncio.shield(building)
        except Exception as error:
            if self._tokenizer_zip is building:
                self._tokenizer_zip = None
            log.exception("the tokenizer zip of %s failed to build", self.model)
            raise TokenizerZipFailed(
                f"the tokenizer zip of {self.model_text.model_id} failed to build: "
                f"{type(error).__name__}: {error}"
            ) from error

    async def Embed(self, request, context: aio.ServicerContext):  # noqa: N802
        await _unimplemented(context, "Embed: kvgate serves no embeddings")

    async def FlushCache(self, request, context: aio.ServicerContext):  # noqa: N802
        await _unimplemented(context, "FlushCache: the prefix cache is the executors' own")

    async def StartProfile(self, request, context: aio.ServicerContext):  # noqa: N802
        await _unimplemented(context, "StartProfile: profile an executor with its own tools")

    async def StopProfile(self, request, context: aio.ServicerContext):  # noqa: N802
        await _unimplemented(context, "StopProfile: profile an executor with its own tools")

    async def SubscribeKvEvents(self, request, context: aio.ServicerContext):  # noqa: N802
        await _unimplemented(context, "SubscribeKvEvents: KV cache events are not published")
        yield common_pb2.KvEventBatch()  # never reached: makes this a streaming handler


async def _unimplemented(context: aio.ServicerContext, message: str) -> None:
    await context.abort(grpc.StatusCode.UNIMPLEMENTED, message)


def _load_of(rank: int, status: internal_pb2.ExecutorStatus) -> vllm_engine_pb2.SchedulerLoad:
    total_tokens = status.num_total_blocks * status.block_size
    used_tokens = (status.num_total_blocks - status.num_free_blocks) * status.block_size
    return vllm_engine_pb2.SchedulerLoad(
        dp_rank=rank,
        num_running_reqs=status.num_running,
        num_waiting_reqs=status.num_waiting,
        num_total_reqs=status.num_running + status.num_waiting,
        num_used_tokens=used_tokens,
        max_total_num_tokens=total_tokens,
        token_usage=used_tokens / total_tokens if total_tokens else 0.0,
        max_running_requests=status.max_num_seqs,
        utilization=status.num_running / status.max_num_seqs if status.max_num_seqs else 0.0,
    )
