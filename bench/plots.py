"""PNG plots of benchmark results (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from bench.stats import RequestResult  # noqa: E402

DPI = 80


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
    """Plots bench/scaler.py's run: executors, the scaling signal and the queue, TTFT p90."""
    samples = result["samples"]
    t = [s["t_s"] for s in samples]
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
) -> plt.Figure:
    """Throughput and a TTFT statistic against evenly spaced x labels (inf has no position
    on a numeric axis)."""
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
    plt.close(figure)
    return path
