"""The scheduler's window batcher and ordering policies."""

from __future__ import annotations

import math

from common.prefix import block_hashes
from scheduler.placement import ExecutorView, Placer, PrefixIndex
from scheduler.queue import FcfsPolicy, LpmPolicy, PriorityPolicy, WindowBatcher, WindowLimits


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


def lpm_queue(cached_tokens: list[int], aging_ms: float) -> WindowBatcher:
    """A one-request-per-batch queue ordered by lpm against a placer whose one executor is
    believed to hold the blocks of `cached_tokens` (block size 4)."""
    placer = Placer(load_cost_blocks=2.0)
    view = ExecutorView("e1", 4, 100, 100, 0, 0, PrefixIndex(100))
    view.prefix_index.record(block_hashes(cached_tokens, 4))
    placer.executors["e1"] = view
    return batcher(size=1, policy=LpmPolicy(aging_ms=aging_ms, cached_blocks=placer.cached_blocks))


SHARED = list(range(100, 112))  # three blocks of 4


def test_lpm_releases_the_longest_cached_prefix_first(pending_request):
    queue = lpm_queue(SHARED, aging_ms=1000.0)
    prompts = {"none": [1, 2, 3, 4, 5], "one": [*SHARED[:4], 9, 9, 9, 9], "three": [*SHARED, 7]}
    for i, (request_id, tokens) in enumerate(prompts.items()):
        queue.add(pending_request(request_id, 1.0 + i / 100, block_hashes=block_hashes(tokens, 4)))
    released = [queue.release(1.05)[0].request_id for _ in prompts]
    assert released == ["three", "one", "none"], (
        f"expected the longest cached prefix first: {released}"
    )


def test_lpm_aging_bounds_the_wait_of_a_prompt_nobody_shares(pending_request):
    """Every 100 ms a cached-prefix request arrives and one request is released."""

    def lonely_released_at(aging_ms: float) -> float | None:
        queue = lpm_queue(SHARED, aging_ms=aging_ms)
        queue.add(pending_request("lonely", 1.0, block_hashes=block_hashes([1, 2, 3, 4], 4)))
        for tick in range(20):
            now = 1.0 + tick / 10
            queue.add(pending_request(f"s{tick}", now, block_hashes=block_hashes(SHARED, 4)))
            if queue.release(now)[0].request_id == "lonely":
                return now
        return None

    assert lonely_released_at(500.0) == 1.5, "aged after 500 ms, it goes before younger ones"
    assert lonely_released_at(math.inf) is None, "without aging the cached-prefix stream wins"
