"""The scheduler's intake (scheduler/intake.py): how it waits for new requests, with the
request stream replaced by one that records each read. The intake against a real
redis-server is in tests/integration/test_scheduler_redis.py."""

from __future__ import annotations

import pytest
import redis

from scheduler.clock import RedisClock
from scheduler.intake import RequestIntake
from scheduler.queue import FcfsPolicy, WindowBatcher, WindowLimits
from scheduler.streams import StreamEntry


class RecordingStream:
    """Stands in for the request stream: records how each read was asked to wait; each read
    returns nothing."""

    def __init__(self) -> None:
        self.blocks: list[int | None] = []

    def read_new(self, block_ms: int | None, count: int) -> list[StreamEntry]:
        self.blocks.append(block_ms)
        return []

    def drop(self, entry_ids: list[str]) -> None:
        raise AssertionError(f"nothing should be dropped, got {entry_ids}")


def intake_with(stream: RecordingStream, window_ms: float) -> tuple[RequestIntake, WindowBatcher]:
    batcher = WindowBatcher(WindowLimits(window_ms, 64, 8192), FcfsPolicy())
    clock = RedisClock(redis.Redis(port=1))  # never synced: the intake reads no entry here
    return RequestIntake(stream, clock, batcher), batcher


class VirtualTime:
    """The intake's `time`: a clock that moves only by its sleeps and the stream's reads (on a
    busy machine a real read or wake-up can take longer than the lead it is to teach, or than
    the margins a test would allow)."""

    def __init__(self) -> None:
        self.now_s = 1000.0
        self.wake_targets: list[float] = []
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now_s

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.wake_targets.append(self.now_s + seconds)
        self.now_s += seconds


class TimedStream(RecordingStream):
    """A RecordingStream whose reads take `read_s` of a VirtualTime."""

    def __init__(self, clock: VirtualTime, read_s: float) -> None:
        super().__init__()
        self.clock, self.read_s_virtual = clock, read_s

    def read_new(self, block_ms: int | None, count: int) -> list[StreamEntry]:
        self.clock.now_s += self.read_s_virtual
        return super().read_new(block_ms, count)


@pytest.fixture
def clock(monkeypatch) -> VirtualTime:
    """The intake's clock, virtual: every wait is exact, however busy the machine."""
    clock = VirtualTime()
    monkeypatch.setattr("scheduler.intake.time", clock)
    return clock


def waits_of(clock, pending_request, window_ms, poll_in_ms, waiting, stalled=False):
    """One read of the intake: (the read's block_ms, the seconds slept)."""
    stream = RecordingStream()
    intake, batcher = intake_with(stream, window_ms)
    now = clock.monotonic()
    if waiting:
        batcher.add(pending_request("r1", arrival_s=now))
    intake.read(next_poll_s=now + poll_in_ms / 1000.0, stalled=stalled)
    return stream.blocks[0], clock.slept


def test_with_nothing_waiting_it_waits_on_the_stream_until_the_poll(clock, pending_request):
    block_ms, slept = waits_of(clock, pending_request, 2.0, poll_in_ms=50.0, waiting=False)
    assert (block_ms, slept) == (50, [])


@pytest.mark.parametrize("poll_in_ms", [60.0, 10.0])
def test_a_window_closing_within_redis_resolution_is_slept_out_exactly(
    clock, pending_request, poll_in_ms
):
    """A BLOCK would end on Redis's 100 ms clock, so a 30 ms window would close up to 100 ms
    late; the intake sleeps to the close (or to a poll due sooner) instead, then reads
    without waiting."""
    block_ms, slept = waits_of(clock, pending_request, 30.0, poll_in_ms, waiting=True)
    assert block_ms is None, f"read with BLOCK {block_ms} while a window closes in 30 ms"
    assert slept == [pytest.approx(min(30.0, poll_in_ms) / 1000.0)], slept


def test_the_last_read_before_a_window_closes_starts_early_by_what_reads_take(clock):
    """The read before a close starts early by the average of what the reads took, and the
    batch still leaves no earlier than the close."""
    intake, _ = intake_with(TimedStream(clock, read_s=0.005), window_ms=2.0)
    for _ in range(10):
        due_s = clock.monotonic() + 0.02
        clock.wake_targets.clear()
        intake.read_until(due_s)
        assert clock.monotonic() >= due_s
    assert 0.004 < intake.read_lead_s, intake.read_lead_s
    assert clock.wake_targets[0] <= due_s - 0.004, "the last read did not start early"


def test_a_long_window_waits_on_the_stream_only_until_a_resolution_before_its_close(
    clock, pending_request
):
    block_ms, slept = waits_of(clock, pending_request, 250.0, poll_in_ms=1000.0, waiting=True)
    assert (block_ms, slept) == (150, []), "BLOCK until Redis's resolution (100 ms) before"


def test_a_stalled_batch_waits_for_the_next_poll(clock, pending_request):
    block_ms, slept = waits_of(
        clock, pending_request, 2.0, poll_in_ms=125.0, waiting=True, stalled=True
    )
    assert (block_ms, slept) == (125, [])  # 0.125 s: exact in binary, as the clock's 1000 s
