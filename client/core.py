"""The client core: everything KVClient and AsyncKVClient share, written once.

`ClientCore` holds one channel (grpcio's blocking or asyncio one) and what every call
needs from it: the channel options, the bearer-token metadata (data and admin), the
default timeout, the co-located Store's staging areas and switch (kvclient.local_store)
and the same-host mappings (kvclient.local.LocalMappings).

Each call that answers with one message is an `Rpc`, built by a method of the core
(request, metadata, timeout, how its answer becomes the caller's value). A face sends it
the way its channel does: `Rpc.call()` blocks, `await Rpc.call_async()` awaits; both map
a failed call to a kvclient.errors type. `blocking(op)` and `awaited(op)` make a face's
method from such a core method, with its name, parameters and docstring, so the two
faces cannot drift apart. What differs beyond sending (streams, Plans, futures, the
co-located Store) is written in each face (kvclient.client).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Concatenate, Generic, ParamSpec, Sequence, TypeVar

import grpc

from kvclient import local_store as colocated
from kvclient.errors import from_rpc_error
from kvclient.messages import (Layer, Lease, RefLike, fetch_request, layer_chunk, lookup_request, selector,
                               store_header, store_messages, store_result_of, variant_ref)
from kvcraft.records import StoreResult, VariantStats
from kvcraft.v1 import kvcraft_pb2 as pb
from kvcraft.v1 import kvcraft_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from kvclient.local import LocalMappings

DEFAULT_ADDRESS = "127.0.0.1:50051"
MAX_MESSAGE_BYTES = 64 << 20

_STORE = "/kvcraft.v1.KVCache/Store"
_FETCH = "/kvcraft.v1.KVCache/FetchLayers"

Metadata = tuple[tuple[str, str], ...]
P = ParamSpec("P")
R = TypeVar("R")


def _as_is(answer: Any) -> Any:
    return answer


@dataclass(frozen=True)
class Rpc(Generic[R]):
    """One call that answers with one message (unary, or a client stream), ready to send."""

    method: Any  # the channel's multicallable: blocking or asyncio, as the face's channel is
    request: Any  # a message; for a client stream, an iterator of them
    metadata: Metadata
    timeout: float
    convert: Callable[[Any], R] = _as_is  # the answer message -> what the caller gets

    def answer(self) -> Any:
        """The answer message (blocking); a failed call raises a KVCraftError."""
        try:
            return self.method(self.request, metadata=self.metadata, timeout=self.timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    async def answer_async(self) -> Any:
        """The answer message (awaited); a failed call raises a KVCraftError."""
        try:
            return await self.method(self.request, metadata=self.metadata, timeout=self.timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def call(self) -> R:
        return self.convert(self.answer())

    async def call_async(self) -> R:
        return self.convert(await self.answer_async())

    def future(self) -> grpc.Future:
        """A blocking channel's grpc.Future of the answer message (its exception a grpc.RpcError)."""
        return self.method.future(self.request, metadata=self.metadata, timeout=self.timeout)


def check_address(address: str) -> None:
    """ValueError for what grpc would take and misread: nothing, a URL, a port past 65535
    (grpc dials it modulo 65536: another port). Anything else (host:port, [v6]:port,
    unix:PATH, a grpc target scheme) goes to grpc as given."""
    if not address:
        raise ValueError("address is empty: give host:port (the service's, e.g. 127.0.0.1:50051)")
    if "://" in address and address.split("://", 1)[0] in ("http", "https", "grpc", "grpcs"):
        raise ValueError(f"address {address!r} is a URL: give host:port")
    host, sep, port = address.rpartition(":")
    if sep and host and not host.startswith("unix") and port.isdigit() and not 0 < int(port) < 1 << 16:
        raise ValueError(f"address {address!r}: port {port} is outside 1..65535")


def _metadata(token: str | None) -> Metadata:
    return (("authorization", f"Bearer {token}"),) if token else ()


class ClientCore:
    """The state and requests both faces share (see the module docstring)."""

    def __init__(self, channels: ModuleType, address: str, *, token: str | None, admin_token: str | None,
                 timeout: float, credentials: grpc.ChannelCredentials | None, max_message_bytes: int,
                 local_store: bool) -> None:
        """channels: `grpc` (a blocking client) or `grpc.aio` (an asyncio one)."""
        check_address(address)
        opts = [("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes)]
        self.channel = (channels.secure_channel(address, credentials, options=opts) if credentials
                        else channels.insecure_channel(address, options=opts))
        self.kv = pb_grpc.KVCacheStub(self.channel)
        self.admin = pb_grpc.AdminStub(self.channel)
        self.store_stream = self.channel.stream_unary(_STORE, response_deserializer=pb.StoreResponse.FromString)
        self.store_local = self.channel.stream_stream(
            colocated.STORE_LOCAL, request_serializer=pb.StoreLocalRequest.SerializeToString,
            response_deserializer=pb.StoreLocalResponse.FromString)
        self.fetch_stream = self.channel.unary_stream(
            _FETCH, request_serializer=pb.FetchRequest.SerializeToString, response_deserializer=layer_chunk)
        self.metadata = _metadata(token)
        self.admin_metadata = _metadata(admin_token)
        self.timeout = timeout  # seconds; a call's own timeout, where it takes one, wins
        self.local_store = local_store  # turned off for good when the service or host has no such path
        self.staging = colocated.StagingPool()  # this client's staging areas (StoreLocal)
        self._mappings: LocalMappings | None = None

    def deadline(self, timeout: float | None = None) -> float:
        """A call's timeout: its own, else the client's."""
        return timeout or self.timeout

    def mappings(self) -> "LocalMappings":
        """This client's mappings of the service's shared memory, made on the first Locate."""
        if self._mappings is None:
            from kvclient.local import LocalMappings

            self._mappings = LocalMappings()
        return self._mappings

    def close(self) -> None:
        """Unmap and free what the client holds outside the channel (the face closes that)."""
        if self._mappings is not None:
            self._mappings.close()
        self.staging.close()

    def _rpc(self, method: Any, request: Any, convert: Callable[[Any], R] = _as_is, *, admin: bool = False,
             timeout: float | None = None) -> Rpc[R]:
        return Rpc(method, request, self.admin_metadata if admin else self.metadata, self.deadline(timeout), convert)

    # -- KVCache ----------------------------------------------------------------------
    def colocated_header(self, model_id: str, token_ids: Sequence[int], layers: Sequence[Layer],
                         prefix_keys: Sequence[str], stats: VariantStats | None) -> pb.StoreHeader | None:
        """The header of a co-located Store (kvclient.local_store); None: send it over gRPC."""
        if self.local_store and colocated.uniform(layers):
            return store_header(model_id, token_ids, layers, prefix_keys, stats)
        return None

    def store(self, model_id: str, token_ids: Sequence[int], layers: Sequence[Layer],
              prefix_keys: Sequence[str], stats: VariantStats | None) -> Rpc[StoreResult]:
        """A Store over the gRPC byte stream."""
        return self._rpc(self.store_stream, store_messages(model_id, token_ids, layers, prefix_keys, stats),
                         store_result_of)

    def open_fetch(self, refs: Sequence[RefLike], first_layer: int, num_layers: int, timeout: float | None) -> Any:
        """A FetchLayers call of the face's channel (iterate it, or `async for`)."""
        return self.fetch_stream(fetch_request(refs, first_layer, num_layers), metadata=self.metadata,
                                 timeout=self.deadline(timeout))

    def lookup(self, model_id: str | None = None, token_ids: Sequence[int] | None = None, *,
               chunk_key: str | None = None) -> Rpc[pb.LookupResponse]:
        """The stored variants of a chunk, by its tokens or its key."""
        return self._rpc(self.kv.Lookup, lookup_request(model_id, token_ids, chunk_key))

    def match_prefix(self, variant_ids: Sequence[str], timeout: float | None = None) -> Rpc[int]:
        """How many leading variants of a chain are stored."""
        return self._rpc(self.kv.MatchPrefix, pb.MatchPrefixRequest(variant_ids=list(variant_ids)),
                         _matched, timeout=timeout)

    def locate(self, refs: Sequence[RefLike], ttl_s: float, timeout: float | None = None) -> Rpc[pb.LocateResponse]:
        """Locate (the same-host fast path): where the leased variants lie in the service's
        shared memory (map them with `mappings().of(answer)`)."""
        return self._rpc(self.kv.Locate, pb.LocateRequest(variants=[variant_ref(x) for x in refs],
                                                          lease_ttl_s=ttl_s), timeout=timeout)

    def lease(self, refs: Sequence[RefLike], ttl_s: float = 0.0) -> Rpc[Lease]:
        """Hold the variants in place for ttl_s (0: the service's default)."""
        return self._rpc(self.kv.Lease, pb.LeaseRequest(variants=[variant_ref(x) for x in refs], ttl_s=ttl_s),
                         Lease.of)

    def release(self, lease_id: str) -> Rpc[bool]:
        """End a lease; False: it had ended already (released or expired)."""
        return self._rpc(self.kv.Release, pb.ReleaseRequest(lease_id=lease_id), _released)

    # -- Admin (the admin token) --------------------------------------------------------
    def stats(self) -> Rpc[pb.StatsResponse]:
        return self._rpc(self.admin.Stats, pb.StatsRequest(), admin=True)

    def list_chunks(self, model_id: str = "", page_size: int = 0, page_token: str = "") -> Rpc[pb.ListChunksResponse]:
        return self._rpc(self.admin.ListChunks, pb.ListChunksRequest(
            model_id=model_id, page_size=page_size, page_token=page_token), admin=True)

    def get_chunk(self, chunk_key: str) -> Rpc[list[pb.VariantInfo]]:
        return self._rpc(self.admin.GetChunk, pb.GetChunkRequest(chunk_key=chunk_key), _variants, admin=True)

    def evict(self, *, chunk_key: str | None = None, variant_id: str | None = None) -> Rpc[pb.EvictResponse]:
        return self._rpc(self.admin.Evict, selector(chunk_key, variant_id), admin=True)

    def pin(self, *, chunk_key: str | None = None, variant_id: str | None = None) -> Rpc[int]:
        return self._rpc(self.admin.Pin, selector(chunk_key, variant_id), _count, admin=True)

    def unpin(self, *, chunk_key: str | None = None, variant_id: str | None = None) -> Rpc[int]:
        return self._rpc(self.admin.Unpin, selector(chunk_key, variant_id), _count, admin=True)

    def flush(self) -> Rpc[pb.FlushResponse]:
        return self._rpc(self.admin.Flush, pb.FlushRequest(), admin=True)

    def config(self) -> Rpc[str]:
        return self._rpc(self.admin.Config, pb.ConfigRequest(), _toml, admin=True)


def _matched(r: pb.MatchPrefixResponse) -> int:
    return r.matched


def _released(r: pb.ReleaseResponse) -> bool:
    return r.released


def _variants(r: pb.GetChunkResponse) -> list[pb.VariantInfo]:
    return list(r.variants)


def _count(r: pb.PinResponse) -> int:
    return r.variants


def _toml(r: pb.ConfigResponse) -> str:
    return r.toml


# -- what the faces share ----------------------------------------------------------------
class Face:
    """The base of both faces: the core, and its default timeout as the face's."""

    core: ClientCore

    @property
    def timeout(self) -> float:
        """Seconds a call may take unless it is given its own; settable (new calls use it)."""
        return self.core.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self.core.timeout = seconds


# -- the faces' methods, made from the core's --------------------------------------------
def _face_signature(op: Callable[..., Any]) -> inspect.Signature:
    """op's signature, answering what its Rpc converts to (`Rpc[int]` -> `int`)."""
    sig = inspect.signature(op)
    answer = sig.return_annotation
    if isinstance(answer, str) and answer.startswith("Rpc[") and answer.endswith("]"):
        sig = sig.replace(return_annotation=answer[len("Rpc["):-1])
    return sig


def blocking(op: Callable[Concatenate[ClientCore, P], Rpc[R]]) -> Callable[Concatenate[Any, P], R]:
    """A KVClient method that sends the Rpc the core's `op` builds and waits for its answer."""

    @functools.wraps(op)
    def method(self: Any, *args: P.args, **kwargs: P.kwargs) -> R:
        return op(self.core, *args, **kwargs).call()

    method.__signature__ = _face_signature(op)  # type: ignore[attr-defined]
    return method


def awaited(op: Callable[Concatenate[ClientCore, P], Rpc[R]]) -> Callable[Concatenate[Any, P], Awaitable[R]]:
    """An AsyncKVClient coroutine method that sends the Rpc the core's `op` builds and awaits its answer."""

    @functools.wraps(op)
    async def method(self: Any, *args: P.args, **kwargs: P.kwargs) -> R:
        return await op(self.core, *args, **kwargs).call_async()

    method.__signature__ = _face_signature(op)  # type: ignore[attr-defined]
    return method
