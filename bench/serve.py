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
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch
from grpc import aio
from tokenizers import Tokenizer, models, pre_tokenizers

from bench.engine import BENCH_SHAPE, Workload, build_model
from bench.harness import (
    Benchmark,
    add_device,
    add_model,
    add_workload,
    load_average,
    print_json,
    scratch_folder,
)
from bench.stats import paired_median_ms
from client.admin import create_key, set_limits
from common.sampling_params import SamplingParams
from deploy.certs import CertificateAuthority
from deploy.stack import RedisSecurity, Stack, StackConfig, co_located_torch_threads, free_port
from engine.config import EngineConfig
from engine.engine import Engine
from gateway.errors import ErrorInterceptor
from gateway.metrics import GatewayMetrics, MetricsInterceptor
from protos.kvgate.v1 import inference_pb2, inference_pb2_grpc


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


def grpc_request(prompt: list[int], max_tokens: int) -> inference_pb2.GenerateRequest:
    params = inference_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return inference_pb2.GenerateRequest(prompt_token_ids=prompt, params=params)


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
    """TTFT in ms of one Generate call, as its client sees it (then read to its end)."""
    start = time.perf_counter()
    chunks = stub.Generate(grpc_request(prompt, 4), timeout=600, metadata=metadata)
    next(c for c in chunks if c.token_ids)
    ttft = 1000 * (time.perf_counter() - start)
    list(chunks)
    return ttft


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
    "from bench.serve import serve\n"
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


# Limits far above what a benchmark sends: the quota script runs on every request, and
# never refuses one.
GENEROUS = {"requests_per_s": 10_000.0, "tokens_per_min": 100_000_000, "max_streams": 10_000}


@dataclass(frozen=True, slots=True)
class SecureAccess:
    """What a client of the secured stack needs."""

    ca: str  # the CA of the gateway's certificate

    def channel(self, address: str) -> grpc.Channel:
        credentials = grpc.ssl_channel_credentials(Path(self.ca).read_bytes())
        return grpc.secure_channel(address, credentials)


def secure_config(config: StackConfig, folder: Path) -> tuple[StackConfig, SecureAccess]:
    """`config` with keys, TLS and mutual TLS on, its Redis on TLS with an ACL user."""
    ca = CertificateAuthority(folder / "ca")
    server, sink, executor, redis_server = (
        ca.server(),
        ca.server("sink"),
        ca.client("executor"),
        ca.server("redis"),
    )
    config.auth = "keys"
    config.redis_security = RedisSecurity(
        ca.ca,
        redis_server.cert,
        redis_server.key,
        password=secrets.token_urlsafe(16),
        acl_file=str(folder / "users.acl"),
    )
    config.gateway_flags = [
        *config.gateway_flags,
        *("--tls-cert", server.cert, "--tls-key", server.key),
        *("--internal-tls-cert", sink.cert, "--internal-tls-key", sink.key),
        *("--internal-tls-client-ca", ca.ca),
    ]
    config.executor_flags = [
        *config.executor_flags,
        *("--sink-tls-ca", ca.ca, "--sink-tls-cert", executor.cert),
        *("--sink-tls-key", executor.key),
    ]
    return config, SecureAccess(ca.ca)


def tenant_key(stack: Stack, tenant: str, limits: dict[str, object] | None = None) -> str:
    """A new API key of `tenant` on the stack's Redis, with `limits` (default GENEROUS)."""
    client = stack.redis()
    set_limits(client, stack.keys, tenant, GENEROUS if limits is None else limits, print_nothing)
    return create_key(client, stack.keys, tenant, print_nothing)


def key_metadata(api_key: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {api_key}"),)


def print_nothing(_: str) -> None:
    """A `say` for kvgate admin's functions that keeps the new key off the output."""


class InstantInference(inference_pb2_grpc.InferenceServicer):
    async def Generate(  # noqa: N802 (gRPC method name)
        self, request: inference_pb2.GenerateRequest, context: aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        yield inference_pb2.GenerateResponse(request_id=request.request_id, token_ids=[1])
        yield inference_pb2.GenerateResponse(
            request_id=request.request_id, finish_reason=inference_pb2.FINISH_REASON_LENGTH
        )


async def serve(host: str, port: int) -> None:
    server = aio.server(interceptors=[MetricsInterceptor(GatewayMetrics()), ErrorInterceptor()])
    inference_pb2_grpc.add_InferenceServicer_to_server(InstantInference(), server)
    server.add_insecure_port(f"{host}:{port}")
    await server.start()
    await server.wait_for_termination()


BENCHMARKS = {"serve stack": Benchmark(add_arguments, run, "serve.json", print_json)}
