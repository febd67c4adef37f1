"""What each defence of the secured stack adds to one hop, measured hop by hop on loopback.

    python -m bench.secure_hops [--pairs 2000] [--out bench/results/secure_hops.json]

A plain redis-server and one serving TLS only to an ACL user (as bench/secure.py's stack),
and a do-nothing Inference server (bench/grpc_floor.py's) plain, with TLS, and with mutual
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
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import statistics
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
from grpc import aio

from bench.grpc_floor import InstantInference
from bench.stats import paired_median_ms, print_and_save
from common.keys import RedisKeys
from common.redis_conn import connect, connect_sync
from common.tenants import TenantLimits
from deploy.stack import RedisSecurity, find_redis_server, free_port, wait_until
from gateway.quotas import Quotas
from gateway.request_queue import ENQUEUE_SCRIPT, RequestQueue
from protos.kvgate.v1 import inference_pb2, inference_pb2_grpc, internal_pb2
from tests.certs import CertificateAuthority

LIMITS = TenantLimits(requests_per_s=1e9, tokens_per_min=10**12, max_streams=10**9)


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


async def measure(pairs: int) -> dict[str, object]:
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=Path("bench/results/secure_hops.json"))
    args = parser.parse_args(argv)
    results = {"pairs": args.pairs, "load_average": list(__import__("os").getloadavg())}
    print_and_save(results | asyncio.run(measure(args.pairs)), args.out)


if __name__ == "__main__":
    main()
