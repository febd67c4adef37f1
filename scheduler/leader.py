"""The leader lock: one scheduler schedules, standbys wait to take over."""

from __future__ import annotations

import time
from collections.abc import Callable

import redis

# Extends the lock only while this holder still owns it.
_RENEW = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('pexpire', KEYS[1], ARGV[2])
end
return 0
"""

# Deletes the lock only while this holder still owns it.
_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('del', KEYS[1])
end
return 0
"""


class LeaderLock:
    """A Redis lock with a time-to-live, renewed by its holder.

    A holder that stops renewing (crash, partition) loses it after `ttl_ms`;
    a standby then takes it.
    """

    def __init__(self, client: redis.Redis, key: str, holder: str, ttl_ms: int) -> None:
        self._client = client
        self._key = key
        self._holder = holder
        self._ttl_ms = ttl_ms
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)

    def try_acquire(self) -> bool:
        """Returns: whether this holder owns the lock now."""
        if self._client.set(self._key, self._holder, nx=True, px=self._ttl_ms):
            return True
        return self.renew()

    def renew(self) -> bool:
        """Returns: False when the lock was lost to another holder or expired."""
        return bool(self._renew(keys=[self._key], args=[self._holder, self._ttl_ms]))

    def release(self) -> None:
        self._release(keys=[self._key], args=[self._holder])

    def wait(self, poll_s: float, should_stop: Callable[[], bool]) -> bool:
        """Blocks until this holder owns the lock.

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
