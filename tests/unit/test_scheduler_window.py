"""The scheduler's window batcher and ordering policies."""

from __future__ import annotations

from scheduler.queue import FcfsPolicy, PriorityPolicy, WindowBatcher, WindowLimits


def batcher(window_ms=10.0, size=4, tokens=100, policy=None) -> WindowBatcher:
    return WindowBatcher(WindowLimits(window_ms, size, tokens), policy or FcfsPolicy())


def test_window_releases_when_oldest_waited_the_window(pending_request):
    queue = batcher(window_ms=10.0)
    queue.add(pending_request("a", arrival_s=1.000))
    assert queue.release_reason(1.005) is None, "released before the window closed"
    assert queue.release_reason(1.010) == "window", "not released once the oldest waited"
    assert [r.request_id for r in queue.release(1.010)] == ["a"]


def test_window_releases_early_at_max_batch_size(pending_request):
    queue = batcher(window_ms=1000.0, size=3)
    for i in range(3):
        queue.add(pending_request(f"r{i}", arrival_s=1.0))
    assert queue.release_reason(1.0) == "max_batch_size", "3 requests wait, max_batch_size 3"


def test_window_releases_early_at_max_batch_tokens_and_splits_the_batch(pending_request):
    queue = batcher(window_ms=1000.0, size=10, tokens=100)
    queue.add(pending_request("a", 1.0, num_prompt_tokens=60))
    assert queue.release_reason(1.0) is None
    queue.add(pending_request("b", 1.1, num_prompt_tokens=60))
    assert queue.release_reason(1.1) == "max_batch_tokens", "120 tokens wait, limit 100"
    assert [r.request_id for r in queue.release(1.1)] == ["a"], "batch over max_batch_tokens"
    assert len(queue) == 1


def test_an_oversized_prompt_is_still_released(pending_request):
    queue = batcher(tokens=100)
    queue.add(pending_request("big", 1.0, num_prompt_tokens=500))
    assert [r.request_id for r in queue.release(2.0)] == ["big"]


def test_fcfs_orders_by_arrival(pending_request):
    queue = batcher(size=2)
    queue.add(pending_request("late", 2.0))
    queue.add(pending_request("early", 1.0))
    queue.add(pending_request("latest", 3.0))
    assert [r.request_id for r in queue.release(4.0)] == ["early", "late"]


def test_priority_runs_lower_values_first(pending_request):
    queue = batcher(size=1, policy=PriorityPolicy(aging_ms=1000.0))
    queue.add(pending_request("low", 1.0, priority=5))
    queue.add(pending_request("high", 1.001, priority=0))
    assert [r.request_id for r in queue.release(1.002)] == ["high"]


def test_priority_aging_lets_an_old_low_priority_request_pass(pending_request):
    queue = batcher(size=1, policy=PriorityPolicy(aging_ms=100.0))
    queue.add(pending_request("old_low", 1.0, priority=3))
    queue.add(pending_request("fresh_high", 1.5, priority=0))
    released = queue.release(1.5)
    assert [r.request_id for r in released] == ["old_low"], (
        "a priority-3 request that waited 500 ms with aging_ms 100 should beat a fresh priority 0"
    )


def test_duplicates_are_ignored_and_removal_works(pending_request):
    queue = batcher()
    assert queue.add(pending_request("a", 1.0))
    assert not queue.add(pending_request("a", 1.0)), "the same request id was queued twice"
    assert queue.remove("a") is not None
    assert queue.remove("a") is None
    assert queue.release_reason(10.0) is None


def test_expired_requests_leave_the_queue(pending_request):
    queue = batcher()
    late = pending_request("late", 1.0)
    late.deadline_s = 2.0
    queue.add(late)
    queue.add(pending_request("fine", 1.0))
    assert [r.request_id for r in queue.expired(2.5)] == ["late"]
    assert "fine" in queue and "late" not in queue
