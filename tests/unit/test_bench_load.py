"""The benchmark's arrival process and its timing of a streamed completion."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from bench.load import arrival_gaps_s
from bench.stats import sse_payloads, time_sse, time_stream
from protos.kvgate.v1 import inference_pb2


def test_mean_gap_is_one_over_the_rate():
    gaps = arrival_gaps_s(20_001, request_rate=4.0, burstiness=1.0, seed=1)
    assert gaps[0] == 0.0, "the first request goes at once"
    # 20,000 exponential gaps of mean 0.25 s: the standard error is 0.25 / sqrt(20000) < 0.002.
    assert np.mean(gaps[1:]) == pytest.approx(0.25, abs=0.01)


def test_poisson_gaps_have_the_variance_of_an_exponential():
    gaps = np.asarray(arrival_gaps_s(20_001, request_rate=2.0, burstiness=1.0, seed=2)[1:])
    assert np.var(gaps) == pytest.approx(0.25, rel=0.1), "exponential: variance = mean^2"


def test_burstiness_changes_the_variance_not_the_mean():
    bursty = np.asarray(arrival_gaps_s(20_001, 2.0, burstiness=0.25, seed=3)[1:])
    regular = np.asarray(arrival_gaps_s(20_001, 2.0, burstiness=4.0, seed=3)[1:])
    for gaps in (bursty, regular):
        assert np.mean(gaps) == pytest.approx(0.5, rel=0.05)
    # gamma(k, 1 / (rate k)): variance 1 / (rate^2 k) -> 1.0 for k = 0.25, 0.0625 for k = 4.
    assert np.var(bursty) == pytest.approx(1.0, rel=0.15)
    assert np.var(regular) == pytest.approx(0.0625, rel=0.15)


def test_same_seed_same_gaps_other_seed_other_gaps():
    assert arrival_gaps_s(50, 3.0, 1.0, seed=7) == arrival_gaps_s(50, 3.0, 1.0, seed=7)
    assert arrival_gaps_s(50, 3.0, 1.0, seed=7) != arrival_gaps_s(50, 3.0, 1.0, seed=8)


def test_infinite_rate_sends_everything_at_once():
    assert arrival_gaps_s(5, math.inf, burstiness=0.5, seed=0) == [0.0] * 5
    assert arrival_gaps_s(0, 1.0) == []


def chunk(token_ids: list[int], last: bool = False) -> inference_pb2.GenerateResponse:
    response = inference_pb2.GenerateResponse(token_ids=token_ids)
    if last:
        response.finish_reason = inference_pb2.FINISH_REASON_LENGTH
        response.usage.prompt_tokens = 7
    return response


def test_stream_timing_counts_every_token_and_splits_multi_token_chunks(monkeypatch):
    clock = iter([1.0, 1.5, 1.9, 2.0])  # when each chunk arrives; sent at 0.9
    monkeypatch.setattr("bench.stats.time.perf_counter", lambda: next(clock))
    chunks = [chunk([5, 6]), chunk([7]), chunk([]), chunk([8, 9], last=True)]
    result = time_stream(iter(chunks), sent_s=0.9)
    assert result.output_tokens == 5
    assert result.prompt_tokens == 7
    assert result.ttft_s == pytest.approx(0.1)
    assert result.e2e_s == pytest.approx(1.1)
    # token 2 came with token 1; token 3 after 0.5 s; tokens 4, 5 after 0.5 s together.
    assert result.itl_s == pytest.approx([0.0, 0.5, 0.25, 0.25])
    assert sum(result.itl_s) == pytest.approx(result.e2e_s - result.ttft_s)
    assert result.tpot_s == pytest.approx(0.25)


def test_stream_error_is_recorded():
    last = chunk([], last=True)
    last.finish_reason = inference_pb2.FINISH_REASON_ERROR
    last.error_message = "executor lost"
    result = time_stream(iter([chunk([1]), last]), sent_s=0.0)
    assert not result.ok and result.error == "executor lost"


def test_a_stream_cut_before_its_finish_reason_is_a_failed_request():
    result = time_stream(iter([chunk([1]), chunk([2, 3])]), sent_s=0.0)
    assert not result.ok, f"a stream without a finish reason counted as finished: {result}"
    assert "finish reason" in result.error, result.error


def sse_lines(*events: dict) -> list[str]:
    return [line for event in events for line in (f"data: {json.dumps(event)}", "")] + [
        "data: [DONE]"
    ]


def text_event(text: str, finish_reason: str | None = None) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish_reason}]}


USAGE = {"prompt_tokens": 7, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 3}}


def test_an_openai_stream_is_timed_by_its_events_with_text_and_counted_by_its_usage(monkeypatch):
    clock = iter([1.0, 1.5, 1.6, 1.9, 2.0])  # when each event arrives; sent at 0.9
    monkeypatch.setattr("bench.stats.time.perf_counter", lambda: next(clock))
    events = sse_lines(
        text_event(" Once"),
        text_event(""),  # a token whose text the detokenizer holds back
        text_event(" upon a"),
        text_event(" time", "length"),
        {"choices": [], "usage": USAGE},
    )
    result = time_sse(sse_payloads(events), sent_s=0.9)
    assert result.ok, result.error
    assert (result.prompt_tokens, result.output_tokens, result.cached_prompt_tokens) == (7, 4, 3)
    assert result.ttft_s == pytest.approx(0.1)
    assert result.e2e_s == pytest.approx(1.0)
    assert result.itl_s == pytest.approx([0.6, 0.3]), "one gap per event with text"


def test_a_chat_stream_skips_its_role_event_and_an_error_event_fails_the_request():
    role = {
        "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        ]
    }
    content = {"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]}
    error = {"error": {"message": "executor lost", "type": "server_error"}}
    result = time_sse(sse_payloads(sse_lines(role, content, error)), sent_s=0.0)
    assert not result.ok and result.error == "executor lost", result
    cut = time_sse(sse_payloads(sse_lines(role, content)), sent_s=0.0)
    assert "finish reason" in cut.error, f"a stream cut before its finish reason: {cut}"
