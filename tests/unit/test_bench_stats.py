"""The benchmark's statistics against hand-computed values."""

from __future__ import annotations

import pytest

from bench.stats import RequestResult, meets_slos, parse_slos, run_metrics, summarize_ms


def request(ttft_s: float, e2e_s: float, output_tokens: int, error: str = "") -> RequestResult:
    gap_s = (e2e_s - ttft_s) / max(output_tokens - 1, 1)
    itl_s = [gap_s] * (output_tokens - 1)
    return RequestResult(10, output_tokens, ttft_s, e2e_s, itl_s, error)


def test_percentiles_interpolate_linearly_in_milliseconds():
    summary = summarize_ms([0.001, 0.002, 0.003, 0.004, 0.010])
    # sorted ms 1, 2, 3, 4, 10: p50 is the middle one; p90 sits at rank 3.6 -> 4 + 0.6 * 6.
    expected = {"mean": 4.0, "p50": 3.0, "p90": 7.6, "p99": 9.76}
    for key, value in expected.items():
        assert summary[key] == pytest.approx(value), f"{key}: expected {value}, got {summary[key]}"


def test_summary_of_no_samples_is_none_not_zero():
    assert summarize_ms([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_tpot_excludes_the_first_token():
    # 1 s latency, 0.1 s to the first token, 10 tokens: 0.9 s over the 9 later tokens.
    assert request(0.1, 1.0, 10).tpot_s == pytest.approx(0.1)
    assert request(0.1, 0.1, 1).tpot_s is None, "TPOT of a one-token output is undefined"


def test_goodput_counts_finished_requests_within_every_slo():
    results = [
        request(0.050, 0.500, 10),  # ttft 50 ms, tpot 50 ms: good
        request(0.300, 0.700, 9),  # ttft 300 ms: misses the TTFT SLO
        request(0.050, 1.850, 10),  # tpot 200 ms: misses the TPOT SLO
        request(0.050, 0.050, 1),  # tpot undefined: meets it
        RequestResult(error="UNAVAILABLE: down"),  # failed: never good
    ]
    metrics = run_metrics(results, duration_s=2.0, slos_ms={"ttft_ms": 100, "tpot_ms": 100})
    assert metrics["goodput"] == pytest.approx(2 / 2.0), "2 good requests in 2 s"
    assert metrics["request_throughput"] == pytest.approx(4 / 2.0)
    assert metrics["output_token_throughput"] == pytest.approx(30 / 2.0)
    assert (metrics["completed"], metrics["failed"]) == (4, 1)


def test_metrics_summaries_match_the_requests():
    results = [request(0.1, 1.0, 10), request(0.3, 2.1, 10)]
    metrics = run_metrics(results, duration_s=3.0, slos_ms={})
    assert metrics["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert metrics["tpot_ms"]["p50"] == pytest.approx(150.0), "tpots 100 and 200 ms"
    assert metrics["itl_ms"]["mean"] == pytest.approx(150.0), "9 gaps of 100, 9 of 200 ms"
    assert metrics["e2e_ms"]["p99"] == pytest.approx(1000 + 0.99 * 1100)
    assert metrics["goodput"] == metrics["request_throughput"], "no SLOs: every finished one"


def test_the_prefix_cache_hit_rate_counts_finished_requests_only():
    cached = RequestResult(100, 10, 0.1, 1.0, [0.1] * 9, cached_prompt_tokens=64)
    cold = RequestResult(60, 10, 0.1, 1.0, [0.1] * 9)
    failed = RequestResult(40, error="UNAVAILABLE: down", cached_prompt_tokens=32)
    metrics = run_metrics([cached, cold, failed], duration_s=1.0, slos_ms={})
    assert metrics["total_cached_prompt_tokens"] == 64
    assert metrics["prefix_cache_hit_rate"] == pytest.approx(64 / 160)
    assert run_metrics([failed], 1.0, {})["prefix_cache_hit_rate"] == 0.0, "no prompt tokens"


def test_slo_bounds_are_inclusive():
    assert meets_slos(request(0.1, 1.0, 10), {"ttft_ms": 100.0, "e2e_ms": 1000.0})
    assert not meets_slos(request(0.1, 1.0, 10), {"e2e_ms": 999.0})


def test_slo_flags_parse_and_reject_unknown_names():
    assert parse_slos(["ttft_ms=200", "tpot_ms=50.5"]) == {"ttft_ms": 200.0, "tpot_ms": 50.5}
    for bad in ("itl=3", "ttft_ms=fast", "tpot_ms=0"):
        with pytest.raises(ValueError, match="--slo"):
            parse_slos([bad])


def test_the_paired_overhead_is_the_median_of_the_pairs_differences():
    from bench.serve import paired_overhead_ms

    inprocess = [30.0, 40.0, 35.0, 50.0]
    grpc = [35.0, 44.0, 42.0, 51.0]  # differences 5, 4, 7, 1; minus a 2 ms window
    assert paired_overhead_ms(inprocess, grpc, 2.0) == pytest.approx(2.5)
    # the difference of the medians would say 3.5 here: 43.0 - 37.5 - 2.0
    with pytest.raises(ValueError, match="pairs"):
        paired_overhead_ms([1.0], [1.0, 2.0], 2.0)
