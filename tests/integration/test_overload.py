"""Overload is refused, never dropped: thousands of concurrent streams all complete; past a
gateway's explicit limits a call is refused at once with RESOURCE_EXHAUSTED naming the limit,
and counted; request messages over the receive limit are refused unparsed and prompts too
long to serve before tokenizing, while a running stream keeps flowing."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import queue
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import pytest
import redis

from client.api import KvgateClient, sampling_params
from common.model_text import ModelText
from deploy.stack import free_port
from protos.kvgate.v1 import inference_pb2, inference_pb2_grpc
from tests.helpers import REPO, STORIES_260K, wait_for
from tests.integration.conftest import scrape
from tests.integration.huge_prompts_client import huge_prompt

NUM_STREAMS = 3000
HUGE_PROMPT_CHARS = 3_900_000
HUGE_MESSAGE_BYTES = HUGE_PROMPT_CHARS + 5  # the prompt field's tag and length
NUM_HUGE_PROMPTS = 20
FLOOD_ROUNDS = 3
REFUSAL_RATIO = 3.0
GAP_RATIO = 3.0
# A Redis script that keeps the server busy for ARGV[1] microseconds (every client waits).
BUSY_SCRIPT = """
local t = redis.call('TIME')
local start = t[1] * 1000000 + t[2]
repeat t = redis.call('TIME') until t[1] * 1000000 + t[2] - start > tonumber(ARGV[1])
return 1
"""


@pytest.fixture(scope="module")
def stack(stack_factory):
    return stack_factory(num_executors=2)


async def _one_stream(stub, index: int, outcomes: collections.Counter) -> None:
    params = sampling_params(max_tokens=8, temperature=0.0, ignore_eos=True)
    request = inference_pb2.GenerateRequest(prompt=f"Once upon a time {index}", params=params)
    try:
        tokens = [t async for chunk in stub.Generate(request, timeout=600) for t in chunk.token_ids]
        outcomes["complete" if len(tokens) == 8 else f"{len(tokens)} tokens"] += 1
    except grpc.aio.AioRpcError as error:
        outcomes[f"{error.code().name}: {error.details()[:80]}"] += 1


async def _streams(address: str, count: int) -> collections.Counter:
    outcomes: collections.Counter = collections.Counter()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        await asyncio.gather(*(_one_stream(stub, i, outcomes) for i in range(count)))
    return outcomes


def test_3000_concurrent_streams_all_complete_with_the_defaults(stack):
    """Before, gRPC core dropped calls past 1000 not yet picked up (CANCELLED, unseen by the
    servicer) and redis-py's pool ran out ('Too many connections', UNAVAILABLE)."""
    outcomes = asyncio.run(_streams(stack.address, NUM_STREAMS))
    assert outcomes == {"complete": NUM_STREAMS}, f"expected every stream to complete: {outcomes}"


def refused_count(stack, gateway: str, limit: str) -> float:
    prefix = f'kvgate_gateway_refused_total{{api="kvgate",limit="{limit}"}} '
    lines = [line for line in scrape(stack, gateway).splitlines() if line.startswith(prefix)]
    return float(lines[0].split()[-1]) if lines else 0.0


def queued_prompt_tokens(stack, gateway: str) -> float:
    prefix = 'kvgate_gateway_prompt_tokens_total{api="kvgate"} '
    lines = [line for line in scrape(stack, gateway).splitlines() if line.startswith(prefix)]
    return float(lines[0].split()[-1]) if lines else 0.0


def refusal(call) -> tuple[grpc.StatusCode, str]:
    """(code, details) of a call expected to fail; `call` starts it."""
    with pytest.raises(grpc.RpcError) as raised:
        list(call())
    return raised.value.code(), raised.value.details()


def test_a_stream_past_max_concurrent_streams_is_refused_at_once_and_counted(stack):
    """At once: while the three streams it waits behind are still open (had it waited for a
    slot, it would have run into its deadline), and before it queued anything (the gateway's
    queued prompt tokens stay 0)."""
    port = free_port()
    stack.start_gateway("gateway-3-streams", port, ["--max-concurrent-streams", "3"])
    address = f"127.0.0.1:{port}"
    held: list[queue.Queue] = []
    with grpc.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        chats = []
        for _ in range(3):  # Chat streams with no turn yet: open, and cheap
            turns: queue.Queue = queue.Queue()
            held.append(turns)
            chats.append(stub.Chat(iter(turns.get, None), timeout=120))
        wait_for(
            lambda: (
                'kvgate_gateway_active_streams{api="kvgate",method="Chat"} 3.0'
                in scrape(stack, "gateway-3-streams")
            ),
            "three open Chat streams",
        )
        request = inference_pb2.GenerateRequest(prompt="Once upon a time")
        code, details = refusal(lambda: stub.Generate(request, timeout=60))
        queued = queued_prompt_tokens(stack, "gateway-3-streams")
        for turns in held:
            turns.put(None)
        for chat in chats:
            list(chat)
        with KvgateClient(address, timeout_s=60.0) as client:
            after = client.generate("Once upon a time", max_tokens=4, temperature=0.0)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, f"{code}: {details}"
    assert "--max-concurrent-streams" in details, details
    assert queued == 0, f"the refused request queued {queued} prompt tokens first"
    assert refused_count(stack, "gateway-3-streams", "max_concurrent_streams") == 1
    assert len(after.token_ids) == 4, "below the limit again, a stream is served"
    assert queued_prompt_tokens(stack, "gateway-3-streams") > 0, "a served request is counted"


def test_a_burst_far_past_max_concurrent_streams_is_served_or_refused_never_dropped(stack):
    """50 streams at once at a gateway that takes 3: each completes or is refused with
    RESOURCE_EXHAUSTED and counted; none ends CANCELLED in gRPC core unseen (it did while the
    core's queue of calls not picked up was sized from the stream limit)."""
    port = free_port()
    stack.start_gateway("gateway-burst", port, ["--max-concurrent-streams", "3"])
    outcomes = asyncio.run(_streams(f"127.0.0.1:{port}", 50))
    refused = sum(n for key, n in outcomes.items() if key.startswith("RESOURCE_EXHAUSTED"))
    assert outcomes["complete"] + refused == 50, outcomes
    assert refused_count(stack, "gateway-burst", "max_concurrent_streams") == refused
    assert outcomes["complete"] >= 3, outcomes


def outcome(call) -> tuple[str, str]:
    """(status code name, details) of a call; `call` runs it to its end."""
    try:
        call()
    except grpc.RpcError as error:
        return error.code().name, error.details()
    return "OK", ""


def test_a_call_past_the_redis_connection_budget_is_refused_naming_it(stack):
    """With a budget of one connection and Redis busy for a second, calls that find the
    connection taken wait 100 ms for it, then are refused by name; none fails otherwise, and
    once Redis is free again the gateway serves."""
    port = free_port()
    stack.start_gateway("gateway-1-connection", port, ["--redis-max-connections", "1"])
    address = f"127.0.0.1:{port}"
    busy = threading.Thread(
        target=lambda: redis.Redis(port=stack.redis_port).eval(BUSY_SCRIPT, 0, 1_000_000)
    )
    request = inference_pb2.GenerateRequest(
        prompt="Once upon a time", params=sampling_params(max_tokens=4)
    )
    with grpc.insecure_channel(address) as channel, ThreadPoolExecutor(6) as pool:
        stub = inference_pb2_grpc.InferenceStub(channel)
        busy.start()
        time.sleep(0.1)  # the script runs: every Redis call waits for it
        calls = [lambda: list(stub.Generate(request, timeout=60))] * 2
        calls += [lambda: stub.GetModelInfo(inference_pb2.GetModelInfoRequest(), timeout=10)] * 4
        outcomes = list(pool.map(outcome, calls))
        busy.join()
        after = outcome(lambda: list(stub.Generate(request, timeout=60)))
    refused = [details for code, details in outcomes if code == "RESOURCE_EXHAUSTED"]
    assert refused, f"expected a refusal while the only connection was busy: {outcomes}"
    assert all("--redis-max-connections" in details for details in refused), refused
    assert {code for code, _ in outcomes} <= {"OK", "RESOURCE_EXHAUSTED"}, outcomes
    assert after == ("OK", ""), f"once Redis is free the gateway must serve: {after}"
    assert refused_count(stack, "gateway-1-connection", "redis_max_connections") == len(refused)


def chunk_times(
    address: str, started: threading.Event, stop: threading.Event, times: list[float]
) -> None:
    """Runs 400-token streams one after another until `stop`, appending each chunk's arrival
    time (a gap across two streams holds the next one's time to first token)."""
    params = sampling_params(max_tokens=400, temperature=0.0, ignore_eos=True)
    with KvgateClient(address, timeout_s=120.0) as client:
        while not stop.is_set():
            for chunk in client.generate_stream("Once upon a time", params):
                if chunk.token_ids:
                    times.append(time.monotonic())
                    started.set()


def huge_refusals(address: str, clients: int) -> list[dict]:
    """Each client's {code, details, seconds}, sending one huge prompt each, at once."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.integration.huge_prompts_client", "--target", address,
         "--chars", str(HUGE_PROMPT_CHARS), "--clients", str(clients)],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    return json.loads(done.stdout)


@dataclass
class Flood:
    """NUM_HUGE_PROMPTS huge prompts sent at once to one server while a stream runs on the
    stack: the slowest refusal, and the stream's gaps between chunks meanwhile."""

    results: list[dict]
    slowest_s: float
    gaps: list[float]

    @property
    def longest_gap_s(self) -> float:
        return max(self.gaps)


def flood(stack, target: str) -> Flood:
    started, stop, times = threading.Event(), threading.Event(), []
    streamer = threading.Thread(target=chunk_times, args=(stack.address, started, stop, times))
    streamer.start()
    try:
        assert started.wait(60), "the running stream produced no token"
        time.sleep(0.2)
        flood_start = time.monotonic()
        results = huge_refusals(target, NUM_HUGE_PROMPTS)
        flood_end = time.monotonic()
    finally:
        stop.set()
        streamer.join()
    gaps = [b - a for a, b in zip(times, times[1:], strict=False) if flood_start <= b <= flood_end]
    assert len(gaps) >= 5, f"the stream must run while the prompts arrive: {len(gaps)} chunks"
    return Flood(results, max(r["seconds"] for r in results), gaps)


@contextlib.contextmanager
def refusing_server():
    """The address of huge_prompts_client's reference server, which refuses unparsed."""
    server = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.huge_prompts_client", "--serve"],
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        yield f"127.0.0.1:{int(server.stdout.readline())}"
    finally:
        server.stdin.close()
        server.wait(30)


def test_huge_prompts_are_refused_unparsed_at_the_pace_of_grpc_alone(stack):
    """20 clients send prompts of 3.9 MB at once, beside a running stream; each is refused
    RESOURCE_EXHAUSTED naming --max-receive-message-bytes and its limit, by its size alone.

    Time is judged against a reference measured in the same run, in turns with the gateway's
    floods (the machine's load changes from second to second): the same 20 prompts sent,
    beside the same running stream, to a bare gRPC server that refuses every call at once,
    unread (huge_prompts_client --serve). Such a flood costs what no gateway can avoid:
    moving 78 MB through gRPC on this machine, now (270 to 680 ms for the slowest of the 20
    on the 2-core development machine at load 7-10, where one prompt alone is refused in 20
    to 90 ms: the acceptance's 100 ms holds for one, not for 20 at once). The gateway's
    median slowest refusal
    may be at most REFUSAL_RATIO times the reference's, and the stream's longest gap at most
    GAP_RATIO times the longest during the reference floods: a ratio of 1.5 failed at load
    10 with nothing wrong (406 against 271 ms), so these bound regressions (a prompt
    tokenized on the event loop took seconds), and cannot tell the gateway of before from
    today's: before, each prompt was parsed, then refused by its length, INVALID_ARGUMENT,
    at 1.3 to 2.0 times the reference's time (load 8). The status and its message tell
    them apart."""
    references, floods = [], []
    with refusing_server() as reference_address:
        for _ in range(FLOOD_ROUNDS):
            references.append(flood(stack, reference_address))
            floods.append(flood(stack, stack.address))
    reference_s = statistics.median(f.slowest_s for f in references)
    slowest_s = statistics.median(f.slowest_s for f in floods)
    reference_gap_s = max(f.longest_gap_s for f in references)
    longest_gap_s = max(f.longest_gap_s for f in floods)
    print(
        f"huge prompts, slowest of {NUM_HUGE_PROMPTS} (median of {FLOOD_ROUNDS} floods): "
        f"gateway {slowest_s * 1000:.1f} ms, bare gRPC {reference_s * 1000:.1f} ms; "
        f"longest gap of the running stream: {longest_gap_s * 1000:.1f} ms, "
        f"{reference_gap_s * 1000:.1f} ms beside the bare server"
    )
    results = [r for f in floods for r in f.results]
    assert {r["code"] for r in results} == {"RESOURCE_EXHAUSTED"}, results[:2]
    details = {r["details"] for r in results}
    assert all(
        d.startswith(f"request message of {HUGE_MESSAGE_BYTES} bytes; the gateway takes")
        and "(--max-receive-message-bytes)" in d
        for d in details
    ), details
    assert slowest_s <= REFUSAL_RATIO * reference_s, (
        f"the gateway's slowest refusal took {slowest_s * 1000:.1f} ms (median), over "
        f"{REFUSAL_RATIO} times the bare gRPC server's {reference_s * 1000:.1f} ms"
    )
    assert longest_gap_s <= GAP_RATIO * reference_gap_s, (
        f"the running stream stood still {longest_gap_s * 1000:.1f} ms while the prompts "
        f"arrived, over {GAP_RATIO} times its longest beside the bare server "
        f"({reference_gap_s * 1000:.1f} ms)"
    )
    assert refused_count(stack, "gateway", "max_receive_message_bytes") == len(results)


def test_a_prompt_over_the_character_budget_is_refused_naming_the_field(stack):
    """Text the model cannot hold, in a message under the receive limit: INVALID_ARGUMENT
    naming the field and the budget, before any tokenizing."""
    budget = ModelText(STORIES_260K).limits.max_prompt_chars
    request = inference_pb2.GenerateRequest(prompt=huge_prompt(budget + 1))
    with grpc.insecure_channel(stack.address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        code, details = refusal(lambda: stub.Generate(request, timeout=60))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, f"{code}: {details}"
    assert details.startswith(f"prompt: {budget + 1} characters; at most {budget} "), details
