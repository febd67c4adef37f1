"""What the unit tests share. (Tests that start a redis-server or a gRPC server live in
tests/integration/, with their fixtures.)"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from scheduler.queue import PendingRequest


@pytest.fixture
def pending_request() -> Callable[..., PendingRequest]:
    """Builds a PendingRequest as the scheduler's intake makes one: pending_request(id,
    arrival_s, num_prompt_tokens=10, priority=0, deadline_s=None, block_hashes=())."""

    def make(
        request_id: str,
        arrival_s: float,
        num_prompt_tokens: int = 10,
        priority: int = 0,
        deadline_s: float | None = None,
        block_hashes: Sequence[int] = (),
    ) -> PendingRequest:
        return PendingRequest(
            request_id=request_id,
            entry_id="0-1",
            num_prompt_tokens=num_prompt_tokens,
            block_hashes=list(block_hashes),
            priority=priority,
            session_id=None,
            session_executor_id=None,
            arrival_s=arrival_s,
            deadline_s=deadline_s,
            payload=b"",
        )

    return make
