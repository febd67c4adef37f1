"""common.startup.stop_on_signals: a stop signal that lands while the main thread is inside
Event.wait (holding the event's lock) sets the event instead of deadlocking the process."""

from __future__ import annotations

import os
import signal
import threading
import time

from common.startup import stop_on_signals


def test_a_signal_during_wait_sets_the_event_without_deadlock():
    stop = threading.Event()
    previous = signal.getsignal(signal.SIGUSR2)
    stop_on_signals(stop, (signal.SIGUSR2,))
    try:
        # What Event.wait does around its check: hold the event's lock. A handler calling
        # stop.set() here, on the main thread, would block on this lock forever.
        with stop._cond:
            os.kill(os.getpid(), signal.SIGUSR2)
            time.sleep(0.05)  # the handler runs on the main thread, between bytecodes
            assert not stop.is_set()  # its set waits for the lock, on another thread
        assert stop.wait(5.0), "the stop signal never set the event"
    finally:
        signal.signal(signal.SIGUSR2, previous)
