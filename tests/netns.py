"""Two network namespaces joined by a veth pair, for tests that need two "nodes".

Needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN) and iproute2's ``ip`` (Debian/Ubuntu
package ``iproute2``). Names carry a random suffix so that concurrent test runs do
not collide; the addresses are private and exist only inside the namespaces.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

SUBNET = "10.213.0"
PREFIX_LEN = 24


class NetnsUnavailable(RuntimeError):
    """This machine cannot create the namespaces (not root, no ``ip``, no netns support)."""


@dataclass(frozen=True)
class Node:
    """One namespace: its name, its veth end and that end's address."""

    netns: str
    ifname: str
    address: str

    def exec_prefix(self) -> list[str]:
        """Prefix a command with this to run it inside the namespace."""
        return ["ip", "netns", "exec", self.netns]


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise NetnsUnavailable(
            f"`ip {' '.join(args)}` failed (exit {result.returncode}): {result.stderr.strip()}"
        )


def _pids(netns: str) -> list[int]:
    result = subprocess.run(
        ["ip", "netns", "pids", netns], capture_output=True, text=True, timeout=30
    )
    return [int(p) for p in result.stdout.split() if p.isdigit()]


def kill_processes(netns: str, timeout_s: float = 10.0) -> None:
    """SIGKILL every process left in the namespace, and wait until none is left."""
    deadline = time.monotonic() + timeout_s
    while True:
        pids = _pids(netns)
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def _cleanup(nodes: list[Node], links: list[str]) -> None:
    for node in nodes:
        kill_processes(node.netns)
    for node in nodes:
        # Deleting a namespace destroys the veth end inside it, and so the pair.
        subprocess.run(["ip", "netns", "delete", node.netns], capture_output=True, timeout=30)
    for link in links:
        # A veth end that never moved into its namespace is still here.
        subprocess.run(["ip", "link", "delete", link], capture_output=True, timeout=30)


@contextlib.contextmanager
def two_nodes() -> Iterator[tuple[Node, Node]]:
    """Yield two namespaces joined by a veth pair (``SUBNET``.1 and .2); always cleaned up.

    Raises ``NetnsUnavailable`` with the reason when they cannot be made.
    """
    if shutil.which("ip") is None:
        raise NetnsUnavailable("`ip` not found (Debian/Ubuntu package iproute2)")
    suffix = secrets.token_hex(4)
    # Interface names are at most 15 characters: "tmn0" + 8 hex digits = 12.
    nodes = [
        Node(netns=f"traceml-n{i}-{suffix}", ifname=f"tmn{i}{suffix}", address=f"{SUBNET}.{i + 1}")
        for i in range(2)
    ]
    created: list[Node] = []
    links: list[str] = []
    try:
        try:
            for node in nodes:
                _ip("netns", "add", node.netns)
                created.append(node)
            a, b = nodes
            _ip("link", "add", a.ifname, "type", "veth", "peer", "name", b.ifname)
            links = [a.ifname, b.ifname]
            for node in nodes:
                _ip("link", "set", node.ifname, "netns", node.netns)
                _ip(
                    "-n",
                    node.netns,
                    "addr",
                    "add",
                    f"{node.address}/{PREFIX_LEN}",
                    "dev",
                    node.ifname,
                )
                _ip("-n", node.netns, "link", "set", "lo", "up")
                _ip("-n", node.netns, "link", "set", node.ifname, "up")
        except NetnsUnavailable as exc:
            raise NetnsUnavailable(f"cannot create network namespaces: {exc}") from exc
        yield nodes[0], nodes[1]
    finally:
        _cleanup(created, links)
