"""gateway.quotas.RefusalMemory: a bucket's refusal is remembered until the bucket refills,
at most max_s, and while the tenant's limits stay the same."""

from __future__ import annotations

import pytest

from common.tenants import TenantLimits
from gateway.errors import QuotaExceeded
from gateway.quotas import RefusalMemory

LIMITS = TenantLimits(requests_per_s=2.0)


class StillClock:
    """gateway.quotas' `time`: it moves only when the test moves it."""

    def __init__(self) -> None:
        self.now_s = 1000.0

    def monotonic(self) -> float:
        return self.now_s


@pytest.fixture
def clock(monkeypatch) -> StillClock:
    clock = StillClock()
    monkeypatch.setattr("gateway.quotas.time", clock)
    return clock


def test_a_remembered_refusal_refuses_with_the_time_left(clock):
    memory = RefusalMemory(max_s=60.0)
    memory.check("acme", LIMITS)  # nothing remembered
    memory.remember("acme", LIMITS, "requests_per_s", 30_000)
    clock.now_s += 1.25
    with pytest.raises(QuotaExceeded) as refused:
        memory.check("acme", LIMITS)
    assert refused.value.limit == "requests_per_s", refused.value
    assert refused.value.retry_after_ms == 28_750, refused.value.retry_after_ms
    assert "2 requests per second" in str(refused.value), refused.value
    memory.check("globex", LIMITS)  # another tenant's is its own


def test_a_refusal_is_forgotten_when_the_limits_change_or_after_max_s():
    memory = RefusalMemory(max_s=60.0)
    memory.remember("acme", LIMITS, "requests_per_s", 30_000)
    memory.check("acme", TenantLimits(requests_per_s=50.0))  # raised: Redis decides again
    memory.check("acme", LIMITS)  # and the refusal is gone
    brief = RefusalMemory(max_s=0.0)
    brief.remember("acme", LIMITS, "requests_per_s", 30_000)
    brief.check("acme", LIMITS)
