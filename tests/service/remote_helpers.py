"""Shared pieces of the remote-tier tests: a real mooncake_master on loopback."""

from __future__ import annotations

from kvservice.cluster.master import MasterProcess
from kvservice.cluster.mooncake import MooncakeClient, RemoteSettings

MiB = 1 << 20


class Cluster:
    """A mooncake_master bound to 127.0.0.1 on free ports (RPC, admin; HTTP metadata
    off), and the Mooncake clients a test opens on it (closed before the master stops,
    so no client waits on a dead master at exit)."""

    def __init__(self, master: MasterProcess) -> None:
        self.master = master
        self.clients: list[MooncakeClient] = []

    def client(self, segment_bytes: int = 64 * MiB) -> MooncakeClient:
        c = MooncakeClient(RemoteSettings(self.master.address, segment_bytes=segment_bytes, buffer_bytes=16 * MiB))
        self.clients.append(c)
        return c
