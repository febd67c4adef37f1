"""`make run` supervises: the real launcher, its real children killed, then Ctrl-C (SIGINT)."""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest

from deploy.stack import ROOT
from tests.helpers import wait_for
from tests.integration.conftest import MODEL, generate

START_TIMEOUT_S = 120.0
# A line the launcher prints soon (a restart, an exit): only bounds a failure, so generous.
LINE_TIMEOUT_S = 60.0


def free_port_run(count: int) -> int:
    """The first of `count` consecutive TCP ports free on 127.0.0.1 now."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = probe.getsockname()[1]
        if first + count > 65535:
            continue
        try:
            for port in range(first, first + count):
                with socket.socket() as taken:
                    taken.bind(("127.0.0.1", port))
        except OSError:
            continue
        return first
    raise RuntimeError(f"no {count} consecutive free ports")


class Launcher:
    """`python -m deploy.local` as a user runs it, its output read line by line."""

    def __init__(self, log_dir: Path) -> None:
        self.port = free_port_run(1)
        self.http_port = free_port_run(1)
        argv = [sys.executable, "-m", "deploy.local", "--port", str(self.port)]
        argv += ["--http-port", str(self.http_port)]
        argv += ["--metrics-port", str(free_port_run(3)), "--log-dir", str(log_dir)]
        env = {**os.environ, "KVGATE_MODEL": str(MODEL), "KVGATE_LOG_FORMAT": "text"}
        self.proc = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[str] = []
        self._new: queue.SimpleQueue[str] = queue.SimpleQueue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._new.put(line.rstrip("\n"))

    def wait_line(self, pattern: str, timeout_s: float) -> re.Match:
        """The first line from now on matching `pattern`; fails the test after timeout_s."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self._new.get(timeout=0.1)
            except queue.Empty:
                continue
            self.lines.append(line)
            found = re.search(pattern, line)
            if found:
                return found
        pytest.fail(f"expected a line matching {pattern!r}; the launcher said: {self.lines}")

    def rest(self) -> list[str]:
        """Every line said so far, once the launcher has exited."""
        while True:
            try:
                self.lines.append(self._new.get(timeout=1.0))
            except queue.Empty:
                return self.lines

    def child_pid(self, module: str) -> int:
        """The pid of the launcher's child running `python -m module`."""
        for pid in children(self.proc.pid):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if module.encode() in argv:
                return pid
        pytest.fail(f"the launcher has no child running {module}")


def children(pid: int) -> list[int]:
    """Pids of the live processes whose parent is `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


@pytest.fixture
def launcher(tmp_path: Path):
    launcher = Launcher(tmp_path / "logs")
    yield launcher
    if launcher.proc.poll() is None:
        launcher.proc.kill()
        launcher.proc.wait()


def test_a_dead_process_is_restarted_with_backoff_and_ctrl_c_stops_everything(launcher):
    launcher.wait_line(r"kvgate serving on", START_TIMEOUT_S)
    http_url = launcher.wait_line(r"OpenAI-compatible HTTP: (\S+)", LINE_TIMEOUT_S).group(1)
    assert http_url == f"http://127.0.0.1:{launcher.http_port}/v1", http_url
    models = httpx.get(f"{http_url}/models", timeout=10).json()["data"]
    assert [m["id"] for m in models] == [MODEL.name], models
    launcher.wait_line(r"auth is off: every caller is tenant 'default'", LINE_TIMEOUT_S)
    first_executor = launcher.child_pid("executor")
    os.kill(first_executor, signal.SIGKILL)
    launcher.wait_line(r"executor-0 exited \(signal SIGKILL\).*restarting in 0.5 s", LINE_TIMEOUT_S)
    second = int(launcher.wait_line(r"executor-0 restarted \(pid (\d+)", LINE_TIMEOUT_S).group(1))
    assert second != first_executor
    os.kill(second, signal.SIGKILL)  # dies again at once: a longer delay
    launcher.wait_line(r"executor-0 exited .*restarting in 1 s \(restart 2\)", LINE_TIMEOUT_S)
    launcher.wait_line(r"executor-0 restarted", LINE_TIMEOUT_S)
    os.kill(launcher.child_pid("gateway"), signal.SIGKILL)
    launcher.wait_line(r"gateway exited \(signal SIGKILL\)", LINE_TIMEOUT_S)
    launcher.wait_line(r"gateway restarted", LINE_TIMEOUT_S)

    def serves() -> bool:
        try:
            return len(generate(f"127.0.0.1:{launcher.port}", "Once", max_tokens=4).token_ids) == 4
        except grpc.RpcError:  # UNAVAILABLE until the restarted processes are up
            return False

    wait_for(serves, "a completion from the restarted stack", timeout_s=START_TIMEOUT_S)
    stack_pids = children(launcher.proc.pid)
    launcher.proc.send_signal(signal.SIGINT)
    assert launcher.proc.wait(60) == 0
    left = [pid for pid in stack_pids if Path(f"/proc/{pid}").exists() and not zombie(pid)]
    assert not left, f"processes left running after Ctrl-C: {left}"
    assert "stopping kvgate" in "\n".join(launcher.rest())


def zombie(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2] == "Z"


def test_a_process_that_cannot_start_ends_the_launcher_with_its_reason(tmp_path):
    """A bad executor flag under `make run`: exit 2 with the executor's own sentence, not a
    traceback of the launcher."""
    argv = [sys.executable, "-m", "deploy.local", "--port", str(free_port_run(1))]
    argv += ["--metrics-port", str(free_port_run(3)), "--log-dir", str(tmp_path)]
    argv += ["--http-port", str(free_port_run(1))]
    env = {**os.environ, "KVGATE_MODEL": str(MODEL), "KVGATE_LOG_FORMAT": "text",
           "KVGATE_TENSOR_PARALLEL_SIZE": "3"}  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "kvgate could not start: executor-0" in done.stderr
    assert "--tensor-parallel-size 3 does not divide" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout
