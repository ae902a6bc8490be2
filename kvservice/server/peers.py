"""Which clients share this service's host: only they are offered its shared memory
(Locate's mappings of the host slab, StoreLocal's staging areas).

What tells hosts apart is the gRPC peer address, not whether /dev/shm or /proc happen to
be reachable: hosts simulated with network namespaces on one kernel share both, and a
client on "another host" would silently map this one's memory. A peer is on this host
when it came over a unix socket, from a loopback address, or from one of this network
namespace's own addresses (a throwaway socket binds to it).

grpcio's `context.peer()` strings: "ipv4:127.0.0.1:40526", "ipv6:%5B::1%5D:40526"
(brackets URL-escaped; a link-local one "ipv6:%5Bfe80::1%254%5D:40526", its scope the
interface index), "unix:" or "unix:/path" (a unix socket, abstract ones included). A
dual-stack listener reports an IPv4 client as ipv4.
"""

from __future__ import annotations

import functools
import ipaddress
import socket
from urllib.parse import unquote

from kvservice.errors import FailedPrecondition

_NONLOCAL_BIND = {socket.AF_INET: "/proc/sys/net/ipv4/ip_nonlocal_bind",
                  socket.AF_INET6: "/proc/sys/net/ipv6/ip_nonlocal_bind"}


def peer_host(peer: str) -> str | None:
    """The address part of a grpc peer string ("10.0.0.1", "::1", "fe80::1%4"); "unix"
    for a unix socket; None: not a peer string this knows."""
    kind, sep, rest = peer.partition(":")
    if not sep:
        return None
    if kind in ("unix", "unix-abstract"):
        return "unix"
    if kind not in ("ipv4", "ipv6"):
        return None
    rest = unquote(rest)
    if kind == "ipv6":
        if not rest.startswith("[") or "]:" not in rest:
            return None
        host = rest[1:rest.index("]:")]
    else:
        host, sep, _ = rest.rpartition(":")
        if not sep:
            return None
    return host or None


def same_host(peer: str) -> bool:
    """Whether the client of `peer` (grpc's `context.peer()`) runs on this host: a unix
    socket, a loopback address, or one of this network namespace's own addresses. An
    unparseable peer is not."""
    host = peer_host(peer)
    if host == "unix":
        return True
    if host is None:
        return False
    return _local_address(host)


@functools.lru_cache(maxsize=256)
def _local_address(host: str) -> bool:
    """A loopback address, or one a socket of its family can bind to here (bind fails
    with EADDRNOTAVAIL for an address that is not this namespace's). Cached per address."""
    try:
        ip = ipaddress.ip_address(host.partition("%")[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip, host = ip.ipv4_mapped, str(ip.ipv4_mapped)
    if ip.is_loopback:
        return True
    family = socket.AF_INET if ip.version == 4 else socket.AF_INET6
    if _binds_anything(family):
        return False  # any bind succeeds here: it proves nothing; the peer streams
    try:
        (_, _, _, _, where), *_ = socket.getaddrinfo(host, 0, family, socket.SOCK_DGRAM, 0, socket.AI_NUMERICHOST)
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind(where)
    except OSError:  # EADDRNOTAVAIL: not this namespace's; or no such family here
        return False
    return True


def _binds_anything(family: int) -> bool:
    """net.ipv4/ipv6.ip_nonlocal_bind on: a socket binds to any address, local or not."""
    try:
        with open(_NONLOCAL_BIND[family]) as f:
            return f.read().strip() != "0"
    except OSError:
        return False


def check_same_host(peer: str, instead: str) -> None:
    """FAILED_PRECONDITION unless the client of `peer` shares this service's host;
    `instead` names the RPC it streams with."""
    if not same_host(peer):
        host = peer_host(peer)
        who = f"the client at {host}" if host else f"the client ({peer[:80]!r})"
        raise FailedPrecondition(f"{who} is not on this service's host: shared memory is not reachable from there; "
                                 f"{instead}")
