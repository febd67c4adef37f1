"""`kvgate bench serve stack`: the whole stack (gateway, Redis, scheduler, executor) against the
in-process Engine, on the engine benchmark's model and workload, plain and with every defence
on, in one run.

Reports the throughput ratio grpc / in-process (target >= 0.9) and the TTFT p50 at
1 request/s (the sides take turns, a third of a second apart); the stack's TTFT minus
batch_window_ms is compared with the in-process TTFT (target: at most 3 ms more). A second
stack with every defence on (secure_config: API keys and quotas on the gateway, TLS on its
public port, mutual TLS on the TokenSink, Redis serving TLS only to an ACL user; certificates
made for the run by deploy/certs.py in its scratch folder) takes its turns too: its TTFT over
the plain stack's is what security costs (target: under 1 ms), reported as the median of the
paired differences with its 95% bootstrap interval.

The same client also times a do-nothing server at the same rate (InstantInference, in a
process of its own like a gateway): `Generate` answers at once with one chunk holding one
token and a last chunk, on the gateway's grpc.aio server stack (its interceptors included)
with no Redis, scheduler or model behind it: the part of the stack's TTFT that any Python
gRPC front end pays before doing any work.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import grpc
import httpx
import torch
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc
from tokenizers import Tokenizer, models, pre_tokenizers

from bench.engine import BENCH_SHAPE, Workload, build_model
from bench.harness import (
    Benchmark,
    add_device,
    add_model,
    add_stream_rounds,
    add_ttft_turns,
    add_workload,
    load_average,
    print_json,
    scratch_folder,
)
from bench.security import grpc_request, key_metadata, secure_config, tenant_key
from bench.stats import generate_ttft_ms, paired_median_ms, sse_payloads
from bench.workloads import openai_body
from common.model_text import ModelText
from common.sampling_params import SamplingParams
from deploy.models import SHARED_MODEL
from deploy.stack import Stack, StackConfig, co_located_torch_threads, free_port
from engine.config import EngineConfig
from engine.engine import Engine
from protos.kvgate.v1 import inference_pb2_grpc


def write_model(folder: Path) -> None:
    """Saves the engine benchmark's model with a word-level tokenizer over its whole vocabulary."""
    build_model(BENCH_SHAPE, torch.float32).save_pretrained(folder)
    vocab = {f"w{i}": i for i in range(BENCH_SHAPE["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"unk_token": "w0"}))


def engine_config(model: Path, args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=str(model),
        device=args.device,
        max_num_seqs=args.num_requests,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_gib=args.kv_cache_gib,
    )


def inprocess_tokens_per_s(engine: Engine, prompts: list[list[int]], output_len: int) -> float:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for index, prompt in enumerate(prompts):
        engine.add_request(f"tput-{index}", prompt, params)
    produced = 0
    while engine.has_unfinished():
        produced += sum(len(o.new_token_ids) for o in engine.step())
    return produced / (time.perf_counter() - start)


def inprocess_ttft_once(engine: Engine, request_id: str, prompt: list[int]) -> float:
    """TTFT in ms of one request alone in the engine (then run to its end, untimed)."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    while not any(o.new_token_ids for o in engine.step()):
        pass
    ttft = 1000 * (time.perf_counter() - start)
    while engine.has_unfinished():
        engine.step()
    return ttft


def grpc_tokens_per_s(
    connect: Callable[[], grpc.Channel],
    prompts: list[list[int]],
    output_len: int,
    metadata: tuple[tuple[str, str], ...] = (),
) -> float:
    """Output tokens per second of all `prompts` streamed at once on a channel `connect` opens."""
    # The channel is closed before the pool waits for its threads: on SIGTERM (SystemExit)
    # that cancels the streams at once instead of waiting for them to finish.
    with ThreadPoolExecutor(len(prompts)) as pool, connect() as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)

        def stream(prompt: list[int]) -> int:
            request = grpc_request(prompt, output_len)
            chunks = stub.Generate(request, timeout=3600, metadata=metadata)
            return sum(len(chunk.token_ids) for chunk in chunks)

        start = time.perf_counter()
        produced = sum(pool.map(stream, prompts))
    return produced / (time.perf_counter() - start)


def grpc_ttft_once(
    stub: inference_pb2_grpc.InferenceStub,
    prompt: list[int],
    metadata: tuple[tuple[str, str], ...] = (),
) -> float:
    """TTFT in ms of one Generate call of `prompt`, as its client sees it."""
    return generate_ttft_ms(stub, grpc_request(prompt, 4), metadata)


def grpc_ttft_ms(address: str, prompts: list[list[int]], interval_s: float) -> list[float]:
    with grpc.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        ttfts = []
        for prompt in prompts:
            time.sleep(interval_s)
            ttfts.append(grpc_ttft_once(stub, prompt))
    return ttfts


Side = tuple[grpc.Channel, tuple[tuple[str, str], ...]]  # a stack's channel, call metadata


def interleaved_ttft_ms(
    engine: Engine, sides: dict[str, Side], prompts: list[list[int]], interval_s: float
) -> dict[str, list[float]]:
    """TTFT of each prompt in process ("inprocess") and through each stack of `sides`,
    taking turns evenly spaced: each side gets a request every `interval_s`, and all see the
    same machine (on a shared machine the in-process TTFT alone moves by several ms between
    minutes)."""
    stubs = {name: (inference_pb2_grpc.InferenceStub(ch), md) for name, (ch, md) in sides.items()}
    samples: dict[str, list[float]] = {"inprocess": [], **{name: [] for name in sides}}
    gap_s = interval_s / (1 + len(sides))
    for index, prompt in enumerate(prompts):
        time.sleep(gap_s)
        samples["inprocess"].append(inprocess_ttft_once(engine, f"ttft-{index}", prompt))
        for name, (stub, metadata) in stubs.items():
            time.sleep(gap_s)
            samples[name].append(grpc_ttft_once(stub, prompt, metadata))
    return samples


# The do-nothing server's process (InstantInference below).
FLOOR_SERVER = (
    "import asyncio, sys\n"
    "from bench.security import serve\n"
    "asyncio.run(serve('127.0.0.1', int(sys.argv[1])))\n"
)


def grpc_floor_ttft_ms(prompts: list[list[int]], interval_s: float) -> list[float]:
    """grpc_ttft_ms against the do-nothing server, started as its own process like a gateway."""
    port = free_port()
    command = [sys.executable, "-c", FLOOR_SERVER, str(port)]
    server = subprocess.Popen(command, cwd=Path(__file__).resolve().parents[1])
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
        grpc_ttft_ms(f"127.0.0.1:{port}", prompts[:2], 0.0)  # warm-up, untimed
        return grpc_ttft_ms(f"127.0.0.1:{port}", prompts, interval_s)
    finally:
        server.terminate()
        server.wait(10)


def stack_config(model: Path, folder: Path, args: argparse.Namespace) -> StackConfig:
    executor_flags = [
        "--device",
        args.device,
        "--max-num-seqs",
        str(args.num_requests),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--kv-cache-gib",
        str(args.kv_cache_gib),
    ]
    return StackConfig(
        model=str(model),
        port=free_port(),
        log_dir=folder / "logs",
        executor_flags=executor_flags,
        scheduler_flags=["--batch-window-ms", str(args.batch_window_ms)],
        # A Redis call that takes over 0.5 s (the default) fails the request; on a loaded
        # shared machine the TLS handshakes of 64 streams' first calls can: 5 s on both sides.
        gateway_flags=["--max-queue-len", str(4 * args.num_requests), "--redis-timeout-s", "5"],
    )


def measure(model: Path, folder: Path, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """Throughput in process, then through the stack; then TTFT of both, taking turns.

    The in-process Engine gets the model threads the stack's executor gets.
    """
    torch.set_num_threads(co_located_torch_threads())
    engine = Engine(engine_config(model, args))
    inprocess_tokens_per_s(engine, prompts[:4], 8)
    inprocess = inprocess_tokens_per_s(engine, prompts, args.output_len)
    stack = Stack(stack_config(model, folder, args))
    secured, access = secure_config(stack_config(model, folder, args), folder / "secure")
    secured.log_dir = folder / "secure-logs"
    secure = Stack(secured)
    try:
        stack.start_all()
        secure.start_all()
        api_key = tenant_key(secure, "bench")
        ttft_prompts = [prompts[i % len(prompts)] for i in range(args.ttft_requests)]
        connects = {
            "grpc": (lambda: grpc.insecure_channel(stack.address), ()),
            "secure": (lambda: access.channel(secure.address), key_metadata(api_key)),
        }
        # Both stacks run the same work before their TTFTs are taken: their prefix caches then
        # hold the same prompts.
        tokens_per_s = {}
        for name, (connect, metadata) in connects.items():
            grpc_tokens_per_s(connect, prompts[:4], 8, metadata)
            tokens_per_s[name] = grpc_tokens_per_s(connect, prompts, args.output_len, metadata)
        with grpc.insecure_channel(stack.address) as plain, access.channel(secure.address) as tls:
            sides = {"grpc": (plain, ()), "secure": (tls, key_metadata(api_key))}
            interleaved_ttft_ms(engine, sides, ttft_prompts[:4], 0.0)  # warm-up, untimed
            ttft = interleaved_ttft_ms(engine, sides, ttft_prompts, args.ttft_interval_s)
    finally:
        stack.stop_all()
        secure.stop_all()
    return {
        "inprocess_tokens_per_s": inprocess,
        "grpc_tokens_per_s": tokens_per_s["grpc"],
        "secure_tokens_per_s": tokens_per_s["secure"],
        "ttft_ms_inprocess": ttft["inprocess"],
        "ttft_ms_grpc": ttft["grpc"],
        "ttft_ms_secure": ttft["secure"],
        "ttft_ms_grpc_floor": grpc_floor_ttft_ms(ttft_prompts, args.ttft_interval_s),
    }


def paired_overhead_ms(inprocess: list[float], grpc: list[float], window_ms: float) -> float:
    """The median over the TTFT pairs (taken half a second apart) of the stack's TTFT minus
    the window minus the in-process one: the stack's overhead, less moved than the difference
    of the two medians by how much one step's time varies from request to request."""
    if len(inprocess) != len(grpc) or not inprocess:
        raise ValueError(f"need pairs of TTFTs, got {len(inprocess)} and {len(grpc)}")
    return statistics.median(g - window_ms - i for i, g in zip(inprocess, grpc, strict=True))


def run(args: argparse.Namespace) -> dict:
    workload = Workload(args.num_requests, args.prompt_len, args.output_len)
    load_at_start = load_average()
    with scratch_folder() as folder:
        model = args.model or folder
        if args.model is None:
            write_model(folder)
        vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
        samples = measure(model, folder, workload.prompts(vocab_size), args)
    ttft_inprocess = statistics.median(samples["ttft_ms_inprocess"])
    ttft_grpc = statistics.median(samples["ttft_ms_grpc"])
    return {
        "model": args.model.name if args.model else "llama-56M (random, float32)",
        "device": args.device,
        "workload": vars(workload),
        "batch_window_ms": args.batch_window_ms,
        "torch_threads": co_located_torch_threads(),
        "cpus": os.cpu_count(),
        "load_average_at_start": load_at_start,  # 1, 5 and 15 minutes: other work running
        "load_average_at_end": load_average(),
        "inprocess_tokens_per_s": samples["inprocess_tokens_per_s"],
        "grpc_tokens_per_s": samples["grpc_tokens_per_s"],
        "throughput_ratio": samples["grpc_tokens_per_s"] / samples["inprocess_tokens_per_s"],
        "secure_tokens_per_s": samples["secure_tokens_per_s"],
        "throughput_ratio_secure_over_grpc": (
            samples["secure_tokens_per_s"] / samples["grpc_tokens_per_s"]
        ),
        "ttft_p50_ms_inprocess": ttft_inprocess,
        "ttft_p50_ms_grpc": ttft_grpc,
        "ttft_p50_ms_grpc_minus_window_over_inprocess": (
            ttft_grpc - args.batch_window_ms - ttft_inprocess
        ),
        "ttft_p50_ms_grpc_floor": statistics.median(samples["ttft_ms_grpc_floor"]),
        "ttft_paired_p50_ms_grpc_minus_window_over_inprocess": paired_overhead_ms(
            samples["ttft_ms_inprocess"], samples["ttft_ms_grpc"], args.batch_window_ms
        ),
        "ttft_p50_ms_secure": statistics.median(samples["ttft_ms_secure"]),
        "ttft_paired_p50_ms_secure_over_grpc": paired_median_ms(
            samples["ttft_ms_secure"], samples["ttft_ms_grpc"]
        ),
        "ttft_samples_ms": {
            key: samples[key]
            for key in ("ttft_ms_inprocess", "ttft_ms_grpc", "ttft_ms_secure", "ttft_ms_grpc_floor")
        },
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_device(parser)
    add_model(parser, None, "a checkpoint folder with a tokenizer (default: the engine "
              "benchmark's 56 M model)", type=Path)  # fmt: skip
    add_workload(parser)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    parser.add_argument("--batch-window-ms", type=float, default=2.0)
    parser.add_argument(
        "--ttft-requests",
        type=int,
        default=120,
        help="TTFT samples per side: one step's time moves by several ms between requests",
    )
    parser.add_argument("--ttft-interval-s", type=float, default=1.0, help="1 request/s")


# `kvgate bench serve fronts`: one stack, the same prompts through its three fronts.
FRONTS = ("kvgate", "vllm", "openai")
FRONT_PROMPTS = ["Once upon a time", "The little dog", "Lily and Ben went to the park", "One day"]
HTTP_CLIENT = f"httpx {httpx.__version__}, one connection pool, SSE read line by line"


@dataclass(frozen=True, slots=True)
class Fronts:
    """How a client reaches each front of one gateway."""

    address: str  # the gRPC port: kvgate.v1 and VllmEngine
    http_url: str  # the OpenAI-compatible base URL
    model_id: str  # the `model` of an OpenAI request


def vllm_request(prompt: list[int], max_tokens: int) -> vllm_engine_pb2.GenerateRequest:
    params = vllm_engine_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tokenized = vllm_engine_pb2.TokenizedInput(input_ids=prompt)
    return vllm_engine_pb2.GenerateRequest(tokenized=tokenized, sampling_params=params, stream=True)


def vllm_ttft_once(stub: vllm_engine_pb2_grpc.VllmEngineStub, prompt: list[int]) -> float:
    """TTFT in ms of one VllmEngine Generate, as its client sees it (then read to its end)."""
    start = time.perf_counter()
    responses = stub.Generate(vllm_request(prompt, 4), timeout=600)
    next(r for r in responses if r.WhichOneof("response") == "chunk")
    ttft = 1000 * (time.perf_counter() - start)
    list(responses)
    return ttft


def vllm_tokens_per_s(address: str, prompts: list[list[int]], output_len: int) -> float:
    """Output tokens per second of all `prompts` streamed at once through VllmEngine."""
    with ThreadPoolExecutor(len(prompts)) as pool, grpc.insecure_channel(address) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)

        def stream(prompt: list[int]) -> int:
            responses = stub.Generate(vllm_request(prompt, output_len), timeout=3600)
            return sum(len(r.chunk.token_ids) for r in responses)

        start = time.perf_counter()
        produced = sum(pool.map(stream, prompts))
    return produced / (time.perf_counter() - start)


def http_ttft_once(client: httpx.Client, model_id: str, prompt: list[int]) -> float:
    """TTFT in ms of one streaming /v1/completions: to the first event with a choice (a
    completion stream has no role event before its first token), then read to its end."""
    start = time.perf_counter()
    with client.stream(
        "POST", "/completions", json=openai_body(model_id, 4, prompt=prompt)
    ) as answer:
        answer.raise_for_status()
        events = sse_payloads(answer.iter_lines())
        next(event for event in events if event["choices"])
        ttft = 1000 * (time.perf_counter() - start)
        list(events)
    return ttft


async def http_stream_tokens(client: httpx.AsyncClient, body: dict) -> int:
    """Output tokens of one streaming /v1/completions, from its last event's usage."""
    async with client.stream("POST", "/completions", json=body) as answer:
        answer.raise_for_status()
        lines = [line async for line in answer.aiter_lines()]
    return next(e["usage"] for e in sse_payloads(lines) if e.get("usage"))["completion_tokens"]


async def http_tokens_per_s_async(fronts: Fronts, prompts: list[list[int]], output_len: int):
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    async with httpx.AsyncClient(base_url=fronts.http_url, limits=limits, timeout=3600) as client:
        bodies = [openai_body(fronts.model_id, output_len, prompt=prompt) for prompt in prompts]
        start = time.perf_counter()
        produced = await asyncio.gather(*(http_stream_tokens(client, b) for b in bodies))
    return sum(produced) / (time.perf_counter() - start)


def http_tokens_per_s(fronts: Fronts, prompts: list[list[int]], output_len: int) -> float:
    """Output tokens per second of all `prompts` streamed at once through the HTTP front."""
    return asyncio.run(http_tokens_per_s_async(fronts, prompts, output_len))


def front_ttfts(fronts: Fronts, prompts: list[list[int]], interval_s: float) -> dict:
    """Each prompt once through each front, taking turns `interval_s` apart."""
    samples: dict[str, list[float]] = {front: [] for front in FRONTS}
    with (
        grpc.insecure_channel(fronts.address) as channel,
        httpx.Client(base_url=fronts.http_url, timeout=600) as http,
    ):
        ttft_once = {
            "kvgate": partial(grpc_ttft_once, inference_pb2_grpc.InferenceStub(channel)),
            "vllm": partial(vllm_ttft_once, vllm_engine_pb2_grpc.VllmEngineStub(channel)),
            "openai": partial(http_ttft_once, http, fronts.model_id),
        }
        for prompt in prompts:
            for front in FRONTS:
                time.sleep(interval_s)
                samples[front].append(ttft_once[front](prompt))
    return samples


def front_throughputs(fronts: Fronts, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """Rounds of all `prompts` at once through each front in turn."""
    measures = {
        "kvgate": lambda: grpc_tokens_per_s(
            lambda: grpc.insecure_channel(fronts.address), prompts, args.output_len
        ),
        "vllm": lambda: vllm_tokens_per_s(fronts.address, prompts, args.output_len),
        "openai": lambda: http_tokens_per_s(fronts, prompts, args.output_len),
    }
    rounds: dict[str, list[float]] = {front: [] for front in FRONTS}
    for _ in range(args.repeats):
        for front in FRONTS:
            rounds[front].append(measures[front]())
    return rounds


def served_fronts(stack: Stack) -> Fronts:
    """The fronts of the stack's gateway (Stack.start_all waited for its HTTP port)."""
    models = httpx.get(f"{stack.http_url}/models", timeout=30).raise_for_status().json()
    return Fronts(stack.address, stack.http_url, models["data"][0]["id"])


def run_fronts(args: argparse.Namespace) -> dict:
    model_text = ModelText(args.model)
    token_ids = [model_text.encode(p) for p in FRONT_PROMPTS]
    load_at_start = load_average()
    with scratch_folder() as folder:
        config = StackConfig(model=args.model, port=free_port(), log_dir=folder / "logs")
        config.http_port = free_port()
        config.executor_flags = ["--max-num-seqs", str(max(64, args.streams))]
        config.gateway_flags = ["--max-queue-len", str(4 * args.streams)]
        stack = Stack(config)
        try:
            stack.start_all()
            fronts = served_fronts(stack)
            front_ttfts(fronts, token_ids[:2], 0.0)  # warm-up, untimed
            prompts = [token_ids[i % len(token_ids)] for i in range(args.ttft_requests)]
            ttft = front_ttfts(fronts, prompts, args.ttft_interval_s)
            streams = [token_ids[i % len(token_ids)] for i in range(args.streams)]
            front_throughputs(fronts, streams[:4], argparse.Namespace(output_len=8, repeats=1))
            rounds = front_throughputs(fronts, streams, args)
        finally:
            stack.stop_all()
    return fronts_report(args, ttft, rounds, load_at_start)


def fronts_report(args: argparse.Namespace, ttft: dict, rounds: dict, load_at_start) -> dict:
    tokens_per_s = {front: statistics.median(values) for front, values in rounds.items()}
    others = [front for front in FRONTS if front != "kvgate"]
    return {
        "model": Path(args.model).name,
        "http_client": HTTP_CLIENT,
        "cpus": os.cpu_count(),
        "load_average_at_start": load_at_start,  # 1, 5 and 15 minutes: other work running
        "load_average_at_end": load_average(),
        "ttft_requests": args.ttft_requests,
        "ttft_ms_p50": {front: statistics.median(values) for front, values in ttft.items()},
        "ttft_paired_ms_minus_kvgate": {
            front: paired_median_ms(ttft[front], ttft["kvgate"]) for front in others
        },
        "streams": args.streams,
        "output_len": args.output_len,
        "tokens_per_s_rounds": rounds,
        "tokens_per_s_median": tokens_per_s,
        "tokens_per_s_ratio_to_kvgate": {
            front: tokens_per_s[front] / tokens_per_s["kvgate"] for front in others
        },
        # Each round's ratio to kvgate.v1's round just before it: the median, and the spread
        "tokens_per_s_ratio_by_round": {
            front: [a / b for a, b in zip(rounds[front], rounds["kvgate"], strict=True)]
            for front in others
        },
        "ttft_samples_ms": ttft,
    }


def add_fronts_arguments(parser: argparse.ArgumentParser) -> None:
    add_model(parser, str(SHARED_MODEL), "the served model folder (default: stories260K)")
    add_ttft_turns(parser, 100, "front")
    add_stream_rounds(parser, output_len=128, repeats=5)


BENCHMARKS = {
    "serve stack": Benchmark(add_arguments, run, "serve.json", print_json),
    "serve fronts": Benchmark(add_fronts_arguments, run_fronts, "fronts.json", print_json),
}
