"""The leader lock: one scheduler schedules, standbys wait to take over.

A redis-py `Lock` whose token is the scheduler's id (so the lock key names the leader),
renewed by its holder; a holder that stops renewing (crash, partition) loses it after
`ttl_ms`, and a standby then takes it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import redis
from redis.exceptions import LockError


class LeaderLock:
    """Taken, renewed and given back by one scheduler process."""

    def __init__(self, client: redis.Redis, key: str, holder: str, ttl_ms: int) -> None:
        # thread_local=False: the token belongs to this process, whichever thread renews it.
        self._lock = client.lock(key, timeout=ttl_ms / 1000.0, thread_local=False)
        self._holder = holder

    def try_acquire(self) -> bool:
        """Returns: whether this process holds the lock now (taken now, or renewed)."""
        if self._lock.acquire(blocking=False, token=self._holder):
            return True
        return self.renew()

    def renew(self) -> bool:
        """Resets the lock's time to live. Returns: False when this process does not hold it
        (never took it, or lost it to expiry and another holder)."""
        try:
            return self._lock.reacquire()
        except LockError:
            return False

    def release(self) -> None:
        """Gives the lock back if this process still holds it."""
        try:
            self._lock.release()
        except LockError:  # not held: never taken, or lost already
            pass

    def wait(self, poll_s: float, should_stop: Callable[[], bool]) -> bool:
        """Blocks until this process holds the lock.

        Args:
            poll_s: seconds between attempts.
            should_stop: called between attempts; True ends the wait.

        Returns: True once the lock is held, False when stopped first.
        """
        while not should_stop():
            if self.try_acquire():
                return True
            time.sleep(poll_s)
        return False
