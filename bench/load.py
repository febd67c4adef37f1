"""The load generator: sends jobs at gamma-distributed arrival times and times every token.

Arrivals follow the serving benchmarks' convention: gaps between jobs are gamma distributed
with shape = burstiness and mean = 1 / request_rate, so burstiness 1 is a Poisson process,
below 1 is burstier and above 1 more regular; a rate of inf sends every job at once. With
max_concurrency C at most C jobs run at a time and later arrivals wait for a free slot;
their times are measured from when they are sent, not from their arrival.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
from tqdm import tqdm

from bench.stats import RequestResult
from bench.workloads import ChatJob, GenerateJob, Job, num_requests
from client.api import Credentials, KvgateClient, sampling_params
from protos.kvgate.v1 import inference_pb2

# Finish reasons of a request that did not run to max_tokens.
FAILED = (inference_pb2.FINISH_REASON_ERROR, inference_pb2.FINISH_REASON_ABORT)
# Deadline of each call, in seconds.
CALL_TIMEOUT_S = 600.0


def arrival_gaps_s(
    count: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """Gaps before each of `count` arrivals (the first is 0).

    Args:
        count: number of arrivals.
        request_rate: mean arrivals per second; inf: all at once.
        burstiness: the gamma shape; 1: Poisson.
        seed: the generator's seed; the same seed gives the same gaps.

    Returns:
        `count` gaps in seconds.
    """
    if count == 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * count
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=count - 1)
    return [0.0, *gaps.tolist()]


def request_params(output_len: int) -> inference_pb2.SamplingParams:
    """Greedy, exactly `output_len` tokens."""
    return sampling_params(max_tokens=output_len, temperature=0.0, ignore_eos=True)


def time_stream(chunks: Iterator[inference_pb2.GenerateResponse], sent_s: float) -> RequestResult:
    """Reads a completion's chunks and times each token.

    Args:
        chunks: the stream, already sent.
        sent_s: time.perf_counter() when the request was sent.

    Returns:
        The request's result (error set when the stream ended in an error, or ended without
        a finish reason: a cut stream is a failure, not a request that finished).
    """
    result = RequestResult()
    last_s = sent_s
    finished = False
    for chunk in chunks:
        now_s = time.perf_counter()
        count = len(chunk.token_ids)
        if count and result.output_tokens == 0:
            result.ttft_s = now_s - sent_s
            result.itl_s.extend([0.0] * (count - 1))
        elif count:
            result.itl_s.extend([(now_s - last_s) / count] * count)
        result.output_tokens += count
        last_s = now_s if count else last_s
        if chunk.finish_reason:
            result.e2e_s = now_s - sent_s
            result.prompt_tokens = chunk.usage.prompt_tokens
            result.cached_prompt_tokens = chunk.usage.cached_prompt_tokens
            if chunk.finish_reason in FAILED:
                name = inference_pb2.FinishReason.Name(chunk.finish_reason)
                result.error = chunk.error_message or name
            finished = True
    if not finished:
        result.error = "the stream ended without a finish reason"
    return result


def run_generate(client: KvgateClient, job: GenerateJob) -> list[RequestResult]:
    sent_s = time.perf_counter()
    try:
        chunks = client.generate_stream(job.prompt, request_params(job.output_len))
        return [time_stream(chunks, sent_s)]
    except grpc.RpcError as error:
        return [RequestResult(error=f"{error.code().name}: {error.details()}")]


def run_chat(client: KvgateClient, job: ChatJob) -> list[RequestResult]:
    """Runs the session's turns one after the other; a failed turn ends the session."""
    session = client.chat()
    results = []
    try:
        for content, output_len in zip(job.turns, job.output_lens, strict=True):
            sent_s = time.perf_counter()
            replies = session.send(content, request_params(output_len))
            results.append(time_stream((reply.chunk for reply in replies), sent_s))
            if results[-1].error:
                break
    except grpc.RpcError as error:
        results.append(RequestResult(error=f"{error.code().name}: {error.details()}"))
    finally:
        session.close()
    end_session(client, session.session_id)
    missing = len(job.turns) - len(results)
    return results + [RequestResult(error="not sent: an earlier turn failed")] * missing


def end_session(client: KvgateClient, session_id: str) -> None:
    """Frees the session's KV cache now; when the gateway cannot be reached, its TTL will."""
    if not session_id:
        return
    try:
        client.end_session(session_id)
    except grpc.RpcError as error:
        print(f"kvgate bench: EndSession failed: {error.code().name}", file=sys.stderr)


def run_jobs(
    target: str,
    jobs: list[Job],
    gaps_s: list[float],
    max_concurrency: int | None = None,
    progress: bool = True,
    credentials: Credentials = Credentials(),  # noqa: B008 (frozen)
) -> tuple[list[RequestResult], float]:
    """Sends the jobs at their arrival times and waits for all of them.

    Args:
        target: the gateway's HOST:PORT.
        jobs: what to send, in arrival order.
        gaps_s: the gap before each job (arrival_gaps_s).
        max_concurrency: most jobs in flight at once; None: no limit.
        progress: show a progress bar of finished requests on stderr.
        credentials: the API key and TLS files the client presents.

    Returns:
        Every request's result, and the seconds from the first send to the last finish.
    """
    total = sum(num_requests(job) for job in jobs)
    bar = tqdm(total=total, desc="requests", unit="req", file=sys.stderr, disable=not progress)
    lock = threading.Lock()
    with credentials.client(target, timeout_s=CALL_TIMEOUT_S) as client:

        def run_one(job: Job) -> list[RequestResult]:
            runner = run_chat if isinstance(job, ChatJob) else run_generate
            results = runner(client, job)
            with lock:
                bar.update(len(results))
            return results

        start_s = time.perf_counter()
        with ThreadPoolExecutor(max_concurrency or len(jobs)) as pool:
            futures = []
            for job, arrival_s in zip(jobs, np.cumsum(gaps_s), strict=True):
                time.sleep(max(0.0, start_s + arrival_s - time.perf_counter()))
                futures.append(pool.submit(run_one, job))
            results = [result for future in futures for result in future.result()]
        duration_s = time.perf_counter() - start_s
    bar.close()
    return results, duration_s
