"""common.startup in a real process: what every kvgate process gets when it starts."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from tests.helpers import REPO, wait_for


def test_sigusr1_prints_every_threads_stack_and_the_process_goes_on(tmp_path):
    """The scheduler (waiting for a Redis that is not there) stands for every process started
    through common.startup. The signal is sent once the scheduler's own loop logged the
    outage (its health check logs one too, earlier, from start-up code, where the stack
    holds no scheduler/service.py yet: a run that sent it then failed)."""
    argv = [sys.executable, "-m", "scheduler", "--redis-url", f"unix://{tmp_path}/none.sock",
            "--metrics-port", "-1"]  # fmt: skip
    log_path = tmp_path / "scheduler.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(argv, cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        wait_for(
            lambda: "scheduler: redis unreachable" in log_path.read_text(),
            "the scheduler's loop to start",
            60,
        )
        process.send_signal(signal.SIGUSR1)
        time.sleep(1.0)  # time for a signal that would end the process to do so
        assert process.poll() is None, "SIGUSR1 must not stop the process"
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0, log_path.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    output = log_path.read_text()
    assert "Current thread" in output and "scheduler/service.py" in output, output[-2000:]
