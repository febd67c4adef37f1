"""Keeps a local stack up: a process that exits is started again, with backoff, and logged.

`make run` (deploy/local.py) polls a `Supervisor` while it waits for Ctrl-C. A process that
dies is restarted with the command it was started with (same ports, same executor id) after
a delay that doubles with each death in a row, from RESTART_INITIAL_S up to RESTART_MAX_S; a
process that stayed up RESTART_STABLE_S starts from the shortest delay again.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from deploy.stack import Stack

RESTART_INITIAL_S = 0.5
RESTART_MAX_S = 30.0
RESTART_STABLE_S = 60.0


def describe_exit(returncode: int) -> str:
    """'status 1' or 'signal SIGKILL', from a Popen returncode."""
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"status {returncode}"


@dataclass(slots=True)
class ProcessRecord:
    """What the supervisor knows of one process."""

    started_s: float  # monotonic time of its last start
    restarts: int = 0  # deaths in a row (reset once it stays up RESTART_STABLE_S)
    restart_due_s: float | None = None  # when it is to be started again, while it is dead


class Supervisor:
    """Restarts the stack's processes that exit; `poll` does one round."""

    def __init__(self, stack: Stack, say: Callable[[str], None] = print) -> None:
        self._stack = stack
        self._say = say
        now = time.monotonic()
        self._records = {name: ProcessRecord(now) for name in stack.procs}

    def restart_delay_s(self, restarts: int) -> float:
        """The wait before restart number `restarts` (1 for the first) of a process."""
        return min(RESTART_MAX_S, RESTART_INITIAL_S * 2 ** (restarts - 1))

    def poll(self) -> None:
        """Notices processes that exited and starts those whose delay has passed."""
        now = time.monotonic()
        for name, proc in list(self._stack.procs.items()):
            record = self._records.setdefault(name, ProcessRecord(now))
            if proc.poll() is None:
                if record.restarts and now - record.started_s >= RESTART_STABLE_S:
                    record.restarts = 0
                continue
            if record.restart_due_s is None:
                self._schedule(name, record, proc.returncode, now)
            elif now >= record.restart_due_s:
                self._restart(name, record, now)

    def _schedule(self, name: str, record: ProcessRecord, returncode: int, now: float) -> None:
        record.restarts += 1
        delay_s = self.restart_delay_s(record.restarts)
        record.restart_due_s = now + delay_s
        self._say(
            f"{name} exited ({describe_exit(returncode)}) after {now - record.started_s:.1f} s; "
            f"restarting in {delay_s:g} s (restart {record.restarts})"
        )

    def _restart(self, name: str, record: ProcessRecord, now: float) -> None:
        proc = self._stack.respawn(name)
        record.started_s = now
        record.restart_due_s = None
        self._say(f"{name} restarted (pid {proc.pid}; its log: {self._stack.log_path(name)})")
