"""The step loop's hold on the engine, shared with the KV coming in from peers.

The engine is the step loop's: a KV transfer (executor/kv_transfer.py) touches it under the
loop's `EngineGate` lock, one chunk at a time. While the engine has requests running, the
chunks of every transfer wait for the step loop, which writes them between two steps up to
STEP_BUDGET_BYTES in all (a copy of a few ms), so transfers never starve decoding; an idle
engine takes each chunk as it arrives.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from concurrent import futures
from typing import TypeVar

T = TypeVar("T")

# While requests run, KV coming in is written between steps, up to this many bytes per step
# (a memory copy of a few ms at most).
STEP_BUDGET_BYTES = 4 << 20


class EngineGate:
    """The step loop's hold on the engine: `lock` around everything that touches it, and the
    work transfers queue for it while requests run (`run`), done between steps within a
    budget of bytes (`run_pending`), so that KV coming in never starves decoding and never
    holds the step loop for more than a few ms per step."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.busy = False  # the engine has requests (set by the step loop)
        self._pending: collections.deque[tuple[int, Callable[[], object], futures.Future]] = (
            collections.deque()
        )
        self._pending_lock = threading.Lock()

    def run(self, work: Callable[[], T], num_bytes: int, timeout_s: float | None) -> T:
        """`work()` with the engine to itself: at once while the engine is idle, else
        between two steps.

        Raises:
            TimeoutError: the step loop did not get to it within `timeout_s`.
        """
        if not self.busy:
            with self.lock:
                return work()
        done: futures.Future = futures.Future()
        with self._pending_lock:
            self._pending.append((num_bytes, work, done))
        try:
            return done.result(timeout=timeout_s)
        except TimeoutError:
            if done.cancel():  # never runs now
                raise
            return done.result()  # running already: its outcome stands

    def waiting(self) -> int:
        """Pieces of work queued and still wanted (a transfer that gave up cancelled its)."""
        with self._pending_lock:
            return sum(not done.cancelled() for _, _, done in self._pending)

    def run_pending(self, budget_bytes: int = STEP_BUDGET_BYTES) -> None:
        """Do queued work (the step loop, holding `lock`, after a step) until `budget_bytes`
        are spent; at least one piece when any waits."""
        spent = 0
        while spent < budget_bytes:
            with self._pending_lock:
                if not self._pending:
                    return
                num_bytes, work, done = self._pending.popleft()
            spent += max(1, num_bytes)
            if not done.set_running_or_notify_cancel():
                continue
            try:
                done.set_result(work())
            except BaseException as error:  # noqa: BLE001 (the transfer's thread raises it)
                done.set_exception(error)
