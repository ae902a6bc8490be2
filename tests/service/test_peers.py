"""Which clients the service offers its shared memory (kvservice.server.peers): peers on
its own host only, told apart by the gRPC peer address. No service process: the peer
strings grpcio really reports come from an in-process server on loopback, and the
servicers' refusals from calling Locate / StoreLocal with a peer that is not local."""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace

import grpc
import pytest

from kvcraft.v1 import kvcraft_pb2 as pb
from kvservice.errors import FailedPrecondition
from kvservice.server.data import DataServicer
from kvservice.server.lookup import LookupServicer
from kvservice.server.peers import check_same_host, peer_host, same_host
from kvservice.server.status import InFlight

NOT_LOCAL = "ipv4:192.0.2.1:5555"  # TEST-NET-1: documentation only, never assigned to a host


@pytest.mark.parametrize("peer", [
    "ipv4:127.0.0.1:5555", "ipv4:127.3.2.1:1",  # all of 127/8 is loopback
    "ipv6:%5B::1%5D:5555", "ipv6:[::1]:5555",  # grpcio escapes the brackets; either is read
    "ipv6:%5B::ffff:127.0.0.1%5D:5555",  # v4-mapped loopback
    "unix:", "unix:/run/kvcraft.sock", "unix-abstract:kvcraft",
])
def test_loopback_and_unix_peers_are_on_this_host(peer):
    assert same_host(peer)


@pytest.mark.parametrize("peer", [
    NOT_LOCAL, "ipv4:198.51.100.7:40000", "ipv6:%5B2001:db8::1%5D:5555", "ipv6:%5Bfe80::1%25999999%5D:1",
])
def test_addresses_that_are_not_this_hosts_are_not(peer):
    assert not same_host(peer)


@pytest.mark.parametrize("peer", [
    "", "garbage", "ipv4:", "ipv4:127.0.0.1", "ipv4:localhost:5555", "ipv4::5555", "ipv6:::1:5555",
    "ipv6:%5B::1", "tcp:127.0.0.1:5555", "ipv4:%5B127.0.0.1%5D:5555", "ipv4:999.0.0.1:1",
])
def test_a_peer_string_that_does_not_parse_is_not(peer):
    assert not same_host(peer)


def _own_address(family: int, probe: str) -> str | None:
    """A non-loopback address of this network namespace: the source a datagram to `probe`
    would leave from (connect sends nothing)."""
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((probe, 9))
            host = s.getsockname()[0]
    except OSError:
        return None
    return None if host.startswith("127.") or host == "::1" else host


@pytest.mark.parametrize("family,probe,fmt", [
    (socket.AF_INET, "192.0.2.1", "ipv4:{}:41000"),
    (socket.AF_INET6, "2001:db8::1", "ipv6:%5B{}%5D:41000"),
])
def test_one_of_this_namespaces_own_addresses_is_on_this_host(family, probe, fmt):
    host = _own_address(family, probe)
    if host is None:
        pytest.skip("no route from this network namespace to test with")
    assert same_host(fmt.format(host))


def test_the_peer_strings_grpcio_reports_on_loopback_are_on_this_host(tmp_path):
    """What an asyncio server's `context.peer()` says for a client over IPv4 and IPv6
    loopback and a unix socket (pins the format `same_host` reads)."""

    async def go() -> list[str]:
        seen: list[str] = []

        async def echo(request: bytes, context) -> bytes:
            seen.append(context.peer())
            return request

        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "t.Peer", {"Echo": grpc.unary_unary_rpc_method_handler(echo)}),))
        targets = [f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"]
        try:
            targets.append(f"[::1]:{server.add_insecure_port('[::1]:0')}")
        except RuntimeError:  # no IPv6 here
            pass
        sock = tmp_path / "peer.sock"
        server.add_insecure_port(f"unix:{sock}")
        targets.append(f"unix:{sock}")
        await server.start()
        try:
            for target in targets:
                async with grpc.aio.insecure_channel(target) as channel:
                    await channel.unary_unary("/t.Peer/Echo")(b"x", timeout=10)
        finally:
            await server.stop(None)
        return seen

    seen = asyncio.run(go())
    assert seen[0].startswith("ipv4:127.0.0.1:") and seen[-1].startswith("unix:")
    if len(seen) == 3:
        assert seen[1].startswith("ipv6:%5B::1%5D:")  # brackets URL-escaped
    assert all(same_host(p) for p in seen), seen


def test_the_refusal_names_the_client_and_what_to_do():
    assert peer_host(NOT_LOCAL) == "192.0.2.1"
    with pytest.raises(FailedPrecondition) as e:
        check_same_host(NOT_LOCAL, "stream the layers (FetchLayers)")
    assert str(e.value) == ("the client at 192.0.2.1 is not on this service's host: shared memory is not "
                            "reachable from there; stream the layers (FetchLayers)")
    check_same_host("ipv4:127.0.0.1:1", "unused")  # no error


class Context:
    """The parts of grpc.aio.ServicerContext the two RPCs use before a refusal."""

    def __init__(self, peer: str) -> None:
        self._peer = peer
        self.status: tuple[grpc.StatusCode, str] | None = None

    def peer(self) -> str:
        return self._peer

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.status = (code, details)
        raise grpc.aio.AbortError()

    async def write(self, message: object) -> None:
        raise AssertionError(f"nothing is to be written before the refusal: {message}")


def _locate(peer: str, ttl_s: float = 0.0) -> tuple[grpc.StatusCode, str]:
    store = SimpleNamespace(cfg=SimpleNamespace(max_lease_ttl_s=3600.0))  # nothing else is reached
    servicer = LookupServicer(store, planning=None, inflight=InFlight())
    context = Context(peer)
    request = pb.LocateRequest(variants=[pb.VariantRef(chunk_key="a" * 32)], lease_ttl_s=ttl_s)
    with pytest.raises(grpc.aio.AbortError):
        asyncio.run(servicer.Locate(request, context))
    return context.status


def test_locate_refuses_a_client_on_another_host():
    code, details = _locate(NOT_LOCAL)
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "the client at 192.0.2.1 is not on this service's host" in details and "FetchLayers" in details


def test_locate_from_loopback_goes_past_the_host_check():
    code, details = _locate("ipv6:%5B::1%5D:5555", ttl_s=-1.0)  # then refused for its ttl, not its host
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "lease_ttl_s" in details


def test_store_local_reads_the_start_then_refuses_a_client_on_another_host():
    store = SimpleNamespace(cfg=SimpleNamespace(local_store=True))  # begin_store is never reached
    servicer = DataServicer(store, metrics=None, inflight=InFlight())
    context = Context(NOT_LOCAL)
    read: list[str] = []

    async def requests():
        read.append("start")
        yield pb.StoreLocalRequest(start=pb.StoreLocalStart(staging=pb.StagingArea(staging_id="a" * 32, pid=1, fd=3)))
        read.append("more")  # never asked for
        yield pb.StoreLocalRequest(staged=pb.StagedLayers(layers=1))

    with pytest.raises(grpc.aio.AbortError):
        asyncio.run(servicer.StoreLocal(requests(), context))
    code, details = context.status
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "the client at 192.0.2.1 is not on this service's host" in details and "Store stream" in details
    assert read == ["start"]  # the start was read before the refusal (grpc/grpc#36066)
