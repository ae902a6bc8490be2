"""Co-located Store: the layers go through shared memory, not gRPC (StoreLocal RPC).

`KVClient.store` (and `AsyncKVClient.store`) try this path first and fall back to the
gRPC Store stream when it is not available. It runs on the client core's public parts
(kvclient.core.ClientCore: `store_local`, `metadata`, `timeout`, `staging` and the
`local_store` switch):
- the client keeps staging areas of its own (`StagingPool`): anonymous memfds named
  kvcraft-stage-<random id>, sealed against shrinking and growing, reused Store after
  Store (fresh shared memory costs a page fault and a zeroed page per 4 KiB: ~6x the
  copy itself on the machine of docs/benchmarks.md);
- it sends the header and names the area (its pid, the fd, the id); the service opens
  /proc/<pid>/fd/<fd> read-only, which works only on the same host, in the same pid
  namespace and as a user allowed to (a sidecar with a shared process namespace), checks
  it is that sealed memfd, maps it and accepts;
- each layer's K and V are copied once into the area (the payload layout,
  `kvcraft.layout`), and a small StagedLayers message says so: the service writes layer n
  to its payload file while this process copies layer n+1; the service computes the
  checksums from the staged bytes;
- after the last layer the client ends its stream; the answer comes once the payload is
  durable and its metadata committed, as for Store. Only then is the area reused.

Fallback: a service without StoreLocal (UNIMPLEMENTED), with it off, that sees this
client's address is not its host's, or that cannot open the area (FAILED_PRECONDITION:
another host, pid namespace or user) switches the client to the gRPC stream for good,
logged once (logger kvclient.local_store, with the service's reason).
`KVClient(..., local_store=False)` always uses gRPC.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import mmap
import os
import queue
import secrets
import threading
from typing import TYPE_CHECKING, Any, Sequence

import grpc

from kvclient.errors import KVCraftError, from_rpc_error
from kvclient.tensors import byte_view
from kvcraft.layout import STAGING_NAME_PREFIX, layer_layout
from kvcraft.v1 import kvcraft_pb2 as pb

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)  # kvclient.local_store

STORE_LOCAL = "/kvcraft.v1.KVCache/StoreLocal"
# The service has no co-located path for this client: use gRPC from now on.
_OFF = (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.FAILED_PRECONDITION)
IDLE_AREAS = 2  # staging areas a client keeps between Stores (more are closed)
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class StagingBuffer:
    """One staging area: a sealed memfd of `capacity` bytes, mapped read-write here."""

    def __init__(self, capacity: int) -> None:
        self.staging_id = secrets.token_hex(16)
        self.capacity = capacity
        self.fd = os.memfd_create(STAGING_NAME_PREFIX + self.staging_id, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, capacity)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)
            self._map = mmap.mmap(self.fd, capacity)
        except BaseException:
            os.close(self.fd)
            raise
        self.view = memoryview(self._map)

    def message(self) -> pb.StagingArea:
        return pb.StagingArea(staging_id=self.staging_id, pid=os.getpid(), fd=self.fd)

    def put(self, base: int, k: "torch.Tensor", v: "torch.Tensor") -> None:
        """Copy one layer's K then V to `base`."""
        kv, vv = byte_view(k), byte_view(v)
        self.view[base : base + kv.nbytes] = kv
        self.view[base + kv.nbytes : base + kv.nbytes + vv.nbytes] = vv

    def close(self) -> None:
        self.view.release()
        self._map.close()
        os.close(self.fd)


class StagingPool:
    """A client's staging areas: one per Store in flight, at most IDLE_AREAS kept idle."""

    def __init__(self) -> None:
        self._idle: list[StagingBuffer] = []
        self._lock = threading.Lock()
        self._closed = False

    def take(self, nbytes: int) -> StagingBuffer:
        with self._lock:
            fits = [b for b in self._idle if b.capacity >= nbytes]
            if fits:
                best = min(fits, key=lambda b: b.capacity)
                self._idle.remove(best)
                return best
        return StagingBuffer(nbytes)

    def give(self, buf: StagingBuffer) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(buf)
                self._idle.sort(key=lambda b: -b.capacity)  # keep the largest
                buf, extra = None, self._idle[IDLE_AREAS:]
                del self._idle[IDLE_AREAS:]
            else:
                extra = [buf]
        for b in extra:
            b.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for b in idle:
            b.close()


def uniform(layers: Sequence[tuple["torch.Tensor", "torch.Tensor"]]) -> bool:
    """Every layer has the first layer's K and V dtype and shape (else the gRPC stream
    runs, and the service names the bad layer as it always does)."""
    if not layers:
        return False  # (the gRPC path's header refuses it)
    k0, v0 = layers[0]
    return all(k.dtype == k0.dtype and v.dtype == v0.dtype and k.shape == k0.shape and v.shape == v0.shape
               for k, v in layers)


def _staged(count: int) -> pb.StoreLocalRequest:
    return pb.StoreLocalRequest(staged=pb.StagedLayers(layers=count))


def _declined(core: Any, e: grpc.RpcError) -> bool:
    """True: the service has no co-located path for this client: this Store and every
    later one go the gRPC way (said once per client core). False: a real error of the Store."""
    if e.code() in _OFF:
        if core.local_store:
            core.local_store = False
            log.info("kvcraft: the service declined co-located Stores (%s: %s); this client stores over "
                     "the gRPC Store stream from now on", e.code().name, (e.details() or "")[:300])
        return True
    return False


def _no_result() -> KVCraftError:
    return KVCraftError(grpc.StatusCode.INTERNAL, "StoreLocal ended without a result")


def _layer_bytes(header: pb.StoreHeader) -> int:
    return layer_layout(header.key_spec, header.value_spec, len(header.token_ids)).layer_bytes


def store(core: Any, header: pb.StoreHeader, layers: Sequence[tuple["torch.Tensor", "torch.Tensor"]],
          ) -> pb.StoreResponse | None:
    """One co-located Store by a KVClient's core; None: not available, use the gRPC stream."""
    layer_bytes = _layer_bytes(header)
    buf = core.staging.take(layer_bytes * len(layers))
    requests: queue.SimpleQueue = queue.SimpleQueue()
    requests.put(pb.StoreLocalRequest(start=pb.StoreLocalStart(header=header, staging=buf.message())))

    def stream():  # noqa: ANN202 - grpcio's request iterator, fed as layers are staged
        while (m := requests.get()) is not None:
            yield m

    call = core.store_local(stream(), metadata=core.metadata, timeout=core.timeout)
    reuse = False  # the area is reused only once the service is known to be done with it
    try:
        try:
            next(call)  # accepted: the service mapped the area
        except grpc.RpcError as e:
            if _declined(core, e):
                reuse = True  # refused before it was mapped
                return None
            raise from_rpc_error(e) from None
        for i, (k, v) in enumerate(layers):
            buf.put(i * layer_bytes, k, v)
            requests.put(_staged(i + 1))
        requests.put(None)
        try:
            last = next(call, None)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        if last is None or last.WhichOneof("part") != "result":
            raise _no_result()
        reuse = True
        return last.result
    finally:
        requests.put(None)
        call.cancel()  # no-op once the call ended
        _release(core, buf, reuse)


async def store_async(core: Any, header: pb.StoreHeader,
                      layers: Sequence[tuple["torch.Tensor", "torch.Tensor"]]) -> pb.StoreResponse | None:
    """One co-located Store by an AsyncKVClient's core; None: use the gRPC stream. Layers
    are copied on a worker thread (the event loop goes on meanwhile)."""
    layer_bytes = _layer_bytes(header)
    buf = core.staging.take(layer_bytes * len(layers))
    call = core.store_local(metadata=core.metadata, timeout=core.timeout)
    reuse = False  # the area is reused only once the service is known to be done with it
    try:
        try:
            await call.write(pb.StoreLocalRequest(start=pb.StoreLocalStart(header=header, staging=buf.message())))
            if await call.read() is grpc.aio.EOF:
                raise _no_result()
        except (grpc.RpcError, asyncio.InvalidStateError) as e:
            # InvalidStateError: the call ended while writing; its status says why
            status = e if isinstance(e, grpc.RpcError) else await _status(call)
            if _declined(core, status):
                reuse = True  # refused before it was mapped
                return None
            raise from_rpc_error(status) from None
        try:
            for i, (k, v) in enumerate(layers):
                await asyncio.to_thread(buf.put, i * layer_bytes, k, v)
                await call.write(_staged(i + 1))
            await call.done_writing()
            last = await call.read()
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        except asyncio.InvalidStateError:
            raise from_rpc_error(await _status(call)) from None
        if last is grpc.aio.EOF or last.WhichOneof("part") != "result":
            raise _no_result()
        reuse = True
        return last.result
    finally:
        call.cancel()  # no-op once the call ended
        _release(core, buf, reuse)


def _release(core: Any, buf: StagingBuffer, reuse: bool) -> None:
    """Back to the client's pool after a Store the service finished with; else closed
    (a Store that failed midway may still be read by the service for a moment: its next
    Store must not share the memory)."""
    if reuse:
        core.staging.give(buf)
    else:
        buf.close()


class _Status(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


async def _status(call: Any) -> grpc.RpcError:
    return _Status(await call.code(), await call.details())
