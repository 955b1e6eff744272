"""Two "hosts" on one machine for multi-node tests: two network namespaces joined by a veth pair.

    node a: namespace ``cope2n-<pid>-a``, address 10.203.0.1/24 on its veth end ``cope0``, loopback up
    node b: namespace ``cope2n-<pid>-b``, address 10.203.0.2/24 on its veth end ``cope0``, loopback up

The namespaces have no other interface and no route: a process in them reaches its own loopback and the other
node's address, nothing outside. Each node runs its processes with ``ip netns exec``, with ``TMPDIR`` and
``TMUX_TMPDIR`` set to a folder of its own (``/tmp/c2n<pid>/<a|b>``), as two hosts have two ``/tmp`` (Ray's session
folders, tmux sockets); the rest of the filesystem is shared, as a cluster's shared filesystem is. The host name
resolves to 127.0.0.1 in both, so gloo needs ``GLOO_SOCKET_IFNAME``: the node scripts set it from ``NODE_IP``
(scripts/lib/common.sh); both veth ends are named ``cope0``.

Teardown (``TwoNodes.close``, also on a failed or interrupted test): every process in either namespace is killed
(``ip netns pids``), then the namespaces and the temp folders are removed. Namespaces left by a killed test run
(their pid gone) are removed when the next one starts. Needs root (``ip netns add``); ``available()`` says why not.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

PREFIX = "cope2n-"
SUBNET = "10.203.0"
IFNAME = "cope0"


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def available() -> Optional[str]:
    """None when namespaces can be made here, else why not (a skip reason)."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    probe = f"{PREFIX}probe-{os.getpid()}"
    made = ip("netns", "add", probe, check=False)
    if made.returncode:
        return f"ip netns add failed: {made.stderr.strip()}"
    ip("netns", "del", probe, check=False)
    return None


def namespace_pids(ns: str) -> List[int]:
    out = ip("netns", "pids", ns, check=False).stdout
    return [int(p) for p in out.split()]


def kill_namespace(ns: str, sig: int = signal.SIGKILL) -> List[int]:
    """Kills every process in ``ns``; returns their pids."""
    pids = namespace_pids(ns)
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return pids


def remove_stale() -> None:
    """Namespaces of test runs whose process is gone."""
    for line in ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(PREFIX):
            continue
        owner = name[len(PREFIX):].split("-")[0]
        if owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
            kill_namespace(name)
            ip("netns", "del", name, check=False)


@dataclass
class Node:
    name: str  # "a" / "b"
    ns: str
    address: str
    tmp: str

    def env(self, **extra: str) -> Dict[str, str]:
        return {**os.environ, "TMPDIR": self.tmp, "TMUX_TMPDIR": self.tmp, "NODE_IP": self.address, **extra}

    def argv(self, *cmd: str) -> List[str]:
        return ["ip", "netns", "exec", self.ns, *cmd]

    def run(self, *cmd: str, timeout: float = 120, env: Optional[Dict[str, str]] = None,
            cwd: Optional[str] = None) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(*cmd), env=env or self.env(), cwd=cwd, capture_output=True, text=True,
                              timeout=timeout)

    def popen(self, *cmd: str, log_path: str, env: Optional[Dict[str, str]] = None,
              cwd: Optional[str] = None) -> subprocess.Popen:
        log = open(log_path, "w")
        try:
            return subprocess.Popen(self.argv(*cmd), env=env or self.env(), cwd=cwd, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            log.close()

    def pids(self) -> List[int]:
        return namespace_pids(self.ns)


class TwoNodes:
    def __init__(self) -> None:
        remove_stale()
        tag = f"{PREFIX}{os.getpid()}"
        root = f"/tmp/c2n{os.getpid()}"  # short: Ray's unix socket paths live under TMPDIR (108-byte limit)
        self.root = root
        self.nodes = [Node(n, f"{tag}-{n}", f"{SUBNET}.{i}", f"{root}/{n}") for i, n in ((1, "a"), (2, "b"))]
        a, b = self.nodes
        try:
            for node in self.nodes:
                ip("netns", "add", node.ns)
                os.makedirs(node.tmp, exist_ok=True)
            veth_a, veth_b = f"c2n{os.getpid() % 100000}a", f"c2n{os.getpid() % 100000}b"
            ip("link", "add", veth_a, "type", "veth", "peer", "name", veth_b)
            for node, veth in ((a, veth_a), (b, veth_b)):
                ip("link", "set", veth, "netns", node.ns)
                ip("-n", node.ns, "link", "set", veth, "name", IFNAME)
                ip("-n", node.ns, "addr", "add", f"{node.address}/24", "dev", IFNAME)
                ip("-n", node.ns, "link", "set", IFNAME, "up")
                ip("-n", node.ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for node in self.nodes:
            for _ in range(3):  # a dying process may still spawn (Ray's monitors restart workers)
                if not kill_namespace(node.ns):
                    break
                time.sleep(0.5)
            ip("netns", "del", node.ns, check=False)  # deletes its veth end, and with it the pair
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "TwoNodes":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
