"""What one benchmark request measured, the statistics of a run, and its plots.

Definitions (the ones serving benchmarks use):
- TTFT: from sending the request to receiving its first token.
- ITL: every gap between two consecutive tokens. A chunk that brings n tokens after a
  gap g counts as n gaps of g / n (and the tokens after the first in the first chunk as
  gaps of 0), so the ITLs of a request sum to its latency minus its TTFT. An OpenAI stream's
  events do not say how many tokens they carry: each event with text is one gap there.
- TPOT: (latency - TTFT) / (output tokens - 1); undefined for one output token.
- E2E: from sending the request to its last chunk.
- goodput: requests per second that finished and met every SLO.

Plots are PNG files (matplotlib's Agg backend, no display needed; imported when one is drawn).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from protos.kvgate.v1 import inference_pb2, inference_pb2_grpc

# Finish reasons of a request that did not run to max_tokens.
FAILED = (inference_pb2.FINISH_REASON_ERROR, inference_pb2.FINISH_REASON_ABORT)
# The same, as OpenAI streams name them (vLLM's names).
OPENAI_FAILED = ("abort", "error")
PERCENTILES = (50, 90, 99)
# SLO names accepted by --slo, each a bound in milliseconds on one per-request value.
SLO_NAMES = ("ttft_ms", "tpot_ms", "e2e_ms")


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it; times in seconds."""

    prompt_tokens: int = 0  # as the gateway counted them (Usage.prompt_tokens)
    output_tokens: int = 0  # token ids received
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""  # empty: the request finished
    cached_prompt_tokens: int = 0  # prompt tokens served from the executor's prefix/session cache

    @property
    def ok(self) -> bool:
        return not self.error and self.output_tokens > 0

    @property
    def tpot_s(self) -> float | None:
        """(latency - TTFT) / (output tokens - 1); None with fewer than two output tokens."""
        if self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


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


def generate_ttft_ms(
    stub: inference_pb2_grpc.InferenceStub,
    request: inference_pb2.GenerateRequest,
    metadata: tuple[tuple[str, str], ...] = (),
) -> float:
    """TTFT in ms of one Generate call, as its client sees it (then read to its end)."""
    start = time.perf_counter()
    chunks = stub.Generate(request, timeout=600, metadata=metadata)
    next(c for c in chunks if c.token_ids)
    ttft = 1000 * (time.perf_counter() - start)
    list(chunks)
    return ttft


def time_sse(events: Iterator[dict], sent_s: float) -> RequestResult:
    """Reads an OpenAI stream's events (completions or chat) and times its text.

    The events do not say how many tokens each carries: as vLLM's serving benchmark does,
    every event with text is one arrival (TTFT to the first, an ITL gap before each later
    one), and the token counts come from the usage event (stream_options.include_usage).

    Args:
        events: the stream's JSON events (sse_payloads), already sent.
        sent_s: time.perf_counter() when the request was sent.

    Returns:
        The request's result (error set for an error event, an abort or error finish
        reason, or a stream that ended without a finish reason).
    """
    result = RequestResult()
    last_s = sent_s
    arrivals = 0
    reason = None
    for event in events:
        now_s = time.perf_counter()
        if "error" in event:
            result.error = event["error"].get("message", "an error event")
        for choice in event.get("choices", []):
            text = choice["delta"].get("content") if "delta" in choice else choice["text"]
            if text and arrivals == 0:
                result.ttft_s = now_s - sent_s
            elif text:
                result.itl_s.append(now_s - last_s)
            arrivals, last_s = (arrivals + 1, now_s) if text else (arrivals, last_s)
            if choice["finish_reason"]:
                reason, result.e2e_s = choice["finish_reason"], now_s - sent_s
        if event.get("usage"):
            usage = event["usage"]
            result.prompt_tokens = usage["prompt_tokens"]
            result.output_tokens = usage["completion_tokens"]
            details = usage.get("prompt_tokens_details") or {}
            result.cached_prompt_tokens = details.get("cached_tokens", 0)
    if reason in OPENAI_FAILED and not result.error:
        result.error = f"finish_reason {reason}"
    if reason is None and not result.error:
        result.error = "the stream ended without a finish reason"
    return result


def sse_payloads(lines: Iterable[str]) -> Iterator[dict]:
    """The JSON objects of a server-sent event stream's `data:` lines, up to `[DONE]`."""
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            return
        yield json.loads(data)


def summarize_ms(values_s: list[float]) -> dict[str, float | None]:
    """Mean and percentiles (linear interpolation, as numpy) of seconds, in milliseconds.

    Args:
        values_s: the samples in seconds; may be empty.

    Returns:
        {"mean", "p50", "p90", "p99"} in milliseconds; None each when there is no sample.
    """
    if not values_s:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    values_ms = 1000.0 * np.asarray(values_s, dtype=float)
    summary = {"mean": float(values_ms.mean())}
    for p in PERCENTILES:
        summary[f"p{p}"] = float(np.percentile(values_ms, p))
    return summary


def slo_values_ms(result: RequestResult) -> dict[str, float | None]:
    """The request's values that SLOs bound, in milliseconds (None: not defined)."""
    tpot_s = result.tpot_s
    return {
        "ttft_ms": 1000.0 * result.ttft_s,
        "tpot_ms": None if tpot_s is None else 1000.0 * tpot_s,
        "e2e_ms": 1000.0 * result.e2e_s,
    }


def meets_slos(result: RequestResult, slos_ms: dict[str, float]) -> bool:
    """Whether a finished request is within every SLO (an undefined value, like the TPOT
    of a one-token output, meets its SLO)."""
    if not result.ok:
        return False
    values = slo_values_ms(result)
    return all(values[name] is None or values[name] <= bound for name, bound in slos_ms.items())


def run_metrics(
    results: list[RequestResult], duration_s: float, slos_ms: dict[str, float]
) -> dict[str, object]:
    """The statistics of one run.

    Args:
        results: every request of the run, failed ones included.
        duration_s: wall time from the first request sent to the last one finished.
        slos_ms: SLO name (SLO_NAMES) to bound in milliseconds; empty: goodput counts
            every finished request.

    Returns:
        ttft_ms, tpot_ms, itl_ms, e2e_ms summaries, counts, throughputs per second, and the
        prefix cache hit rate (cached prompt tokens / prompt tokens of finished requests).
    """
    done = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = sum(r.prompt_tokens for r in done)
    cached_tokens = sum(r.cached_prompt_tokens for r in done)
    good = sum(meets_slos(r, slos_ms) for r in done)
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration_s,
        "total_prompt_tokens": prompt_tokens,
        "total_cached_prompt_tokens": cached_tokens,
        "prefix_cache_hit_rate": cached_tokens / prompt_tokens if prompt_tokens else 0.0,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration_s,
        "output_token_throughput": output_tokens / duration_s,
        "goodput": good / duration_s,
        "slo": slos_ms,
        "ttft_ms": summarize_ms([r.ttft_s for r in done]),
        "tpot_ms": summarize_ms([r.tpot_s for r in done if r.tpot_s is not None]),
        "itl_ms": summarize_ms([gap for r in done for gap in r.itl_s]),
        "e2e_ms": summarize_ms([r.e2e_s for r in done]),
    }


def parse_slos(specs: list[str]) -> dict[str, float]:
    """Parses --slo NAME=MS flags.

    Args:
        specs: strings like "ttft_ms=200".

    Returns:
        SLO name to bound in milliseconds.

    Raises:
        ValueError: naming the flag for an unknown name or a bound that is not a positive number.
    """
    slos = {}
    for spec in specs:
        name, _, bound = spec.partition("=")
        if name not in SLO_NAMES:
            raise ValueError(f"--slo must be one of {', '.join(SLO_NAMES)}=MS, got {spec!r}")
        try:
            slos[name] = float(bound)
        except ValueError:
            raise ValueError(f"--slo {name} needs a number of milliseconds, got {spec!r}") from None
        if not slos[name] > 0:
            raise ValueError(f"--slo {name} must be > 0 ms, got {spec!r}")
    return slos


def paired_median_ms(
    a_ms: list[float], b_ms: list[float], resamples: int = 2000
) -> dict[str, float]:
    """The median of the paired differences a - b, with its 95% bootstrap interval (the
    pairs resampled `resamples` times, seeded): how finely one run resolves the difference."""
    diffs = np.asarray(a_ms) - np.asarray(b_ms)
    rng = np.random.default_rng(0)
    medians = np.median(rng.choice(diffs, size=(resamples, len(diffs))), axis=1)
    low, high = np.quantile(medians, [0.025, 0.975])
    return {"median": float(np.median(diffs)), "ci95_low": float(low), "ci95_high": float(high)}


DPI = 80


def _pyplot():
    """matplotlib's pyplot on the Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def latency_cdfs(results: list[RequestResult], title: str, path: Path) -> Path:
    """Plots the CDFs of TTFT, TPOT, ITL and end-to-end latency of the finished requests.

    Args:
        results: the run's requests (failed ones are left out).
        title: the figure's title (the workload).
        path: where the PNG goes.

    Returns:
        path.
    """
    done = [r for r in results if r.ok]
    series = {
        "TTFT": [r.ttft_s for r in done],
        "TPOT": [r.tpot_s for r in done if r.tpot_s is not None],
        "ITL": [gap for r in done for gap in r.itl_s],
        "end-to-end": [r.e2e_s for r in done],
    }
    plt = _pyplot()
    figure, axes = plt.subplots(1, 4, figsize=(14, 3.2))
    for axis, (name, values_s) in zip(axes, series.items(), strict=True):
        values_ms = np.sort(1000.0 * np.asarray(values_s, dtype=float))
        fractions = np.arange(1, len(values_ms) + 1) / max(len(values_ms), 1)
        axis.step(values_ms, fractions, where="post")
        axis.set_xlabel(f"{name} (ms)")
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests (ITL: of gaps)")
    return _save(figure, title, path)


def rate_sweep(points: list[dict], title: str, path: Path) -> Path:
    """Plots output token throughput and p99 TTFT against the request rate.

    Args:
        points: one run's results per rate, each with "request_rate".
        title: the figure's title.
        path: where the PNG goes.

    Returns:
        path.
    """
    labels = [_rate_label(p["request_rate"]) for p in points]
    throughput = [p["output_token_throughput"] for p in points]
    ttft_p99 = [p["ttft_ms"]["p99"] for p in points]
    figure = _two_panels(labels, "request rate (req/s)", throughput, ttft_p99, "TTFT p99 (ms)")
    return _save(figure, title, path)


def window_sweep(points: list[dict], title: str, path: Path) -> Path:
    """Plots output token throughput and p50/p99 TTFT against batch_window_ms.

    Args:
        points: one run's results per window, each with "batch_window_ms".
        title: the figure's title.
        path: where the PNG goes.

    Returns:
        path.
    """
    labels = [f"{p['batch_window_ms']:g}" for p in points]
    throughput = [p["output_token_throughput"] for p in points]
    ttft_p50 = [p["ttft_ms"]["p50"] for p in points]
    figure = _two_panels(labels, "batch_window_ms", throughput, ttft_p50, "TTFT p50 (ms)")
    return _save(figure, title, path)


def scaling_timeline(result: dict, path: Path) -> Path:
    """Plots `kvgate bench scaling executors`: executors, the signal and the queue, TTFT p90."""
    samples = result["samples"]
    t = [s["t_s"] for s in samples]
    plt = _pyplot()
    figure, (fleet, load, ttft) = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    fleet.step(t, [s["replicas"] for s in samples], where="post", label="executors serving")
    fleet.step(t, [s["desired"] for s in samples], where="post", linestyle="--",
               label="executors asked for")  # fmt: skip
    fleet.step(t, [s["draining"] for s in samples], where="post", label="executors draining")
    fleet.set_ylabel("executors")
    threshold = result["rule"]["threshold"]
    load.plot(t, [s["signal"] for s in samples], label="signal: queued + waiting + running")
    load.plot(t, [s["queue"] for s in samples], label="queue: queued + waiting")
    load.axhline(
        threshold, color="grey", linestyle=":", label=f"threshold per executor ({threshold:g})"
    )
    load.set_ylabel("requests")
    windows = [w for w in result["ttft_p90"] if w["ttft_p90_ms"] is not None]
    ttft.plot([w["t_s"] for w in windows], [w["ttft_p90_ms"] for w in windows], marker="o",
              label="TTFT p90 by arrival window")  # fmt: skip
    ttft.set_ylabel("ms")
    ttft.set_xlabel("seconds since the load started")
    for axes in (fleet, load, ttft):
        axes.legend(fontsize=8, loc="upper right")
        axes.grid(alpha=0.3)
    requests = result["requests"]
    title = (
        f"executors scaled on the ScaledObject's query: {requests['sent']} requests sent, "
        f"{requests['finished']} finished whole, {requests['failed']} failed"
    )
    return _save(figure, title, path)


def _two_panels(
    labels: list[str], x_label: str, throughput: list[float], ttft: list[float], ttft_label: str
) -> object:
    """Throughput and a TTFT statistic against evenly spaced x labels (inf has no position
    on a numeric axis)."""
    plt = _pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2))
    positions = range(len(labels))
    for axis, values, y_label in ((left, throughput, "output tokens/s"), (right, ttft, ttft_label)):
        axis.plot(positions, values, marker="o")
        axis.set_xticks(list(positions), labels)
        axis.set_xlabel(x_label)
        axis.set_ylabel(y_label)
        axis.grid(alpha=0.3)
    return figure


def _rate_label(rate: float | str) -> str:
    """A rate as the results JSON holds it: a number, or "inf"."""
    return rate if isinstance(rate, str) else f"{rate:g}"


def _save(figure, title: str, path: Path) -> Path:
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=DPI)
    _pyplot().close(figure)
    return path
