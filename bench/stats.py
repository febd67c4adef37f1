"""What one benchmark request measured, and the statistics of a run.

Definitions (the ones serving benchmarks use):
- TTFT: from sending the request to receiving its first token.
- ITL: every gap between two consecutive tokens. A chunk that brings n tokens after a
  gap g counts as n gaps of g / n (and the tokens after the first in the first chunk as
  gaps of 0), so the ITLs of a request sum to its latency minus its TTFT.
- TPOT: (latency - TTFT) / (output tokens - 1); undefined for one output token.
- E2E: from sending the request to its last chunk.
- goodput: requests per second that finished and met every SLO.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

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


def print_and_save(results: dict, out: Path) -> None:
    """Print a benchmark's results as JSON and write them to `out` (its folder made)."""
    text = json.dumps(results, indent=2)
    print(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
