"""What security costs, hop by hop (`kvgate bench serve hops`), and whether a noisy tenant slows
a quiet one (`kvgate bench serve tenants`). Both write into bench/results/security.json by
default, under the keys "hops" and "tenants" (--out, --out-key).

What each defence of the secured stack adds to one hop, measured hop by hop on loopback.

A plain redis-server and one serving TLS only to an ACL user (as bench/serve.py's secured stack),
and a do-nothing Inference server (bench/serve.py's) plain, with TLS, and with mutual
TLS: each hop is timed against both sides taking turns (which side goes first alternates),
and the figure is the median of the paired differences with its 95% interval
(bench/stats.py paired_median_ms). Hops:
- the gateway's admission on the asyncio client: the quota script then the enqueue through
  redis-py's pipelined Script, which asks SCRIPT EXISTS first (three round trips); the quota
  script then the enqueue script (two); the enqueue script taking the quotas (one);
- one round trip of the blocking client the scheduler and the executors use (their reads of
  the request stream, the assignment, the executor's inbox) with a small command;
- a Generate call to its first chunk over a channel kept open, as a client and the TokenSink
  keep theirs (no handshake per call).

Noisy neighbour: does a tenant sending 10x its request limit slow another tenant down?

A local stack with API keys serves two tenants. "quiet" sends --quiet-rate requests per
second throughout and has no limit; "noisy" is limited to --noisy-limit requests per second
and sends, block after block in turn: nothing ("alone"), exactly its limit ("at_limit"), and
ten times it ("10x_limit": nine in ten are refused at the gateway). The blocks rotate
--rounds times so that every phase sees the machine at several moments. The noisy client is
a process of its own (as another team's service would be a client of its own), so that its
calls do not hold the quiet client's interpreter. Reported: quiet's TTFT per phase as its
client saw it and as the gateway measured it (the last chunk's timings), noisy's admitted
and refused calls, and the ratio of quiet's p99 TTFT at 10x over at the limit (target: at
most 1.2: the quota holds the noise back).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import secrets
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc import aio

from bench.harness import (
    Benchmark,
    add_model,
    add_prompt_len,
    load_average,
    print_json,
    scratch_folder,
)
from bench.stats import paired_median_ms, summarize_ms
from client.admin import create_key, set_limits
from common.keys import RedisKeys
from common.redis_conn import connect, connect_sync
from common.tenants import TenantLimits
from deploy.certs import CertificateAuthority
from deploy.models import SHARED_MODEL
from deploy.stack import RedisSecurity, Stack, StackConfig, find_redis_server, free_port, wait_until
from gateway.errors import ErrorInterceptor
from gateway.metrics import GatewayMetrics, MetricsInterceptor
from gateway.quotas import Quotas
from gateway.request_queue import ENQUEUE_SCRIPT, RequestQueue
from protos.kvgate.v1 import inference_pb2, inference_pb2_grpc, internal_pb2

LIMITS = TenantLimits(requests_per_s=1e9, tokens_per_min=10**12, max_streams=10**9)


def grpc_request(prompt: list[int], max_tokens: int) -> inference_pb2.GenerateRequest:
    params = inference_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return inference_pb2.GenerateRequest(prompt_token_ids=prompt, params=params)


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


def start_redis(args: list[str], url: str) -> subprocess.Popen:
    proc = subprocess.Popen([find_redis_server(), *args, "--save", ""], stdout=subprocess.DEVNULL)
    client = connect_sync(url)

    def answers() -> bool:
        try:
            return bool(client.ping())
        except Exception:  # noqa: BLE001 (not up yet)
            return False

    wait_until(answers, 30.0, "redis-server", proc)
    return proc


async def time_async(call: Callable[[], Awaitable[object]]) -> float:
    start = time.perf_counter()
    await call()
    return 1000 * (time.perf_counter() - start)


def time_sync(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return 1000 * (time.perf_counter() - start)


def summary(plain: list[float], secured: list[float]) -> dict[str, object]:
    return {
        "plain_p50_ms": statistics.median(plain),
        "secured_p50_ms": statistics.median(secured),
        "secured_minus_plain_ms": paired_median_ms(secured, plain),
    }


class Admission:
    """The gateway's admission against one Redis: quota script and enqueue, apart or as one."""

    def __init__(self, url: str) -> None:
        self.client = connect(url)
        self.keys = RedisKeys()
        self.quotas = Quotas(self.client, self.keys, cache_s=5.0)
        self.queue = RequestQueue(self.client, self.keys, max_queue_len=10**9, cancel_ttl_s=5.0)
        self.request = internal_pb2.QueuedRequest(request_id="r", prompt_token_ids=range(64))
        self.enqueue_script = self.client.register_script(ENQUEUE_SCRIPT)

    async def setup(self) -> None:
        await self.client.sadd(self.keys.executors, "e")
        await self.client.set(self.keys.executor_status("e"), b"alive")

    async def three_round_trips(self) -> None:
        """The quota script, then the enqueue through redis-py's pipelined Script (which
        asks SCRIPT EXISTS before each pipeline)."""
        admission = self.quotas.admission("t", LIMITS, take_request=True, open_stream=True)
        await self.quotas.take(admission)
        _, *keys_and_args = self.queue._enqueue_call(self.request, None)
        async with self.client.pipeline(transaction=False) as pipe:
            await self.enqueue_script(keys=keys_and_args[:2], args=keys_and_args[2:], client=pipe)
            await pipe.execute()

    async def two_round_trips(self) -> None:
        """The quota script, then the enqueue script."""
        admission = self.quotas.admission("t", LIMITS, take_request=True, open_stream=True)
        await self.quotas.take(admission)
        await self.queue.enqueue(self.request)

    async def one_round_trip(self) -> None:
        """The enqueue script taking the quotas."""
        admission = self.quotas.admission("t", LIMITS, take_request=True, open_stream=True)
        await self.queue.enqueue(self.request, admission)

    async def tidy(self) -> None:
        """Untimed, after each: the places and the queued requests taken away."""
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.delete(self.keys.tenant_streams("t"), self.keys.requests)
            await pipe.execute()


async def redis_hops(plain_url: str, tls_url: str, pairs: int) -> dict[str, object]:
    sides = {"plain": Admission(plain_url), "tls": Admission(tls_url)}
    blocking = {"plain": connect_sync(plain_url), "tls": connect_sync(tls_url)}
    for side in sides.values():
        await side.setup()
    samples: dict[str, dict[str, list[float]]] = {}
    for index in range(pairs + 20):
        order = ("plain", "tls") if index % 2 else ("tls", "plain")
        for name in order:
            side, sync_client = sides[name], blocking[name]
            timed = {}
            for hop, call in (
                ("admission_three_round_trips", side.three_round_trips),
                ("admission_two_round_trips", side.two_round_trips),
                ("admission_one_round_trip", side.one_round_trip),
            ):
                timed[hop] = await time_async(call)
                await side.tidy()
            timed["blocking_client_round_trip"] = time_sync(
                lambda c=sync_client: c.xlen(RedisKeys().requests)
            )
            if index >= 20:  # the first pairs warm the connections and scripts up
                for hop, ms in timed.items():
                    samples.setdefault(hop, {}).setdefault(name, []).append(ms)
    for side in sides.values():
        await side.client.aclose()
    return {hop: summary(s["plain"], s["tls"]) for hop, s in samples.items()}


def grpc_server(folder: Path, ca: CertificateAuthority, mutual: bool) -> tuple[str, aio.Server]:
    server = aio.server()
    inference_pb2_grpc.add_InferenceServicer_to_server(InstantInference(), server)
    port = free_port()
    if ca is None:
        server.add_insecure_port(f"127.0.0.1:{port}")
    else:
        pem = ca.server("grpc")
        pair = [(Path(pem.key).read_bytes(), Path(pem.cert).read_bytes())]
        root = Path(ca.ca).read_bytes() if mutual else None
        credentials = grpc.ssl_server_credentials(pair, root, require_client_auth=mutual)
        server.add_secure_port(f"127.0.0.1:{port}", credentials)
    return f"127.0.0.1:{port}", server


def grpc_channel(address: str, ca: CertificateAuthority | None, mutual: bool) -> grpc.Channel:
    if ca is None:
        return grpc.insecure_channel(address)
    client = ca.client("executor") if mutual else None
    credentials = grpc.ssl_channel_credentials(
        Path(ca.ca).read_bytes(),
        Path(client.key).read_bytes() if client else None,
        Path(client.cert).read_bytes() if client else None,
    )
    return grpc.secure_channel(address, credentials)


def first_chunk_ms(stub: inference_pb2_grpc.InferenceStub) -> float:
    start = time.perf_counter()
    chunks = stub.Generate(inference_pb2.GenerateRequest(prompt_token_ids=[1, 2, 3]))
    next(chunks)
    ms = 1000 * (time.perf_counter() - start)
    chunks.cancel()
    return ms


async def grpc_hops(ca: CertificateAuthority, folder: Path, pairs: int) -> dict[str, object]:
    kinds = {"plain": (None, False), "tls": (ca, False), "mutual_tls": (ca, True)}
    servers, stubs = [], {}
    for name, (authority, mutual) in kinds.items():
        address, server = grpc_server(folder, authority, mutual)
        await server.start()
        servers.append(server)
        stubs[name] = inference_pb2_grpc.InferenceStub(grpc_channel(address, authority, mutual))
    loop = asyncio.get_running_loop()
    samples: dict[str, list[float]] = {name: [] for name in kinds}
    for index in range(pairs + 20):
        names = list(kinds) if index % 2 else list(reversed(kinds))
        for name in names:
            ms = await loop.run_in_executor(None, first_chunk_ms, stubs[name])
            if index >= 20:
                samples[name].append(ms)
    for server in servers:
        await server.stop(None)
    return {
        "grpc_call_tls": summary(samples["plain"], samples["tls"]),
        "grpc_call_mutual_tls": summary(samples["plain"], samples["mutual_tls"]),
    }


async def measure_hops(pairs: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="kvgate-hops-") as scratch:
        folder = Path(scratch)
        ca = CertificateAuthority(folder / "ca")
        pem = ca.server("redis")
        security = RedisSecurity(
            ca.ca, pem.cert, pem.key, password=secrets.token_urlsafe(16),
            acl_file=str(folder / "users.acl"),
        )  # fmt: skip
        plain_port, tls_port = free_port(), free_port()
        plain_url, tls_url = f"redis://127.0.0.1:{plain_port}/0", security.url(tls_port)
        procs = [
            start_redis(["--port", str(plain_port)], plain_url),
            start_redis(security.server_args(tls_port), tls_url),
        ]
        try:
            results = await redis_hops(plain_url, tls_url, pairs)
            results |= await grpc_hops(ca, folder, pairs)
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
    return results


def add_hops_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pairs", type=int, default=2000)


def run_hops(args: argparse.Namespace) -> dict:
    """`kvgate bench serve hops`."""
    return {"pairs": args.pairs, "load_average": load_average()} | asyncio.run(
        measure_hops(args.pairs)
    )


PHASES = {"alone": 0.0, "at_limit": 1.0, "10x_limit": 10.0}  # noisy's rate / its limit
# A block: its phase, when it starts (time.time()), its request rate for the sender.
Block = tuple[str, float, float]


class Sender:
    """Sends Generate calls at fixed rates, block by block, recording each outcome."""

    def __init__(self, address: str, api_key: str, prompt: list[int], max_tokens: int) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = inference_pb2_grpc.InferenceStub(self.channel)
        self.metadata = key_metadata(api_key)
        self.request = grpc_request(prompt, max_tokens)
        self.pool = ThreadPoolExecutor(128)
        self.lock = threading.Lock()
        self.results: dict[str, dict[str, list]] = {}

    def one(self, phase: str) -> None:
        start = time.perf_counter()
        outcome = {"ttft_s": [], "gateway_ttft_s": [], "refused": []}
        try:
            chunks = self.stub.Generate(self.request, timeout=120, metadata=self.metadata)
            next(c for c in chunks if c.token_ids)
            outcome["ttft_s"].append(time.perf_counter() - start)
            outcome["gateway_ttft_s"].append(list(chunks)[-1].timings.ttft_ms / 1000)
        except grpc.RpcError as error:
            outcome["refused"].append(error.code().name)
        with self.lock:
            results = self.results.setdefault(phase, {name: [] for name in outcome})
            for name, values in outcome.items():
                results[name].extend(values)

    def run(self, blocks: list[Block], block_s: float) -> dict[str, dict[str, list]]:
        """Send each block's requests from its start for `block_s`; wait for all answers."""
        for phase, start_at, rate in blocks:
            time.sleep(max(0.0, start_at - time.time()))
            start = time.perf_counter()
            for index in range(int(rate * block_s)):
                time.sleep(max(0.0, start + index / rate - time.perf_counter()))
                self.pool.submit(self.one, phase)
        self.pool.shutdown(wait=True)
        self.channel.close()
        return self.results


def send_noisy(address, api_key, prompt, max_tokens, blocks, block_s, results) -> None:
    """The noisy client's process: send its blocks, put its results on `results`."""
    results.put(Sender(address, api_key, prompt, max_tokens).run(blocks, block_s))


def schedule(args: argparse.Namespace, start_at: float) -> tuple[list[Block], list[Block]]:
    """The quiet and noisy clients' blocks: every phase in turn, --rounds times, 1 s apart
    (the previous block's calls finish; the noisy tenant's bucket refills)."""
    quiet, noisy = [], []
    for index in range(args.rounds * len(PHASES)):
        phase, times_limit = list(PHASES.items())[index % len(PHASES)]
        begins = start_at + index * (args.block_s + 1.0)
        quiet.append((phase, begins, args.quiet_rate))
        noisy.append((phase, begins, times_limit * args.noisy_limit))
    return quiet, noisy


def run(args: argparse.Namespace) -> dict:
    load_at_start = load_average()
    with scratch_folder() as folder:
        config = StackConfig(
            model=str(args.model),
            port=free_port(),
            log_dir=folder / "logs",
            auth="keys",
            scheduler_flags=["--batch-window-ms", "2"],
            executor_flags=["--max-num-seqs", "64"],
        )
        stack = Stack(config)
        try:
            stack.start_all()
            return {"load_average_at_start": load_at_start, **measure(stack, args)}
        finally:
            stack.stop_all()


def measure(stack: Stack, args: argparse.Namespace) -> dict:
    quiet_key = tenant_key(stack, "quiet")
    noisy_key = tenant_key(stack, "noisy", {"requests_per_s": args.noisy_limit})
    prompt = [(i * 11) % 400 + 20 for i in range(args.prompt_len)]
    quiet_blocks, noisy_blocks = schedule(args, time.time() + 5.0)
    spawn = multiprocessing.get_context("spawn")
    noisy_results = spawn.Queue()
    noisy = spawn.Process(
        target=send_noisy,
        args=(stack.address, noisy_key, prompt, args.max_tokens, noisy_blocks, args.block_s,
              noisy_results),
    )  # fmt: skip
    noisy.start()
    warm_up = [("warm-up", time.time(), args.quiet_rate)]
    Sender(stack.address, quiet_key, prompt, args.max_tokens).run(warm_up, 3.0)
    quiet = Sender(stack.address, quiet_key, prompt, args.max_tokens)
    quiet_results = quiet.run(quiet_blocks, args.block_s)
    noisy_counts = noisy_results.get(timeout=600)
    noisy.join(60)
    return report(args, quiet_results, noisy_counts)


def report(args: argparse.Namespace, quiet: dict, noisy: dict) -> dict:
    phases = {
        phase: {
            "quiet_ttft_ms": summarize_ms(quiet[phase]["ttft_s"]),
            "quiet_gateway_ttft_ms": summarize_ms(quiet[phase]["gateway_ttft_s"]),
            "quiet_samples": len(quiet[phase]["ttft_s"]),
            "quiet_refused": len(quiet[phase]["refused"]),
            "noisy_admitted": len(noisy.get(phase, {}).get("ttft_s", [])),
            "noisy_refused": len(noisy.get(phase, {}).get("refused", [])),
        }
        for phase in PHASES
    }

    def p99_ratio(key: str, phase: str, baseline: str) -> float | None:
        """None when a phase had no samples (a run too short for its blocks)."""
        over, under = phases[phase][key]["p99"], phases[baseline][key]["p99"]
        return over / under if over is not None and under is not None else None

    return {
        "model": Path(args.model).name,
        "quiet_rate": args.quiet_rate,
        "noisy_limit_requests_per_s": args.noisy_limit,
        "block_s": args.block_s,
        "rounds": args.rounds,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "cpus": os.cpu_count(),
        "load_average_at_end": load_average(),
        "phases": phases,
        "quiet_p99_ttft_ratio_10x_over_at_limit": p99_ratio(
            "quiet_ttft_ms", "10x_limit", "at_limit"
        ),
        "quiet_p99_gateway_ttft_ratio_10x_over_at_limit": p99_ratio(
            "quiet_gateway_ttft_ms", "10x_limit", "at_limit"
        ),
        "quiet_p99_ttft_ratio_10x_over_alone": p99_ratio("quiet_ttft_ms", "10x_limit", "alone"),
    }


def add_tenants_arguments(parser: argparse.ArgumentParser) -> None:
    add_model(parser, str(SHARED_MODEL), "model folder")
    parser.add_argument("--quiet-rate", type=float, default=5.0, help="quiet's requests/s")
    parser.add_argument("--noisy-limit", type=float, default=5.0, help="noisy's requests/s")
    parser.add_argument("--block-s", type=float, default=15.0, help="seconds of each block")
    parser.add_argument("--rounds", type=int, default=8, help="times each phase comes round")
    add_prompt_len(parser, 32)
    parser.add_argument("--max-tokens", type=int, default=16)


BENCHMARKS = {
    "serve hops": Benchmark(
        add_hops_arguments, run_hops, "security.json", print_json, out_key="hops"
    ),
    "serve tenants": Benchmark(
        add_tenants_arguments, run, "security.json", print_json, out_key="tenants"
    ),
}
