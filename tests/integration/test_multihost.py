"""Every process on a host of its own (network namespaces on a bridge, tests/integration/netns),
talking over addresses that are not loopback: 50 streams through two gateways, one executor's
host unplugged mid-stream, every stream completes. Root only (it creates namespaces)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections import defaultdict
from pathlib import Path

import pytest

from deploy.stack import ROOT, Stack, StackConfig
from tests.helpers import wait_for
from tests.integration.conftest import MODEL
from tests.integration.multihost_client import PROMPTS
from tests.integration.netns import Hosts

STREAMS = 50
MAX_TOKENS = 480  # the model's 512 positions hold the prompt and these
HOST_NAMES = ["redis", "scheduler", "executor-1", "executor-2", "gateway-1", "gateway-2", "client"]
PORT = 50051
SINK_PORT = 50052
# Few batch slots: a stream waits its turn, so the load is still running at the unplugging.
EXECUTOR_FLAGS = ["--num-gpu-blocks", "512", "--max-num-seqs", "16", "--torch-threads", "1"]
SLOW_STEP_S = 0.01  # a 480-token stream takes at least 4.8 s until the unplugging
# After the unplugging the surviving executor's 16 slots run the streams of both in turns: a
# re-queued stream waits for a slot as long as the client waits for all (the default 30 s ran
# out on a loaded machine, failing streams DEADLINE_EXCEEDED).
WAIT_S = 240.0

# Root is needed to create namespaces (CI runs as root); iproute2 comes with `make setup`, so
# a missing `ip` fails the test rather than skipping it.
pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="creates network namespaces: needs root (CI runs as root)"
)


@pytest.fixture
def hosts():
    assert shutil.which("ip"), "iproute2's ip is missing: `make setup` installs it"
    hosts = Hosts(HOST_NAMES)
    try:
        hosts.up()
        yield hosts
    finally:
        hosts.down()


@pytest.fixture
def cluster(hosts, tmp_path):
    stack = Stack(StackConfig(model=str(MODEL), log_dir=tmp_path / "logs", log_format="text"))
    slow_steps(tmp_path).touch()
    try:
        start_cluster(stack, hosts, slow_steps(tmp_path))
        yield stack
    finally:
        stack.stop_all()


def log_has(stack: Stack, name: str, needle: str) -> bool:
    path = stack.log_path(name)
    return path.exists() and needle in path.read_text()


def slow_steps(folder: Path) -> Path:
    """While this file exists, each executor step sleeps SLOW_STEP_S first (engine/faults.py):
    stories260K's 480 tokens would otherwise end in about a second, before the test sees the
    load under way."""
    return folder / "slow-steps"


def start_cluster(stack: Stack, hosts: Hosts, slow_file: Path) -> None:
    """Redis, a scheduler, two executors and two gateways, each on its own host."""
    redis_url = f"redis://{hosts.addresses['redis']}:6379/0"
    python = [sys.executable, "-m"]
    common = ["--redis-url", redis_url, "--metrics-port", "-1"]
    redis = [shutil.which("redis-server"), "--bind", hosts.addresses["redis"], "--port", "6379"]
    redis += ["--protected-mode", "no", "--save", "", "--appendonly", "no"]
    stack.spawn("redis", hosts.command("redis", redis))
    stack.spawn("scheduler", hosts.command("scheduler", [*python, "scheduler", *common]))
    for name in ("executor-1", "executor-2"):
        argv = [*python, "executor", "--model", str(MODEL), "--executor-id", name, *common]
        faults = {"KVGATE_FAULTS": f"slow_while_file={slow_file}:{SLOW_STEP_S}"}
        stack.spawn(name, hosts.command(name, argv + EXECUTOR_FLAGS), faults)
    for name in ("gateway-1", "gateway-2"):
        address = hosts.addresses[name]
        argv = [*python, "gateway", "--model", str(MODEL), "--host", address, "--port", str(PORT)]
        argv += ["--internal-host", address, "--internal-port", str(SINK_PORT), "--auth", "off"]
        argv += ["--queue-timeout-s", str(WAIT_S)]
        argv += common
        stack.spawn(name, hosts.command(name, argv))
    ready = {
        "scheduler": "is the leader",
        "executor-1": "executor executor-1 serving",
        "executor-2": "executor executor-2 serving",
        "gateway-1": "gateway serving on",
        "gateway-2": "gateway serving on",
    }
    for name, needle in ready.items():
        wait_for(
            lambda n=name, s=needle: log_has(stack, n, s), f"{name}: {needle!r}", timeout_s=120.0
        )


class Client:
    """The client host's streams (tests/integration/multihost_client.py), event by event."""

    def __init__(self, hosts: Hosts) -> None:
        targets = ",".join(f"{hosts.addresses[g]}:{PORT}" for g in ("gateway-1", "gateway-2"))
        argv = [sys.executable, "-m", "tests.integration.multihost_client", "--targets", targets]
        argv += ["--streams", str(STREAMS), "--max-tokens", str(MAX_TOKENS)]
        self.proc = subprocess.Popen(
            hosts.command("client", argv), cwd=ROOT, stdout=subprocess.PIPE, text=True
        )
        self.events: dict[str, dict[int, dict]] = defaultdict(dict)
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            event = json.loads(line)
            with self._lock:
                self.events[event["event"]][event["stream"]] = event

    def count(self, event: str) -> int:
        with self._lock:
            return len(self.events[event])

    def wait(self, stack: Stack, timeout_s: float = WAIT_S) -> int:
        """The client's exit status; fails naming the streams still open, with the gateways'
        and the scheduler's last log lines, if it has not ended within `timeout_s`."""
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with self._lock:
                ended = set(self.events["done"]) | set(self.events["failed"])
            open_streams = sorted(set(range(STREAMS)) - ended)
            tails = {
                name: stack.log_path(name).read_text().splitlines()[-15:]
                for name in ("scheduler", "gateway-1", "gateway-2", "executor-2")
            }
            pytest.fail(f"streams {open_streams} still open {timeout_s:g} s after the unplugging; "
                        f"last log lines: {json.dumps(tails, indent=1)}")  # fmt: skip


def test_streams_survive_an_executor_host_unplugged_mid_stream(hosts, cluster, tmp_path):
    client = Client(hosts)
    try:
        # Mid-stream: both executors run streams, many have tokens, none has finished.
        wait_for(
            lambda: client.count("first") >= STREAMS // 2, "half the streams going", timeout_s=120.0
        )
        wait_for(
            lambda: log_has(cluster, "executor-1", "request admitted"), "work on it", timeout_s=30.0
        )
        assert client.count("done") == 0, "the load ended before the unplugging"
        hosts.pull_the_plug("executor-1")
        slow_steps(tmp_path).unlink()  # the rest at full speed
        assert client.wait(cluster) == 0
    finally:
        if client.proc.poll() is None:
            client.proc.kill()
    failed = client.events["failed"]
    assert not failed, f"{len(failed)} streams failed: {list(failed.values())[:3]}"
    done = client.events["done"]
    assert sorted(done) == list(range(STREAMS)), f"streams without an end: {STREAMS - len(done)}"
    short = [
        e for e in done.values() if e["tokens"] != MAX_TOKENS or e["finish_reason"] != "length"
    ]
    assert not short, f"{len(short)} streams ended early: {short[:2]}"
    resumed = [g for g in ("gateway-1", "gateway-2") if log_has(cluster, g, "lost its executor")]
    assert resumed, "no stream was running on executor-1 when its host went away"
    # Greedy: a resumed stream's text is the undisturbed one of the same prompt.
    for index, prompt in enumerate(PROMPTS):
        texts = {done[i]["text"] for i in range(index, STREAMS, len(PROMPTS))}
        assert len(texts) == 1, f"{prompt!r}: {len(texts)} different completions"
