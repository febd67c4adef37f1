"""Two executors (then three): spreading, session affinity, joining and draining executors."""

from __future__ import annotations

import signal
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from client.api import KvgateClient
from tests.integration.conftest import generate, session_executor, wait_for

STORY_STARTS = ["Once upon a time", "The cat", "A big red ball", "Tom had a toy", "The sun was"]


@pytest.fixture(scope="module")
def stack(stack_factory):
    return stack_factory(num_executors=2)


def burst(stack, count: int, max_tokens: int = 16) -> list[tuple[str, object]]:
    """Runs `count` concurrent requests, each in its own session. Returns: (session, completion)."""
    sessions = [f"s-{uuid.uuid4().hex[:12]}" for _ in range(count)]

    def run(index: int):
        prompt = STORY_STARTS[index % len(STORY_STARTS)] + f" number {index}"
        return generate(
            stack.address,
            prompt,
            session_id=sessions[index],
            max_tokens=max_tokens,
            ignore_eos=True,
        )

    with ThreadPoolExecutor(count) as pool:
        completions = list(pool.map(run, range(count)))
    return list(zip(sessions, completions, strict=True))


def test_load_spreads_over_both_executors(stack):
    results = burst(stack, 12)
    used = {session_executor(stack, sid) for sid, _ in results}
    assert used == {"executor-0", "executor-1"}, f"12 concurrent requests ran only on {used}"
    assert all(c.finish_reason == "length" and len(c.token_ids) == 16 for _, c in results)


def test_a_sessions_turns_stay_on_one_executor(stack):
    with KvgateClient(stack.address, timeout_s=60) as client:
        chat = client.chat()
        owners = []
        for content in ["Hello!", "Tell me more.", "And then?"]:
            chat.ask(content, max_tokens=12, temperature=0.0)
            owners.append(session_executor(stack, chat.session_id))
        chat.close()
    assert len(set(owners)) == 1, f"the session's turns moved between executors: {owners}"


def test_an_executor_started_mid_test_receives_work(stack):
    stack.start_executor("executor-2")
    wait_for(lambda: stack.executor_status("executor-2") is not None, 30.0, "executor-2 up")
    used = {session_executor(stack, sid) for sid, _ in burst(stack, 12)}
    assert "executor-2" in used, f"the new executor got no work; requests ran on {used}"


def test_sigterm_drains_an_executor_without_losing_requests(stack):
    with ThreadPoolExecutor(12) as pool:
        pending = pool.submit(burst, stack, 12, 48)

        def busy() -> bool:
            status = stack.executor_status("executor-1")
            return status is not None and status.num_running > 0

        wait_for(busy, 30.0, "executor-1 running requests")
        status = stack.stop("executor-1", sig=signal.SIGTERM, timeout_s=60.0)
        results = pending.result(timeout=120)
    assert status == 0, f"the draining executor exited with status {status}"
    short = [c for _, c in results if len(c.token_ids) != 48 or c.finish_reason != "length"]
    assert not short, f"{len(short)} of 12 requests did not complete: {short[:1]}"
