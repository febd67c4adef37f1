"""The scheduler's in-memory waiting queue: ordering policies and the latency window."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(slots=True)
class PendingRequest:
    """A request read from the request stream and not yet assigned to an executor."""

    request_id: str
    entry_id: str  # id of its entry in the request stream (XACK'd once assigned)
    num_prompt_tokens: int
    block_hashes: list[int]  # chained hashes of the prompt's full blocks, tenant-salted
    priority: int  # lower runs first
    session_id: str | None
    session_executor_id: str | None  # executor that ran the session's last turn (a hint)
    # monotonic time it was queued at (Redis's clock read onto the scheduler's), at most the time
    # the scheduler admitted it: the latency window, FCFS order and aging count from it
    arrival_s: float
    deadline_s: float | None  # monotonic time after which it may no longer wait
    payload: bytes = field(repr=False)  # the serialized QueuedRequest, forwarded as is
    num_sequences: int = 1  # run in one batch: n, or best_of when larger (its choices)

    def waited_ms(self, now_s: float) -> float:
        return (now_s - self.arrival_s) * 1000.0


class OrderingPolicy(Protocol):
    """Decides which waiting request is released first."""

    def sort_key(self, request: PendingRequest, now_s: float) -> tuple[float, ...]:
        """Args: a waiting request and the current monotonic time.

        Returns: a key; the smallest key is released first.
        """
        ...


class FcfsPolicy:
    """First come, first served."""

    def sort_key(self, request: PendingRequest, now_s: float) -> tuple[float, ...]:
        return (request.arrival_s,)


@dataclass(slots=True)
class PriorityPolicy:
    """Lower priority values first; waiting ages a request up one level per `aging_ms`.

    Aging bounds starvation: a request of priority p waits behind fresh requests
    of priority q < p for at most (p - q) * aging_ms.
    """

    aging_ms: float

    def sort_key(self, request: PendingRequest, now_s: float) -> tuple[float, ...]:
        effective = request.priority - request.waited_ms(now_s) / self.aging_ms
        return (effective, request.arrival_s)


# How many leading blocks of a prompt (its block hashes) the scheduler believes one executor
# holds, the most over executors (`Placer.cached_blocks`).
PrefixMatcher = Callable[[list[int]], int]


@dataclass(slots=True)
class LpmPolicy:
    """Longest prefix match first (SGLang's `lpm`): the request with the most leading prompt
    blocks cached on some executor, as far as the scheduler knows (heartbeat hashes and what it
    assigned since), then the oldest.

    Aging bounds starvation: a request that has waited `aging_ms` goes before every younger
    one, oldest first, however long the prefixes of the requests that keep arriving.
    """

    aging_ms: float
    cached_blocks: PrefixMatcher

    def sort_key(self, request: PendingRequest, now_s: float) -> tuple[float, ...]:
        if request.waited_ms(now_s) >= self.aging_ms:
            return (0.0, 0.0, request.arrival_s)
        return (1.0, -float(self.cached_blocks(request.block_hashes)), request.arrival_s)


def make_policy(
    name: str, priority_aging_ms: float, lpm_aging_ms: float, cached_blocks: PrefixMatcher
) -> OrderingPolicy:
    """Args: policy name (`fcfs`, `priority` or `lpm`), the aging periods of `priority` and
    `lpm`, and what `lpm` measures a prompt's cached prefix with.

    Returns: the policy; ValueError for an unknown name.
    """
    if name == "fcfs":
        return FcfsPolicy()
    if name == "priority":
        return PriorityPolicy(aging_ms=priority_aging_ms)
    if name == "lpm":
        return LpmPolicy(aging_ms=lpm_aging_ms, cached_blocks=cached_blocks)
    raise ValueError(f"policy must be 'fcfs', 'priority' or 'lpm', got {name!r}")


@dataclass(slots=True)
class WindowLimits:
    """When the window releases a batch."""

    batch_window_ms: float  # the oldest request waited this long
    max_batch_size: int  # or this many requests wait
    max_batch_tokens: int  # or this many prompt tokens wait


# Why a batch is released: the oldest request waited batch_window_ms, or a limit was reached.
RELEASE_REASONS = ("window", "max_batch_size", "max_batch_tokens")


class WindowBatcher:
    """Holds waiting requests and releases them in batches, ordered by a policy."""

    def __init__(self, limits: WindowLimits, policy: OrderingPolicy) -> None:
        self._limits = limits
        self._policy = policy
        self._waiting: dict[str, PendingRequest] = {}
        self._waiting_tokens = 0

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._waiting

    def add(self, request: PendingRequest) -> bool:
        """Args: a request to hold. Returns: False when its id already waits."""
        if request.request_id in self._waiting:
            return False
        self._waiting[request.request_id] = request
        self._waiting_tokens += request.num_prompt_tokens
        return True

    def remove(self, request_id: str) -> PendingRequest | None:
        """Args: a request id. Returns: the removed request, None when it was not waiting."""
        request = self._waiting.pop(request_id, None)
        if request is not None:
            self._waiting_tokens -= request.num_prompt_tokens
        return request

    def clear(self) -> None:
        """Forgets every waiting request (their entries stay pending in the stream)."""
        self._waiting.clear()
        self._waiting_tokens = 0

    def requests(self) -> list[PendingRequest]:
        return list(self._waiting.values())

    def entry_ids(self) -> set[str]:
        """The stream entry ids of the waiting requests."""
        return {r.entry_id for r in self._waiting.values()}

    def release_reason(self, now_s: float) -> str | None:
        """Returns: why a batch is due (one of RELEASE_REASONS), None when it is not."""
        if not self._waiting:
            return None
        limits = self._limits
        if len(self._waiting) >= limits.max_batch_size:
            return "max_batch_size"
        if self._waiting_tokens >= limits.max_batch_tokens:
            return "max_batch_tokens"
        if self.oldest_waited_ms(now_s) >= limits.batch_window_ms:
            return "window"
        return None

    def oldest_waited_ms(self, now_s: float) -> float:
        return max((r.waited_ms(now_s) for r in self._waiting.values()), default=0.0)

    def seconds_until_due(self, now_s: float) -> float:
        """Returns: how long until the window of the oldest request closes (inf when empty)."""
        if not self._waiting:
            return math.inf
        return max(0.0, (self._limits.batch_window_ms - self.oldest_waited_ms(now_s)) / 1000.0)

    def release(self, now_s: float) -> list[PendingRequest]:
        """Removes and returns the next batch in policy order, within the batch limits.

        The first request is always released, even when its prompt alone exceeds
        `max_batch_tokens`, so no request can block the queue.
        """
        ordered = sorted(self._waiting.values(), key=lambda r: self._policy.sort_key(r, now_s))
        batch: list[PendingRequest] = []
        batch_tokens = 0
        for request in ordered:
            if len(batch) >= self._limits.max_batch_size:
                break
            if batch and batch_tokens + request.num_prompt_tokens > self._limits.max_batch_tokens:
                break
            batch.append(request)
            batch_tokens += request.num_prompt_tokens
        for request in batch:
            self.remove(request.request_id)
        return batch

    def expired(self, now_s: float) -> list[PendingRequest]:
        """Removes and returns the requests whose queue deadline passed."""
        late = [
            r for r in self._waiting.values() if r.deadline_s is not None and now_s >= r.deadline_s
        ]
        for request in late:
            self.remove(request.request_id)
        return late
