"""Co-located Store: the layers go through shared memory, not gRPC (StoreLocal RPC).

`KVClient.store` (and `AsyncKVClient.store`) try this path first and fall back to the
gRPC Store stream when it is not available:
- the service answers the header with a staging area made for this one Store (a sealed
  memfd, docs/storage.md "Co-located Store"); this process opens it as
  /proc/<service pid>/fd/<fd>, which works only on the same host, in the same pid
  namespace and as a user allowed to (a sidecar with a shared process namespace);
- each layer's K and V are copied once into the area, and a small StagedLayers message
  says so: the service writes layer n to its payload file while this process copies
  layer n+1; the service computes the checksums from the staged bytes;
- after the last layer the client ends its stream; the answer comes once the payload is
  durable and its metadata committed, as for Store.

Fallback: a service without StoreLocal (UNIMPLEMENTED) or with it off
(FAILED_PRECONDITION), or a staging area this process cannot open (another host or pid
namespace), switches the client to the gRPC stream for good; a staging area refused for
room (RESOURCE_EXHAUSTED: it counts the whole payload in flight) sends this one Store
the gRPC way (counted at 4 layers). `KVClient(..., local_store=False)` always uses gRPC.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import queue
from typing import TYPE_CHECKING, Any, Sequence

import grpc

from kvclient.errors import KVCraftError, from_rpc_error
from kvclient.tensors import byte_view
from kvcraft.layout import STAGING_NAME_PREFIX
from kvcraft.v1 import kvcraft_pb2 as pb

if TYPE_CHECKING:
    import torch

STORE_LOCAL = "/kvcraft.v1.KVCache/StoreLocal"
# The service has no co-located path for this client: use gRPC from now on.
_OFF = (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.FAILED_PRECONDITION)


class NotColocated(Exception):
    """The staging area cannot be opened from this process."""


class StagingMap:
    """A Store's staging area, mapped read-write into this process."""

    def __init__(self, area: pb.StagingArea) -> None:
        self.area = area
        expected = f"/memfd:{STAGING_NAME_PREFIX}{area.staging_id} (deleted)"
        if not area.staging_id or not area.path.startswith("/proc/"):
            raise NotColocated(f"staging path {area.path!r} is not a /proc fd path")
        try:
            if os.readlink(area.path) != expected:  # another host's pid, or not this Store's area
                raise NotColocated(f"{area.path} is not staging area {area.staging_id} here")
            fd = os.open(area.path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            raise NotColocated(f"cannot open {area.path}: {e.strerror}") from None
        try:
            # what was opened (the fd may have been reused between the two looks)
            if os.readlink(f"/proc/self/fd/{fd}") != expected or os.fstat(fd).st_size != area.length:
                raise NotColocated(f"{area.path} changed while it was opened")
            self._map = mmap.mmap(fd, area.length)
        finally:
            os.close(fd)
        self.view = memoryview(self._map)

    def put(self, layer: int, k: "torch.Tensor", v: "torch.Tensor") -> None:
        """Copy one layer's K then V into its place (the payload layout)."""
        a = self.area
        base = layer * a.layer_bytes
        kv, vv = byte_view(k), byte_view(v)
        if kv.nbytes != a.key_bytes or kv.nbytes + vv.nbytes != a.layer_bytes:
            raise ValueError(f"layer {layer}: K/V have {kv.nbytes}/{vv.nbytes} bytes; the header's specs need "
                             f"{a.key_bytes}/{a.layer_bytes - a.key_bytes}")
        self.view[base : base + a.key_bytes] = kv
        self.view[base + a.key_bytes : base + a.layer_bytes] = vv

    def close(self) -> None:
        self.view.release()
        self._map.close()


def uniform(layers: Sequence[tuple["torch.Tensor", "torch.Tensor"]]) -> bool:
    """Every layer has the first layer's K and V dtype and shape (else the gRPC stream
    runs, and the service names the bad layer as it always does)."""
    k0, v0 = layers[0]
    return all(k.dtype == k0.dtype and v.dtype == v0.dtype and k.shape == k0.shape and v.shape == v0.shape
               for k, v in layers)


def _staged(area: pb.StagingArea, count: int) -> pb.StoreLocalRequest:
    return pb.StoreLocalRequest(staged=pb.StagedLayers(staging_id=area.staging_id, layers=count))


def _declined(client: Any, e: grpc.RpcError) -> bool:
    """True: this Store goes the gRPC way (and, for a service without the path, every
    later one); False: a real error of the Store."""
    if e.code() in _OFF:
        client._local_store = False  # noqa: SLF001 - the client's own switch
        return True
    return e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def _no_result() -> KVCraftError:
    return KVCraftError(grpc.StatusCode.INTERNAL, "StoreLocal ended without a result")


def store(client: Any, header: pb.StoreHeader, layers: Sequence[tuple["torch.Tensor", "torch.Tensor"]],
          ) -> pb.StoreResponse | None:
    """One co-located Store by a KVClient; None: not available, use the gRPC stream."""
    requests: queue.SimpleQueue = queue.SimpleQueue()
    requests.put(pb.StoreLocalRequest(header=header))

    def stream():  # noqa: ANN202 - grpcio's request iterator, fed as layers are staged
        while (m := requests.get()) is not None:
            yield m

    call = client._store_local(stream(), metadata=client._md, timeout=client.timeout)  # noqa: SLF001
    staging = None
    try:
        try:
            first = next(call)
        except grpc.RpcError as e:
            if _declined(client, e):
                return None
            raise from_rpc_error(e) from None
        try:
            staging = StagingMap(first.staging)
        except NotColocated:
            client._local_store = False  # noqa: SLF001
            return None
        for i, (k, v) in enumerate(layers):
            staging.put(i, k, v)
            requests.put(_staged(first.staging, i + 1))
        requests.put(None)
        try:
            last = next(call, None)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        if last is None or last.WhichOneof("part") != "result":
            raise _no_result()
        return last.result
    finally:
        requests.put(None)
        call.cancel()  # no-op once the call ended
        if staging is not None:
            staging.close()


async def store_async(client: Any, header: pb.StoreHeader,
                      layers: Sequence[tuple["torch.Tensor", "torch.Tensor"]]) -> pb.StoreResponse | None:
    """One co-located Store by an AsyncKVClient; None: use the gRPC stream. Layers are
    copied on a worker thread (the event loop goes on meanwhile)."""
    call = client._store_local(metadata=client._md, timeout=client.timeout)  # noqa: SLF001
    staging = None
    try:
        try:
            await call.write(pb.StoreLocalRequest(header=header))
            first = await call.read()
            if first is grpc.aio.EOF:
                raise _no_result()
        except grpc.RpcError as e:
            if _declined(client, e):
                return None
            raise from_rpc_error(e) from None
        except asyncio.InvalidStateError:  # the call ended while writing: its status says why
            e = await _status(call)
            if _declined(client, e):
                return None
            raise from_rpc_error(e) from None
        try:
            staging = StagingMap(first.staging)
        except NotColocated:
            client._local_store = False  # noqa: SLF001
            return None
        try:
            for i, (k, v) in enumerate(layers):
                await asyncio.to_thread(staging.put, i, k, v)
                await call.write(_staged(first.staging, i + 1))
            await call.done_writing()
            last = await call.read()
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        except asyncio.InvalidStateError:
            raise from_rpc_error(await _status(call)) from None
        if last is grpc.aio.EOF or last.WhichOneof("part") != "result":
            raise _no_result()
        return last.result
    finally:
        call.cancel()  # no-op once the call ended
        if staging is not None:
            staging.close()


class _Status(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


async def _status(call: Any) -> grpc.RpcError:
    return _Status(await call.code(), await call.details())
