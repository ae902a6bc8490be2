"""The byte paths of the KVCache service: Store (client stream of layers) and
FetchLayers (server stream of layers)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator

import grpc

from kvcraft import codec
from kvcraft.codec import StoreLayer
from kvcraft.v1 import kvcraft_pb2 as pb
from kvservice import failpoints, wire
from kvservice.config import MiB
from kvservice.errors import InvalidArgument, KVCraftError
from kvservice.index import Variant
from kvservice.metrics import Metrics
from kvservice.server.codecs import as_message, check_parsed, message_bytes
from kvservice.server.status import InFlight, rpc, storage_error
from kvservice.store import ChunkStore

# A refused Store reads (and drops) up to this much of what the client still sends
# before it answers: a status sent while the client is still writing can reach a grpcio
# asyncio client as "INTERNAL: Internal error from Core" (grpc/grpc#36066).
STORE_DISCARD_BYTES = 256 * MiB
STORE_DISCARD_S = 10.0


class DataServicer:
    """Store and FetchLayers of the KVCache service."""

    def __init__(self, store: ChunkStore, metrics: Metrics, inflight: InFlight) -> None:
        self.store = store
        self.metrics = metrics
        self.inflight = inflight

    @rpc
    async def Store(self, request_iterator: AsyncIterator[pb.StoreRequest], context: Any) -> pb.StoreResponse:
        session = None
        # One message read ahead: grpcio receives layer n+1 while a worker thread writes
        # layer n (a read is what lets the client send the next message; without it the
        # stream alternates between the network and the disk).
        messages = aiter(request_iterator)
        ahead: asyncio.Future | None = asyncio.ensure_future(anext(messages, None))
        try:
            while True:
                req = await ahead
                ahead = None
                if req is None:
                    break
                ahead = asyncio.ensure_future(anext(messages, None))
                if isinstance(req, StoreLayer) and session is not None:  # the hot path: views of the message
                    await asyncio.to_thread(session.add_layer, req.layer, req.key, req.value)
                    req = None  # the layer is in its payload file: do not hold it while the next arrives
                    continue
                req = as_message(req)
                check_parsed(req)
                part = req.WhichOneof("part")
                if session is None:
                    if part != "header":
                        raise InvalidArgument("the first message of a Store stream must be a header")
                    begin = asyncio.ensure_future(asyncio.to_thread(self.store.begin_store,
                                                                    wire.store_header(req.header)))
                    try:
                        session = await asyncio.shield(begin)
                    except asyncio.CancelledError:
                        # The client left while begin_store ran on: abort the session it
                        # makes, or its temporary file and disk reservation would leak.
                        begin.add_done_callback(_abort_when_done)
                        raise
                elif part == "layer":
                    layer = req.layer
                    await asyncio.to_thread(session.add_layer, layer.layer, layer.key, layer.value)
                    req = layer = None
                else:
                    raise InvalidArgument(f"unexpected {part or 'empty'} message after the header")
            if session is None:
                raise InvalidArgument("empty Store stream: no header")
            result = await asyncio.to_thread(session.finish)
            self.metrics.store_bytes.inc(result.bytes_stored if not result.already_present else 0)
            return wire.store_response(result)
        except Exception as e:
            refusal = e if isinstance(e, KVCraftError) else storage_error(e)
            if refusal is None:
                raise
            if session is not None:
                session.abort()
            await _discard_rest(messages, ahead)
            ahead = None
            raise refusal from None
        finally:
            if ahead is not None:  # cancelled, or a bug: nobody will read what was ahead
                ahead.cancel()
            if session is not None:
                session.abort()  # no-op once finished

    async def FetchLayers(self, request: pb.FetchRequest, context: Any) -> AsyncIterator[pb.LayerChunk]:
        with self.inflight.track():
            async for chunk in self._fetch_layers(request, context):
                yield chunk

    async def _fetch_layers(self, request: pb.FetchRequest, context: Any) -> AsyncIterator[pb.LayerChunk]:
        # A server-streaming handler cannot use the unary wrapper: errors are mapped inline.
        try:
            check_parsed(request)
            infos = await asyncio.to_thread(self.store.open_fetch, wire.refs(request.variants))
        except KVCraftError as e:
            await context.abort(e.code, str(e))
        loop = asyncio.get_running_loop()
        timer = self.metrics.fetch_seconds.time()
        timer.__enter__()
        closed = False
        try:
            last = min(i.num_layers for i in infos)
            specs = [(wire.spec_message(i.key_spec).SerializeToString(),
                      wire.spec_message(i.value_spec).SerializeToString()) for i in infos]
            first = request.first_layer
            end = last if request.num_layers == 0 else first + request.num_layers
            if first >= last or end > last:
                raise InvalidArgument(
                    f"layers [{first}, {end}) requested; the variants have {last} layers")
            for layer in range(first, end):
                if layer == first + 1:
                    failpoints.reach("fetch:after-first-layer")
                for idx, info in enumerate(infos):
                    head = codec.layer_chunk_head(layer, idx, info.variant_id, *specs[idx])
                    msg = await asyncio.to_thread(self._layer_chunk, info, layer, head)
                    self.metrics.fetch_bytes.inc(info.layout.layer_bytes)
                    yield msg
        except KVCraftError as e:
            closed = True
            loop.run_in_executor(None, self.store.close_fetch, infos)
            await context.abort(e.code, str(e))
        else:
            # Before the status goes out, so a client that saw the stream end also
            # sees the promotion to the host tier.
            closed = True
            await asyncio.to_thread(self.store.close_fetch, infos)
        finally:
            timer.__exit__(None, None, None)
            if not closed:  # cancelled by the client: release without awaiting
                loop.run_in_executor(None, self.store.close_fetch, infos)

    def _layer_chunk(self, info: Variant, layer: int, head: bytes) -> bytes:
        """A serialized LayerChunk: the layer's bytes copied once, from the tier's buffer
        into the message (FetchLayers' response serializer passes bytes through)."""
        k, v = self.store.read_layer(info, layer)
        return codec.encode_layer_chunk(head, k, v)


async def _discard_rest(request_iterator: AsyncIterator[Any], ahead: asyncio.Future | None) -> None:
    async def discard() -> None:
        seen = 0
        if ahead is not None:  # the message being read ahead, if the stream had not ended
            req = await ahead
            if req is None:
                return
            seen += message_bytes(req)
        async for req in request_iterator:
            seen += message_bytes(req)
            if seen > STORE_DISCARD_BYTES:
                return

    with contextlib.suppress(TimeoutError, grpc.RpcError, asyncio.InvalidStateError):
        await asyncio.wait_for(discard(), STORE_DISCARD_S)


def _abort_when_done(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is None:
        fut.result().abort()
