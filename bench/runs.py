"""What `kvgate bench` runs: one run, a sweep over request rates, or a sweep over windows."""

from __future__ import annotations

import math
from dataclasses import asdict, replace
from pathlib import Path

from bench import plots
from bench.config import BenchConfig, served_model
from bench.load import arrival_gaps_s, run_jobs
from bench.stats import RequestResult, run_metrics
from bench.workloads import WORDS, GenerateJob, Job, build_jobs, vocab_words


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
    summary["plots"] = [str(plots.latency_cdfs(results, title(summary), config.plot_path("cdf")))]
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
    path = plots.rate_sweep(points, title(points[0], with_rate=False), config.plot_path("rates"))
    return {"sweep": "request_rate", "points": points, "plots": [str(path)]}


def window_sweep(config: BenchConfig) -> dict:
    """One run per --sweep-window value on a local stack, its scheduler restarted each time."""
    from bench.sweeps import local_stack, restart_scheduler, warm_up, window_flags

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
    path = plots.window_sweep(points, title(points[0]), config.plot_path("windows"))
    return {
        "sweep": "batch_window_ms",
        "points": points,
        "plots": [str(path)],
        "log_dir": str(config.log_dir),
    }


def policy_sweep(config: BenchConfig) -> dict:
    """One run per --sweep-policy value on a local stack whose scheduler and executor are
    restarted with `--policy` each time: the same requests (one seed) on an empty cache."""
    from bench.sweeps import local_stack, restart_executor, restart_scheduler, warm_up

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
    results, duration_s = run_jobs(
        target, jobs, gaps_s, config.max_concurrency, config.progress, config.credentials
    )
    summary = {
        "target": target,
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
    from bench.compare_hf import compare_hf, print_comparison

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
