"""A drain that moves KV (executor/drain.py, executor/kv_transfer.py): executor-0 runs greedy
streams and holds idle sessions, executor-1 joins, executor-0 gets SIGTERM. Its streams go on
at executor-1 from its KV with the same text as an undisturbed run's, its sessions' next turns
find their history cached there, and executor-0 exits while its streams still run."""

from __future__ import annotations

import re
import signal
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from client.api import Completion, KvgateClient, sampling_params
from tests.helpers import wait_for
from tests.integration.conftest import generate, scrape, session_executor

NUM_STREAMS = 20
NUM_SESSIONS = 100
STREAM_TOKENS = 160
SLOW_STEP_S = 0.02  # while the slow file exists: a stream takes 3.2 s at least
STORY_WORDS = ["cat", "dog", "ball", "tree", "sun", "boat", "bird", "cake", "park", "hat"]
MOVE_FLAGS = ["--num-gpu-blocks", "2048"]


def prompt_of(i: int) -> str:
    a, b = STORY_WORDS[i % 10], STORY_WORDS[(i // 10) % 10]
    return f"Once upon a time, there was a little {a} who loved the {b}. One day, the {a}"


class Stream:
    """One greedy stream read on a thread, with what it has received so far."""

    def __init__(self, address: str, prompt: str) -> None:
        self.completion = Completion()
        self.done = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._read, args=(address, prompt), daemon=True)
        self._thread.start()

    def _read(self, address: str, prompt: str) -> None:
        params = sampling_params(max_tokens=STREAM_TOKENS, temperature=0.0, ignore_eos=True)
        try:
            with KvgateClient(address, timeout_s=120.0, retry=False) as client:
                for chunk in client.generate_stream(prompt, params):
                    self.completion.add(chunk)
        except BaseException as error:  # noqa: BLE001 (reported by the test)
            self.error = error
        finally:
            self.done.set()

    def result(self) -> Completion:
        assert self.done.wait(120.0), "a stream did not end"
        if self.error is not None:
            raise self.error
        return self.completion


def counter(text: str, name: str, **labels: str) -> float:
    """A counter's value in a /metrics text (0 when absent)."""
    selector = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = rf"^{name}_total\{{{selector}\}} (\S+)$" if labels else rf"^{name}_total (\S+)$"
    match = re.search(pattern, text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


@pytest.fixture
def slow_file(tmp_path: Path) -> Path:
    return tmp_path / "slow"


def test_a_drain_moves_streams_and_sessions_to_the_peer(stack_factory, slow_file: Path):
    stack = stack_factory(
        num_executors=1,
        executor_flags=MOVE_FLAGS,
        executor_env={"KVGATE_FAULTS": f"slow_while_file={slow_file}:{SLOW_STEP_S}"},
    )
    address = stack.address
    sessions = [f"s-{uuid.uuid4().hex[:10]}" for _ in range(NUM_SESSIONS)]
    with ThreadPoolExecutor(8) as pool:
        first_turns = list(
            pool.map(
                lambda i: generate(address, prompt_of(i), session_id=sessions[i], max_tokens=12),
                range(NUM_SESSIONS),
            )
        )
    assert all(session_executor(stack, s) == "executor-0" for s in sessions)

    slow_file.touch()
    streams = [Stream(address, prompt_of(i)) for i in range(NUM_STREAMS)]
    wait_for(
        lambda: all(len(s.completion.token_ids) >= 4 for s in streams),
        "every stream to be generating on executor-0",
        timeout_s=60.0,
    )
    stack.start_executor("executor-1")
    wait_for(
        lambda: (
            (status := stack.executor_status("executor-1")) is not None
            and bool(status.kv_transfer_address)
        ),
        "executor-1 to advertise its KvTransfer address",
    )
    stack.procs["executor-0"].send_signal(signal.SIGTERM)
    status = stack.procs["executor-0"].wait(timeout=60.0)
    still_running = sum(not s.done.is_set() for s in streams)
    slow_file.unlink()
    assert status == 0, f"executor-0 exited with {status}"
    # It did not wait for its streams: they were still running when it exited.
    assert still_running == NUM_STREAMS, f"{NUM_STREAMS - still_running} ended on executor-0"
    moved = [s.result() for s in streams]

    undisturbed = [Stream(address, prompt_of(i)) for i in range(NUM_STREAMS)]
    for i, (got, want) in enumerate(zip(moved, [u.result() for u in undisturbed], strict=True)):
        assert got.finish_reason == "length" and len(got.token_ids) == STREAM_TOKENS
        assert got.token_ids == want.token_ids, f"stream {i} differs from an undisturbed run"
        assert got.text == want.text

    metrics = scrape(stack, "executor-1")
    assert counter(metrics, "kvgate_executor_kv_moved_blocks", direction="in") > 0
    assert all(session_executor(stack, s) == "executor-1" for s in sessions)
    for i in range(0, NUM_SESSIONS, 10):
        history = first_turns[i].usage.prompt_tokens + first_turns[i].usage.completion_tokens
        turn = generate(
            address, prompt_of(i) + first_turns[i].text + " The end.", session_id=sessions[i],
            max_tokens=4,
        )  # fmt: skip
        cached = turn.usage.cached_prompt_tokens
        assert cached >= 0.95 * (history - 1), f"session {i}: {cached} of {history} cached"
