"""Redis with Sentinel for a local stack: a master, a replica and sentinels on loopback.

Every kvgate process reaches it by the URL redis+sentinel://SENTINELS/kvgate, and follows a
failover through redis-py's Sentinel support (common/redis_conn.py). Both servers keep an
append-only file. The sentinels judge the master down after DOWN_AFTER_MS without an answer
and, with QUORUM of them agreeing, promote the replica; a former master that comes back is
turned into a replica of the new one by the sentinels.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import redis

from common.redis_url import SENTINEL_SCHEME

MASTER_NAME = "kvgate"
# How long a server goes unanswered before a sentinel judges it down. A sentinel counts the
# other sentinels' votes that a master is down for 5 s after they came, and after a failover
# it counts them for the promoted replica too: at 1 s, a slow first answer of a just-promoted
# master (a loaded machine) started a second failover at once, back to a server that had not
# synced. At 6 s those votes have expired, and a stall of a few seconds (a fork, a slow disk)
# is ridden out.
DOWN_AFTER_MS = 6000
FAILOVER_TIMEOUT_MS = 3000
QUORUM = 2


class Spawner(Protocol):
    """What RedisHA needs of deploy.stack.Stack."""

    def spawn(self, name: str, argv: list[str], extra_env: dict[str, str] | None = None): ...


def server_argv(binary: str, port: int, folder: Path) -> list[str]:
    """A redis-server on loopback with an append-only file in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    return [
        binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder.resolve()),
        "--save", "", "--appendonly", "yes", "--appendfsync", "everysec",
    ]  # fmt: skip


@dataclass(slots=True)
class RedisHA:
    """The processes of one Sentinel setup, by the stack's process names: redis (the first
    master), redis-replica, sentinel-0..N-1."""

    folder: Path
    master_port: int
    replica_port: int
    sentinel_ports: list[int] = field(default_factory=list)

    @property
    def url(self) -> str:
        sentinels = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        return f"{SENTINEL_SCHEME}://{sentinels}/{MASTER_NAME}/0"

    def ports(self) -> dict[str, int]:
        """Each server's port by its process name."""
        return {"redis": self.master_port, "redis-replica": self.replica_port}

    def start(self, stack: Spawner, binary: str) -> None:
        """Starts the master, the replica and the sentinels, and waits until every sentinel
        knows the replica and the other sentinels (what a failover needs)."""
        stack.spawn("redis", server_argv(binary, self.master_port, self.folder / "redis"))
        replica = server_argv(binary, self.replica_port, self.folder / "redis-replica")
        stack.spawn("redis-replica", [*replica, "--replicaof", "127.0.0.1", str(self.master_port)])
        for index, port in enumerate(self.sentinel_ports):
            stack.spawn(f"sentinel-{index}", [binary, str(self._sentinel_conf(index, port)),
                                              "--sentinel"])  # fmt: skip
        deadline = time.monotonic() + 60.0
        while not self._ready():
            if time.monotonic() > deadline:
                raise TimeoutError("redis sentinels: not ready after 60 s")
            time.sleep(0.2)

    def _sentinel_conf(self, index: int, port: int) -> Path:
        folder = self.folder / f"sentinel-{index}"
        folder.mkdir(parents=True, exist_ok=True)
        conf = folder / "sentinel.conf"
        conf.write_text(
            f"port {port}\nbind 127.0.0.1\ndir {folder.resolve()}\n"
            f"sentinel monitor {MASTER_NAME} 127.0.0.1 {self.master_port} {QUORUM}\n"
            f"sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}\n"
            f"sentinel failover-timeout {MASTER_NAME} {FAILOVER_TIMEOUT_MS}\n"
            f"sentinel parallel-syncs {MASTER_NAME} 1\n"
        )
        return conf

    def _ready(self) -> bool:
        others = len(self.sentinel_ports) - 1
        try:
            for port in self.sentinel_ports:
                sentinel = redis.Redis(port=port, socket_timeout=1.0)
                if not sentinel.sentinel_slaves(MASTER_NAME):
                    return False
                if len(sentinel.sentinel_sentinels(MASTER_NAME)) < others:
                    return False
        except (redis.ConnectionError, redis.ResponseError):
            return False
        return True

    def restart_argv(self, name: str, binary: str) -> list[str]:
        """The command that starts server `name` (redis, redis-replica) again after it died:
        a replica of the master the sentinels know now, or a master on its append-only file
        while they still take `name` for the master (they demote it if they fail over).

        Not its first command: a promoted replica started again as a replica of the former
        master, itself now a replica of it, makes a loop with no master that the sentinels
        cannot repair (no replica is in sync to promote).
        """
        port = self.ports()[name]
        argv = server_argv(binary, port, self.folder / name)
        master = self.master_port_now()
        if master is None or master == port:
            return argv
        return [*argv, "--replicaof", "127.0.0.1", str(master)]

    def master_port_now(self) -> int | None:
        """The master's port as the first sentinel that answers sees it."""
        for port in self.sentinel_ports:
            try:
                host_port = redis.Redis(
                    port=port, socket_timeout=1.0
                ).sentinel_get_master_addr_by_name(MASTER_NAME)
            except redis.ConnectionError:
                continue
            if host_port:
                return int(host_port[1])
        return None

    def master_name_now(self) -> str | None:
        """The process name of the master now (redis or redis-replica)."""
        port = self.master_port_now()
        return next((name for name, p in self.ports().items() if p == port), None)
