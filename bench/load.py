"""`kvgate bench load`: load a running gateway and report TTFT, TPOT, ITL, latency and goodput.

    kvgate bench load --target 127.0.0.1:50051 --num-requests 100 --request-rate 4 --out run.json
    kvgate bench load --workload shared-prefix --num-prefixes 4 --prefix-len 96 --input-len 32
    kvgate bench load --workload chat --num-turns 3 --input-len 32 --output-len 32
    kvgate bench load --sweep-rates 1,2,4,inf      (one run per rate, plotted)
    kvgate bench load --sweep-window 0,5,20,100    (starts its own stack on --model)
    kvgate bench load --sweep-policy fcfs,lpm      (its own stack per ordering policy)
    kvgate bench load --compare-hf                 (the same requests through transformers)

Writes PNG plots next to --out (OUT_cdf.png, OUT_rates.png, OUT_windows.png) and prints a
summary.

Arrivals follow the serving benchmarks' convention: gaps between jobs are gamma distributed
with shape = burstiness and mean = 1 / request_rate, so burstiness 1 is a Poisson process,
below 1 is burstier and above 1 more regular; a rate of inf sends every job at once. With
max_concurrency C at most C jobs run at a time and later arrivals wait for a free slot;
their times are measured from when they are sent, not from their arrival.

The sweeps' own local stack: `--sweep-window` and `--sweep-policy` must restart processes, so
they start a stack of their own (deploy/stack.py, as `make run` does: redis, scheduler, one
executor, one gateway on a free port) on --model, instead of using --target; the scheduler is
restarted per batch_window_ms, or the scheduler and the executor per ordering policy. In the
window sweep executor and gateway stay up between windows, so each window's run also keeps the
executor's prefix cache: the bench gives every sweep point its own seed (seed + index), so no
point's prompts were cached by an earlier one. The policy sweep restarts the executor with each
policy, so every policy runs the same requests on an empty cache.
"""

from __future__ import annotations

import argparse
import math
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path

import grpc
import httpx
import numpy as np
from tqdm import tqdm

from bench import stats
from bench.harness import BenchFailure, Benchmark
from bench.stats import RequestResult, run_metrics, sse_payloads, time_sse, time_stream
from bench.workloads import (
    WORDS,
    BenchConfig,
    ChatJob,
    GenerateJob,
    Job,
    add_arguments,
    build_jobs,
    check_inputs,
    config_from_args,
    num_requests,
    openai_body,
    served_model,
    vocab_words,
)
from client.api import Credentials, KvgateClient, sampling_params
from deploy.stack import ROOT, Stack, StackConfig, free_port
from protos.kvgate.v1 import inference_pb2

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
    openai_url: str = "",
) -> tuple[list[RequestResult], float]:
    """Sends the jobs at their arrival times and waits for all of them.

    Args:
        target: the gateway's HOST:PORT.
        jobs: what to send, in arrival order.
        gaps_s: the gap before each job (arrival_gaps_s).
        max_concurrency: most jobs in flight at once; None: no limit.
        progress: show a progress bar of finished requests on stderr.
        credentials: the API key and TLS files the client presents.
        openai_url: the gateway's OpenAI base URL; set: the jobs go there, not to `target`.

    Returns:
        Every request's result, and the seconds from the first send to the last finish.
    """
    total = sum(num_requests(job) for job in jobs)
    bar = tqdm(total=total, desc="requests", unit="req", file=sys.stderr, disable=not progress)
    lock = threading.Lock()
    concurrency = max_concurrency or len(jobs)
    if openai_url:
        opened = openai_front(openai_url, credentials, concurrency)
    else:
        opened = credentials.client(target, timeout_s=CALL_TIMEOUT_S)
    with opened as client:

        def run_one(job: Job) -> list[RequestResult]:
            results = job_runner(job, bool(openai_url))(client, job)
            with lock:
                bar.update(len(results))
            return results

        start_s = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            futures = []
            for job, arrival_s in zip(jobs, np.cumsum(gaps_s), strict=True):
                time.sleep(max(0.0, start_s + arrival_s - time.perf_counter()))
                futures.append(pool.submit(run_one, job))
            results = [result for future in futures for result in future.result()]
        duration_s = time.perf_counter() - start_s
    bar.close()
    return results, duration_s


def job_runner(job: Job, openai: bool) -> Callable[..., list[RequestResult]]:
    if openai:
        return run_openai_chat if isinstance(job, ChatJob) else run_openai_generate
    return run_chat if isinstance(job, ChatJob) else run_generate


class OpenAIFront(httpx.Client):
    """A client of the HTTP front (one connection pool shared by the jobs' threads) and the
    model id its requests name."""

    model_id: str = ""


@contextmanager
def openai_front(url: str, credentials: Credentials, connections: int) -> Iterator[OpenAIFront]:
    """The HTTP front at `url`, its model id asked. Raises: httpx.HTTPError when it lists none."""
    headers = {"Authorization": f"Bearer {credentials.api_key}"} if credentials.api_key else {}
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    with OpenAIFront(base_url=url, headers=headers, limits=limits, timeout=CALL_TIMEOUT_S) as front:
        front.model_id = front.get("/models").raise_for_status().json()["data"][0]["id"]
        yield front


def post_stream(front: OpenAIFront, path: str, body: dict) -> tuple[RequestResult, str]:
    """Sends one streaming request. Returns: its result, and the text it streamed."""
    texts: list[str] = []

    def keeping_text(events: Iterator[dict]) -> Iterator[dict]:
        for event in events:
            for choice in event.get("choices", []):
                texts.append(
                    choice["delta"].get("content") or "" if "delta" in choice else choice["text"]
                )
            yield event

    sent_s = time.perf_counter()
    try:
        with front.stream("POST", path, json=body) as answer:
            if answer.status_code != 200:
                answer.read()
                return RequestResult(error=f"HTTP {answer.status_code}: {answer.text}"), ""
            result = time_sse(keeping_text(sse_payloads(answer.iter_lines())), sent_s)
    except httpx.HTTPError as error:
        return RequestResult(error=f"{type(error).__name__}: {error}"), ""
    return result, "".join(texts)


def run_openai_generate(front: OpenAIFront, job: GenerateJob) -> list[RequestResult]:
    body = openai_body(front.model_id, job.output_len, prompt=job.prompt)
    return [post_stream(front, "/completions", body)[0]]


def run_openai_chat(front: OpenAIFront, job: ChatJob) -> list[RequestResult]:
    """The session's turns as one growing conversation; a failed turn ends the session."""
    messages: list[dict[str, str]] = []
    results = []
    for content, output_len in zip(job.turns, job.output_lens, strict=True):
        messages.append({"role": "user", "content": content})
        body = openai_body(front.model_id, output_len, messages=messages)
        result, reply = post_stream(front, "/chat/completions", body)
        results.append(result)
        if result.error:
            break
        messages.append({"role": "assistant", "content": reply})
    missing = len(job.turns) - len(results)
    return results + [RequestResult(error="not sent: an earlier turn failed")] * missing


def run_bench(config: BenchConfig) -> dict:
    """Runs what the flags ask, writes the plots and prints a summary.

    Args:
        config: the validated flags.

    Returns:
        The results to write as JSON.
    """
    if config.sweep_windows_ms:
        return window_sweep(config)
    if config.sweep_policies:
        return policy_sweep(config)
    if config.sweep_rates:
        return rate_sweep(config)
    return single_run(config)


def single_run(config: BenchConfig) -> dict:
    jobs, results, summary = run_point(
        config, config.target, config.request_rate, config.workload.seed
    )
    print_summary(summary)
    summary["plots"] = [str(stats.latency_cdfs(results, title(summary), config.plot_path("cdf")))]
    if config.compare_hf:
        summary["compare_hf"] = compare_with_hf(config, jobs, summary)
    return summary


def rate_sweep(config: BenchConfig) -> dict:
    """One run per --sweep-rates value; run i uses seed + i, so its prompts are not cached."""
    points = []
    for index, rate in enumerate(config.sweep_rates):
        _, _, summary = run_point(config, config.target, rate, config.workload.seed + index)
        print_summary(summary)
        points.append(summary)
    path = stats.rate_sweep(points, title(points[0], with_rate=False), config.plot_path("rates"))
    return {"sweep": "request_rate", "points": points, "plots": [str(path)]}


def window_sweep(config: BenchConfig) -> dict:
    """One run per --sweep-window value on a local stack, its scheduler restarted each time."""

    windows = config.sweep_windows_ms
    points = []
    model = served_model(config)
    flags = window_flags(windows[0])
    with local_stack(model, config.log_dir, flags, config.executor_flags) as stack:
        for index, window_ms in enumerate(windows):
            if index:
                restart_scheduler(stack, window_flags(window_ms))
            warm_up(stack.address)
            seed = config.workload.seed + index
            _, _, summary = run_point(config, stack.address, config.request_rate, seed)
            summary["batch_window_ms"] = window_ms
            print_summary(summary)
            points.append(summary)
    path = stats.window_sweep(points, title(points[0]), config.plot_path("windows"))
    return {
        "sweep": "batch_window_ms",
        "points": points,
        "plots": [str(path)],
        "log_dir": str(config.log_dir),
    }


def policy_sweep(config: BenchConfig) -> dict:
    """One run per --sweep-policy value on a local stack whose scheduler and executor are
    restarted with `--policy` each time: the same requests (one seed) on an empty cache."""

    def scheduler_flags(policy: str) -> list[str]:
        return ["--policy", policy]

    def executor_flags(policy: str) -> list[str]:
        return [*config.executor_flags, "--policy", policy]

    points = []
    first = config.sweep_policies[0]
    model = served_model(config)
    with local_stack(model, config.log_dir, scheduler_flags(first), executor_flags(first)) as stack:
        for index, policy in enumerate(config.sweep_policies):
            if index:
                restart_scheduler(stack, scheduler_flags(policy))
                restart_executor(stack, executor_flags(policy))
            warm_up(stack.address)
            _, _, summary = run_point(
                config, stack.address, config.request_rate, config.workload.seed
            )
            summary["policy"] = policy
            summary["executor_flags"] = config.executor_flags
            print_summary(summary)
            points.append(summary)
    return {"sweep": "policy", "points": points, "log_dir": str(config.log_dir)}


def run_point(
    config: BenchConfig, target: str, request_rate: float, seed: int
) -> tuple[list[Job], list[RequestResult], dict]:
    """Builds the workload with `seed`, sends it at `request_rate` and measures it.

    Returns:
        The jobs, every request's result, and the run's summary (statistics and parameters).
    """
    workload = replace(config.workload, seed=seed)
    words = WORDS if config.prompt_words == "english" else vocab_words(Path(served_model(config)))
    with config.credentials.client(target, timeout_s=60.0) as client:
        model_id = client.model_info().model_id
        jobs = build_jobs(workload, lambda text: len(client.tokenize(text, True)), words)
    gaps_s = arrival_gaps_s(len(jobs), request_rate, config.burstiness, seed)
    openai_url = config.openai_url if config.api == "openai" else ""
    results, duration_s = run_jobs(
        target, jobs, gaps_s, config.max_concurrency, config.progress, config.credentials,
        openai_url,
    )  # fmt: skip
    summary = {
        "target": openai_url or target,
        "api": config.api,
        "model_id": model_id,
        "request_rate": "inf" if math.isinf(request_rate) else request_rate,
        "burstiness": config.burstiness,
        "max_concurrency": config.max_concurrency,
        "workload": asdict(workload),
        "prompt_words": config.prompt_words,
        **run_metrics(results, duration_s, config.slos_ms),
        "first_error": next((r.error for r in results if r.error), ""),
    }
    return jobs, results, summary


def compare_with_hf(config: BenchConfig, jobs: list[Job], summary: dict) -> dict:
    """Runs the run's requests through transformers and prints kvgate's ratios."""
    from bench.engine import compare_hf, print_comparison  # torch and transformers: only here

    model_dir = Path(
        served_model(config)
    )  # the model --target serves: checked by bench.cli.check_inputs
    generate_jobs = [job for job in jobs if isinstance(job, GenerateJob)]
    with config.credentials.client(config.target, timeout_s=60.0) as client:
        prompts = [client.tokenize(job.prompt, True) for job in generate_jobs]
    output_lens = [job.output_len for job in generate_jobs]
    if summary["request_rate"] != "inf":
        print("note: at a finite request rate kvgate's throughput is bounded by the arrivals")
    comparison = compare_hf(
        model_dir, prompts, output_lens, summary["output_token_throughput"], config.hf_sample
    )
    print_comparison(comparison)
    return comparison


def title(summary: dict, with_rate: bool = True) -> str:
    workload = summary["workload"]
    rate = f", rate {summary['request_rate']} req/s" if with_rate else ""
    return (
        f"kvgate bench: {summary['model_id']}, {workload['workload']}, "
        f"{workload['num_requests']} requests, in {workload['input_len']} / "
        f"out {workload['output_len']} tokens{rate}"
    )


def print_summary(summary: dict) -> None:
    """Prints one run's statistics as a table."""
    rate = summary["request_rate"]
    window = summary.get("batch_window_ms")
    policy = summary.get("policy")
    print(
        f"\n== rate {rate} req/s"
        + ("" if window is None else f", window {window:g} ms")
        + ("" if policy is None else f", policy {policy}")
    )
    print(
        f"completed {summary['completed']}, failed {summary['failed']} "
        f"in {summary['duration_s']:.2f} s"
    )
    if summary["first_error"]:
        print(f"first error: {summary['first_error']}")
    print(f"request throughput  {summary['request_throughput']:.2f} req/s")
    print(f"output throughput   {summary['output_token_throughput']:.1f} tokens/s")
    print(f"goodput             {summary['goodput']:.2f} req/s  (SLOs: {summary['slo'] or 'none'})")
    print(f"prefix cache hits   {summary['prefix_cache_hit_rate']:.1%} of prompt tokens")
    print(f"{'ms':8}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        row = summary[name]
        cells = "".join(f"{'-' if row[k] is None else f'{row[k]:.2f}':>10}" for k in row)
        print(f"{name.removesuffix('_ms'):8}{cells}")


LOG_DIR = ROOT / ".run" / "bench-logs"
SCHEDULER = "scheduler"
EXECUTOR = "executor-0"


def window_flags(batch_window_ms: float) -> list[str]:
    return ["--batch-window-ms", f"{batch_window_ms:g}"]


@contextmanager
def local_stack(
    model: str,
    log_dir: Path = LOG_DIR,
    scheduler_flags: list[str] | None = None,
    executor_flags: list[str] | None = None,
) -> Iterator[Stack]:
    """Starts redis, a scheduler, one executor and a gateway; stops them all on exit.

    Args:
        model: the model folder.
        log_dir: where the processes log.
        scheduler_flags, executor_flags: the first scheduler's and executor's own flags.

    Yields:
        The serving stack (its gateway at stack.address).
    """
    config = StackConfig(
        model=model,
        port=free_port(),
        log_dir=log_dir,
        scheduler_flags=list(scheduler_flags or []),
        executor_flags=list(executor_flags or []),
    )
    stack = Stack(config)
    print(f"kvgate bench: starting a local stack on {model} (logs in {log_dir})", file=sys.stderr)
    try:
        stack.start_all()
        yield stack
    finally:
        stack.stop_all()


def restart_scheduler(stack: Stack, flags: list[str]) -> None:
    """Stops the scheduler and starts one with `flags` (returns once it holds the lock)."""
    stack.stop(SCHEDULER)
    stack.config.scheduler_flags = list(flags)
    stack.start_scheduler(SCHEDULER)


def restart_executor(stack: Stack, flags: list[str]) -> None:
    """Stops the executor (its cache goes with it) and starts one with `flags`; returns once
    it has sent a heartbeat."""
    stack.stop(EXECUTOR)
    stack.redis().delete(stack.keys.executor_status(EXECUTOR))
    stack.config.executor_flags = list(flags)
    stack.start_executor(EXECUTOR)


def warm_up(target: str) -> None:
    """Sends one short request and waits for it: the stack serves, its first forward pass
    is not measured."""
    with KvgateClient(target, timeout_s=120.0) as client:
        client.generate("warm up", max_tokens=2, temperature=0.0)


def run(args: argparse.Namespace) -> dict:
    """Runs `kvgate bench load`. Raises: BenchFailure on a bad flag or a failed gateway call
    outside the measured requests."""
    try:
        config = config_from_args(args)
        check_inputs(config)
    except ValueError as error:
        raise BenchFailure(str(error)) from None
    except grpc.RpcError as error:
        raise BenchFailure(rpc_failure(args, error)) from None
    try:
        return run_bench(config)
    except grpc.RpcError as error:
        raise BenchFailure(rpc_failure(args, error)) from None
    except httpx.HTTPError as error:
        raise BenchFailure(f"cannot list --openai-url {args.openai_url}'s model: {error}") from None


def rpc_failure(args: argparse.Namespace, error: grpc.RpcError) -> str:
    """The one-line message of a gateway call outside the measured requests (model info,
    tokenize), whose failure stops the bench."""
    status = f"{error.code().name}: {error.details()}"
    if args.sweep_windows_ms or args.sweep_policies:
        return f"the local stack's gateway failed: {status}"
    if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return f"cannot reach --target {args.target}: {status}"
    return f"--target {args.target} failed a call: {status}"


BENCHMARKS = {"load": Benchmark(add_arguments, run, out="bench.json")}
