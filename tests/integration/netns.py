"""Hosts for tests: Linux network namespaces joined by veth pairs on one bridge.

The bridge lives in a namespace of its own, with no link to anything else, so every address
given here exists only inside these namespaces: nothing is added to the machine's own network,
and no packet can leave. Each host has its loopback and one interface, eth0, with
SUBNET.N/24. Needs root (CAP_NET_ADMIN) and iproute2.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

# A private range used only between the namespaces below.
SUBNET = "10.250.7"
NETNS_DIR = Path("/var/run/netns")
PREFIX = "kvgt"  # namespace names: kvgt<pid>-<host>


def ip(*args: str) -> str:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result.stdout


def remove_namespace(name: str) -> None:
    """SIGKILLs every process in the namespace, then deletes it (its links go with it)."""
    pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout
    for pid in pids.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    subprocess.run(["ip", "netns", "del", name], capture_output=True)


def remove_stale_namespaces() -> None:
    """Deletes the namespaces of earlier runs whose process is gone (a run killed mid-test)."""
    if not NETNS_DIR.is_dir():
        return
    pattern = re.compile(rf"^{PREFIX}(\d+)-")
    for entry in NETNS_DIR.iterdir():
        found = pattern.match(entry.name)
        if found and not Path(f"/proc/{found.group(1)}").exists():
            remove_namespace(entry.name)


class Hosts:
    """Named hosts, each a network namespace with an address on the shared bridge."""

    def __init__(self, names: list[str]) -> None:
        self._prefix = f"{PREFIX}{os.getpid()}-"
        self.bridge = f"{self._prefix}bridge"
        self.addresses = {name: f"{SUBNET}.{index + 2}" for index, name in enumerate(names)}
        self._ports = {name: f"port{index}" for index, name in enumerate(names)}
        self._made: list[str] = []

    def namespace(self, host: str) -> str:
        return f"{self._prefix}{host}"

    def up(self) -> None:
        """Creates the bridge and every host, up and addressed."""
        remove_stale_namespaces()
        self._add_namespace(self.bridge)
        ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
        ip("-n", self.bridge, "link", "set", "br0", "up")
        for host, address in self.addresses.items():
            namespace = self.namespace(host)
            self._add_namespace(namespace)
            port = self._ports[host]
            ip("link", "add", "eth0", "netns", namespace, "type", "veth",
               "peer", "name", port, "netns", self.bridge)  # fmt: skip
            ip("-n", self.bridge, "link", "set", port, "master", "br0", "up")
            ip("-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
            ip("-n", namespace, "link", "set", "eth0", "up")
            ip("-n", namespace, "link", "set", "lo", "up")

    def command(self, host: str, argv: list[str]) -> list[str]:
        """`argv` run on `host`."""
        return ["ip", "netns", "exec", self.namespace(host), *argv]

    def pull_the_plug(self, host: str) -> None:
        """The host vanishes: its bridge port goes down first (no FIN or RST reaches anyone,
        as when a machine loses power), then its processes and namespace are removed."""
        ip("-n", self.bridge, "link", "set", self._ports[host], "down")
        remove_namespace(self.namespace(host))

    def down(self) -> None:
        """Removes every namespace made, processes and all; safe to call more than once."""
        for name in reversed(self._made):
            remove_namespace(name)
        self._made.clear()

    def _add_namespace(self, name: str) -> None:
        ip("netns", "add", name)
        self._made.append(name)
