"""A local kvgate stack as child processes: redis-server, scheduler, executors, gateways.

Used by `make run` (deploy/local.py), the integration tests and bench/serve.py.
Every child gets its own session (a terminal's Ctrl-C reaches only the
launcher, which stops them in order) and dies with the launcher (PR_SET_PDEATHSIG),
so no process is left behind.
"""

from __future__ import annotations

import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis

from common.config import env_str
from common.health import probe
from common.keys import RedisKeys
from common.redis_conn import connect_sync
from deploy.redis_ha import RedisHA, server_argv
from protos.kvgate.v1 import internal_pb2

ROOT = Path(__file__).resolve().parent.parent
# Seconds a child gets to exit after SIGTERM before SIGKILL.
STOP_GRACE_S = 10.0
_PR_SET_PDEATHSIG = 1
DEFAULT_LOG_DIR = ROOT / ".run" / "logs"


# Ports handed out by free_port in this process, never handed out twice.
_HANDED_OUT: set[int] = set()


def _ephemeral_low() -> int:
    """Returns: the lowest port the kernel gives outgoing connections (Linux; 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_range() -> tuple[int, int]:
    """Returns: the ports free_port picks from, [low, high): KVGATE_FREE_PORTS=LOW-HIGH
    (inclusive) when set, so that launchers sharing a machine can each have their own; else
    20000 up to the kernel's ephemeral range."""
    spec = os.environ.get("KVGATE_FREE_PORTS", "")
    if not spec:
        low, high = 20000, _ephemeral_low()
        return (1024, high) if high - low < 1000 else (low, high)
    try:
        low, high = (int(part) for part in spec.split("-"))
    except ValueError:
        raise ValueError(f"KVGATE_FREE_PORTS must be LOW-HIGH, got {spec!r}") from None
    if not 1024 <= low < high <= 65535:
        raise ValueError(f"KVGATE_FREE_PORTS must lie in 1024-65535 with LOW < HIGH: {spec!r}")
    return low, high + 1


def free_port() -> int:
    """Returns: a TCP port free on 127.0.0.1 right now, from free_port_range (by default
    below the kernel's ephemeral range).

    A port from bind(("127.0.0.1", 0)) lies in the range the kernel also gives every
    outgoing connection as its source port, so between this call and the child's bind
    another process's connection may take it (the child then exits: "could not
    listen"). Ports below that range are only ever taken by a listener on purpose.
    """
    low, high = free_port_range()
    for _ in range(1000):
        port = random.randrange(low, high)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free TCP port on 127.0.0.1 in {low}..{high - 1}")


def find_redis_server() -> str:
    """Returns: the redis-server binary; installs it with apt-get when missing."""
    found = shutil.which("redis-server")
    if found:
        return found
    print("redis-server not found: installing it with apt-get", file=sys.stderr)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-q", "redis-server"], check=True, env=env)
    found = shutil.which("redis-server")
    if not found:
        raise RuntimeError("redis-server is still missing after apt-get install")
    return found


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def wait_until(ready: Callable[[], bool], timeout_s: float, what: str, proc=None) -> None:
    """Polls `ready` until it is true; raises TimeoutError naming `what` (or when proc exits)."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: the process exited with status {proc.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not ready after {timeout_s:.0f} s")
        time.sleep(0.05)


def co_located_torch_threads() -> int:
    """Model threads for an executor sharing this machine with the rest of the stack.

    One core is left to the gateway, scheduler and Redis: when every core runs a model
    thread, each of the executor's parallel regions waits for whichever core the others hold.
    """
    return max(1, (os.cpu_count() or 1) - 1)


# What kvgate's processes and `kvgate admin` need of Redis (docs/security.md): every command
# but the dangerous ones (KEYS, FLUSHALL, CONFIG, DEBUG, ...), on kvgate's keys only.
KVGATE_ACL_RULES = "~kvgate:* +@all -@dangerous"


@dataclass(frozen=True, slots=True)
class RedisSecurity:
    """A redis-server that serves TLS only and knows one ACL user, limited to kvgate's keys;
    its default user is off. With `client_cert` and `client_key` Redis asks every client for
    a certificate of `ca` (mutual TLS), and the URL hands kvgate's processes that pair."""

    ca: str  # PEM files: the CA of the server's certificate, the certificate, its key
    cert: str
    key: str
    user: str = "kvgate"
    password: str = ""
    acl_file: str = ""  # written by `server_args`
    client_cert: str = ""  # PEM files: the clients' certificate and key; empty: no mutual TLS
    client_key: str = ""

    def server_args(self, port: int) -> list[str]:
        Path(self.acl_file).write_text(
            f"user default off\nuser {self.user} on >{self.password} {KVGATE_ACL_RULES}\n"
        )
        return [
            "--port", "0", "--tls-port", str(port), "--tls-cert-file", self.cert,
            "--tls-key-file", self.key, "--tls-ca-cert-file", self.ca,
            "--tls-auth-clients", "yes" if self.client_cert else "no", "--aclfile", self.acl_file,
        ]  # fmt: skip

    def url(self, port: int) -> str:
        query = f"ssl_ca_certs={self.ca}"
        if self.client_cert:
            query += f"&ssl_certfile={self.client_cert}&ssl_keyfile={self.client_key}"
        return f"rediss://{self.user}:{self.password}@127.0.0.1:{port}/0?{query}"


@dataclass(slots=True)
class StackConfig:
    """How the local stack is laid out."""

    model: str
    host: str = "127.0.0.1"
    port: int = 50051  # public gateway port of the first gateway
    http_port: int = -1  # the first gateway's OpenAI-compatible HTTP port; -1: none
    redis_port: int = 0  # 0: a free port
    log_dir: Path = DEFAULT_LOG_DIR
    # Redis's data folder (its append-only file), emptied when the stack starts, kept when
    # Redis alone restarts; None: log_dir/redis.
    redis_dir: Path | None = None
    # 0: one redis-server; N: a master, a replica and N sentinels (deploy/redis_ha.py)
    redis_sentinels: int = 0
    redis_prefix: str = "kvgate:"
    executor_flags: list[str] = field(default_factory=list)
    executor_env: dict[str, str] = field(default_factory=dict)  # besides the stack's own
    scheduler_flags: list[str] = field(default_factory=list)
    gateway_flags: list[str] = field(default_factory=list)
    start_timeout_s: float = 120.0
    # json or text, for every process; default: the user's KVGATE_LOG_FORMAT, else json.
    log_format: str = field(default_factory=lambda: env_str("KVGATE_LOG_FORMAT", "json"))
    # Fixed /metrics port by process name ("gateway", "scheduler", "executor-0"); others: free.
    metrics_ports: dict[str, int] = field(default_factory=dict)
    auth: str = "off"  # the gateways' --auth: a local stack takes every caller as "default"
    redis_security: RedisSecurity | None = None  # None: plain TCP, no password


class Stack:
    """Starts and stops the processes of one local stack."""

    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.procs: dict[str, subprocess.Popen] = {}
        # When each executor was last started (Unix ms): its first heartbeat comes after it.
        self._executor_started_ms: dict[str, int] = {}
        self.argvs: dict[str, list[str]] = {}  # the command each process was started with
        self.envs: dict[str, dict[str, str]] = {}  # environment variables it got besides
        self.redis_port = config.redis_port or free_port()
        if config.redis_security is None:
            self.redis_url = f"redis://127.0.0.1:{self.redis_port}/0"
        else:
            self.redis_url = config.redis_security.url(self.redis_port)
        self.ha: RedisHA | None = None
        self.keys = RedisKeys(config.redis_prefix)
        self.gateway_ports: dict[str, int] = {}
        self.metrics_ports: dict[str, int] = {}  # /metrics port of each process by name
        self.health_addresses: dict[str, str] = {}  # grpc.health.v1 of each process by name
        config.log_dir.mkdir(parents=True, exist_ok=True)
        self.redis_dir = config.redis_dir or config.log_dir / "redis"
        if config.redis_sentinels:
            sentinel_ports = [free_port() for _ in range(config.redis_sentinels)]
            self.ha = RedisHA(self.redis_dir, self.redis_port, free_port(), sentinel_ports)
            self.redis_url = self.ha.url

    @property
    def address(self) -> str:
        """The public address of the first gateway."""
        return f"{self.config.host}:{self.config.port}"

    def redis(self) -> redis.Redis:
        """A client of the stack's Redis (its master now, with sentinels)."""
        if self.ha is not None:
            return connect_sync(self.redis_url, timeout_s=5.0)
        return redis.Redis.from_url(self.redis_url, socket_timeout=5.0)

    def start_all(self, num_executors: int = 1) -> None:
        """Starts redis (on an empty data folder), the scheduler, executors and the gateway,
        and waits until all serve."""
        shutil.rmtree(self.redis_dir, ignore_errors=True)
        self.start_redis()
        self.start_scheduler("scheduler")
        for index in range(num_executors):
            self.start_executor(f"executor-{index}", wait=False)
        self.start_gateway("gateway", self.config.port)
        for index in range(num_executors):
            self.wait_executor(f"executor-{index}")
        # Executors slower to load than the gateway's grace leave it NOT_SERVING for a moment.
        health = self.health_addresses["gateway"]
        wait_until(lambda: gateway_serving(health), 10.0, "gateway", self.procs["gateway"])

    def log_path(self, name: str) -> Path:
        """Where the child process `name` logs."""
        return self.config.log_dir / f"{name}.log"

    def spawn(
        self, name: str, argv: list[str], extra_env: dict[str, str] | None = None
    ) -> subprocess.Popen:
        """Starts one child process logging to log_dir/NAME.log."""
        log_file = open(self.log_path(name), "ab")
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "KVGATE_REDIS_URL": self.redis_url,
            "KVGATE_REDIS_PREFIX": self.config.redis_prefix,
            "KVGATE_LOG_FORMAT": self.config.log_format,
            **(extra_env or {}),
        }
        proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        log_file.close()
        self.procs[name] = proc
        self.argvs[name] = argv
        self.envs[name] = dict(extra_env or {})
        return proc

    def respawn(self, name: str) -> subprocess.Popen:
        """Starts `name` again with the command (and environment) it was last started with,
        a Redis server of a Sentinel setup in the role the sentinels give it now
        (RedisHA.restart_argv); does not wait."""
        argv = self.argvs[name]
        if self.ha is not None and name in self.ha.ports():
            argv = self.ha.restart_argv(name, argv[0])
        return self.spawn(name, argv, self.envs.get(name))

    def start_redis(self) -> None:
        """Starts redis-server with an append-only file in redis_dir, fsynced every second
        (what a Redis crash can lose: about the last second of writes); a restart on the same
        folder reloads it. With sentinels: the master, its replica and the sentinels. Waits
        until it answers."""
        if self.ha is not None:
            self.ha.start(self, find_redis_server())
            return
        binary, _, _, *rest = server_argv(find_redis_server(), self.redis_port, self.redis_dir)
        ports = ["--port", str(self.redis_port)]
        if self.config.redis_security is not None:
            ports = self.config.redis_security.server_args(self.redis_port)
        proc = self.spawn("redis", [binary, *ports, *rest])
        wait_until(self._redis_answers, 30.0, "redis-server", proc)

    def _redis_answers(self) -> bool:
        try:
            return bool(self.redis().ping())
        except (redis.ConnectionError, redis.exceptions.BusyLoadingError):
            return False

    def start_scheduler(
        self, name: str, wait: bool = True, extra_flags: list[str] | None = None
    ) -> None:
        """Starts a scheduler with the stack's scheduler flags, then `extra_flags`; waits
        until a leader holds the lock unless told not to."""
        argv = [
            sys.executable,
            "-m",
            "scheduler",
            "--scheduler-id",
            name,
            *self._metrics_flags(name),
            *self._health_flags(name),
            *self.config.scheduler_flags,
            *(extra_flags or []),
        ]
        proc = self.spawn(name, argv)
        if wait:
            leader = self.keys.scheduler_leader
            wait_until(lambda: self.redis().exists(leader) == 1, 30.0, name, proc)

    def start_executor(
        self,
        executor_id: str,
        wait: bool = True,
        extra_env: dict[str, str] | None = None,
        extra_flags: list[str] | None = None,
    ) -> None:
        """Starts an executor with the stack's executor flags, then `extra_flags`."""
        argv = [
            sys.executable,
            "-m",
            "executor",
            "--model",
            self.config.model,
            "--executor-id",
            executor_id,
            "--torch-threads",
            str(co_located_torch_threads()),
            *self._metrics_flags(executor_id),
            *self._health_flags(executor_id),
            *self.config.executor_flags,
            *(extra_flags or []),
        ]
        self._executor_started_ms[executor_id] = int(time.time() * 1000)
        self.spawn(executor_id, argv, {**self.config.executor_env, **(extra_env or {})})
        if wait:
            self.wait_executor(executor_id)

    def wait_executor(self, executor_id: str) -> None:
        """Waits for the first heartbeat of the executor process started last under this id (a
        killed predecessor's status stays in Redis until its TTL runs out)."""
        started_ms = self._executor_started_ms.get(executor_id, 0)

        def ready() -> bool:
            status = self.executor_status(executor_id)
            return status is not None and status.heartbeat_unix_ms >= started_ms

        wait_until(ready, self.config.start_timeout_s, executor_id, self.procs[executor_id])

    def executor_status(self, executor_id: str) -> internal_pb2.ExecutorStatus | None:
        """Returns: the executor's last heartbeat, None when it has none alive."""
        raw = self.redis().get(self.keys.executor_status(executor_id))
        return None if raw is None else internal_pb2.ExecutorStatus.FromString(raw)

    def start_gateway(self, name: str, port: int, extra_flags: list[str] | None = None) -> None:
        """Starts a gateway on `port` with the stack's gateway flags, then `extra_flags`."""
        argv = [
            sys.executable,
            "-m",
            "gateway",
            "--model",
            self.config.model,
            "--host",
            self.config.host,
            "--port",
            str(port),
            "--auth",
            self.config.auth,
            *self._metrics_flags(name),
            *self._health_flags(name),
            *self._http_flags(name),
            *self.config.gateway_flags,
            *(extra_flags or []),
        ]
        proc = self.spawn(name, argv)
        self.gateway_ports[name] = port
        # The health port: the public one may ask for TLS and client certificates.
        address = self.health_addresses[name]
        wait_until(lambda: gateway_serving(address), self.config.start_timeout_s, name, proc)
        if self._http_flags(name):  # it starts HTTP after gRPC: wait for that too
            http = (self.config.host, self.config.http_port)
            wait_until(lambda: listening(*http), self.config.start_timeout_s, f"{name} HTTP", proc)

    def _http_flags(self, name: str) -> list[str]:
        """The first gateway serves HTTP on the stack's http_port, when one is given."""
        if name != "gateway" or self.config.http_port == -1:
            return []
        return ["--http-host", self.config.host, "--http-port", str(self.config.http_port)]

    @property
    def http_url(self) -> str:
        """The first gateway's OpenAI-compatible base URL (http_port set)."""
        return f"http://{self.config.host}:{self.config.http_port}/v1"

    def _metrics_flags(self, name: str) -> list[str]:
        port = self.config.metrics_ports.get(name) or free_port()
        self.metrics_ports[name] = port
        return ["--metrics-port", str(port)]

    def _health_flags(self, name: str) -> list[str]:
        port = free_port()
        self.health_addresses[name] = f"127.0.0.1:{port}"
        return ["--health-port", str(port)]

    def health(self, name: str, service: str = "") -> str:
        """The grpc.health.v1 status name process `name` gives for `service` now."""
        return probe(self.health_addresses[name], service, timeout_s=1.0)

    def stop(self, name: str, sig: int = signal.SIGTERM, timeout_s: float = STOP_GRACE_S) -> int:
        """Signals one child and waits for it (SIGKILL after timeout_s). Returns: its status."""
        proc = self.procs.pop(name)
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return proc.returncode

    def stop_all(self) -> None:
        """Stops gateways, executors, schedulers, then redis."""
        order = sorted(
            self.procs,
            key=lambda n: (n.startswith(("redis", "sentinel")), n.startswith("scheduler")),
        )
        for name in order:
            self.stop(name)


def listening(host: str, port: int) -> bool:
    """Returns: whether something accepts TCP connections on host:port."""
    try:
        socket.create_connection((host, port), timeout=1.0).close()
    except OSError:
        return False
    return True


def gateway_serving(address: str) -> bool:
    """Returns: whether the gateway at `address` reports grpc.health SERVING."""
    return probe(address, timeout_s=1.0) == "SERVING"
