"""Hosts simulated on one Linux kernel: a network namespace per host, one switch between them.

The scale-out tests (tests/cluster/) and `kvcraft bench remote --hosts` run the Mooncake
master and each kvcraft node in a namespace of its own, with its own address, so every
byte between nodes crosses a real (virtual) link, and a link can be cut:

    operator (this process's namespace)  198.18.N.1
        |  veth
    switch namespace: bridge ----- veth ----- host "a" namespace: eth0 198.18.N.11
                             ----- veth ----- host "b" namespace: eth0 198.18.N.12 ...

The subnet is in 198.18.0.0/15 (RFC 2544, set aside for benchmarking networks), N chosen
so it clashes with no address or route of this machine. Nothing outside the namespaces
created here is ever addressed; the operator's veth is the only interface added to this
process's namespace, and it goes with the switch namespace. `close()` kills every process
still in the namespaces and deletes them: no namespace, link or process is left behind.

Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and the `ip` command (iproute2); `unavailable()`
says why not where it cannot run. Faults: `link_down`/`link_up` (a partition); this kernel
has no `tc netem`, so no latency shaping.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
from typing import Sequence

NAME = "kvcraft"  # namespace names: kvcraft-<id>-<host>; the operator's link: kvc<id>op


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"{NAME}-probe-{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def namespaces() -> list[str]:
    """Our namespaces on this machine (for leak checks); none where `ip` is missing."""
    if shutil.which("ip") is None:
        return []
    out = _ip("netns", "list", check=False).stdout
    return sorted(line.split()[0] for line in out.splitlines() if line.startswith(f"{NAME}-"))


def _free_subnet() -> int:
    used = _ip("-4", "-o", "addr").stdout + _ip("-4", "route").stdout
    free = [n for n in range(256) if f"198.18.{n}." not in used]
    if not free:
        raise RuntimeError("no free /24 in 198.18.0.0/16 for the simulated hosts")
    return random.choice(free)


class Network:
    """Namespaces for `hosts` (names of up to 6 characters) behind one switch."""

    def __init__(self, hosts: Sequence[str]) -> None:
        if len(set(hosts)) != len(hosts) or any(not h.isalnum() or len(h) > 6 for h in hosts):
            raise ValueError(f"host names must be distinct, alphanumeric, <= 6 characters: {hosts}")
        self.hosts = list(hosts)
        self.id = f"{os.getpid() % 10000:04d}{random.randrange(100):02d}"
        self.subnet = _free_subnet()
        self.switch = f"{NAME}-{self.id}-sw"
        self.operator_link = f"kvc{self.id}op"
        self._made: list[str] = []

    def ns(self, host: str) -> str:
        return f"{NAME}-{self.id}-{host}"

    def address(self, host: str) -> str:
        """The host's address on the switch (198.18.N.11, .12, ... in the order given)."""
        return f"198.18.{self.subnet}.{11 + self.hosts.index(host)}"

    @property
    def operator(self) -> str:
        """This process's address on the switch."""
        return f"198.18.{self.subnet}.1"

    def prefix(self, host: str) -> list[str]:
        """argv prefix that runs a command on `host` (ChildProcess(prefix=...))."""
        return ["ip", "netns", "exec", self.ns(host)]

    def up(self) -> "Network":
        try:
            self._add_ns(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            _ip("link", "add", self.operator_link, "type", "veth", "peer", "name", "p-op", "netns", self.switch)
            _ip("addr", "add", f"{self.operator}/24", "dev", self.operator_link)
            _ip("link", "set", self.operator_link, "up")
            self._attach("p-op")
            for host in self.hosts:
                ns = self.ns(host)
                self._add_ns(ns)
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"p-{host}", "netns", self.switch)
                _ip("-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                self._attach(f"p-{host}")
        except BaseException:
            self.close()
            raise
        return self

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)

    def _attach(self, port: str) -> None:
        _ip("-n", self.switch, "link", "set", port, "master", "br0")
        _ip("-n", self.switch, "link", "set", port, "up")

    def link_down(self, host: str) -> None:
        """Cut `host` off the switch (every other host and the operator): a partition."""
        _ip("-n", self.switch, "link", "set", f"p-{host}", "down")

    def link_up(self, host: str) -> None:
        _ip("-n", self.switch, "link", "set", f"p-{host}", "up")

    def close(self) -> None:
        """Kill what still runs in the namespaces and delete them (the veths go with them)."""
        for ns in reversed(self._made):
            pids = _ip("netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", ns, check=False)
        self._made.clear()
        _ip("link", "del", self.operator_link, check=False)  # gone with the switch already, normally

    def __enter__(self) -> "Network":
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.close()
