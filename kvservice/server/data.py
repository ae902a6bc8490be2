"""The byte paths of the KVCache service: Store (client stream of layers), StoreLocal
(a co-located client's layers through a staging area of shared memory) and
FetchLayers (server stream of layers)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, AsyncIterator

import grpc

from kvcraft import codec, tiers
from kvcraft.codec import StoreLayer
from kvcraft.v1 import kvcraft_pb2 as pb
from kvservice import failpoints, wire
from kvservice.config import MiB
from kvservice.errors import FailedPrecondition, InvalidArgument, KVCraftError
from kvservice.index import Variant
from kvservice.metrics import Metrics
from kvservice.server.codecs import as_message, check_parsed, message_bytes
from kvservice.server.peers import check_same_host
from kvservice.server.status import InFlight, rpc, status_of, storage_error
from kvservice.store import ChunkStore, staging
from kvservice.store.session import StagedWriter

# A refused Store reads (and drops) up to this much of what the client still sends
# before it answers: a status sent while the client is still writing can reach a grpcio
# asyncio client as "INTERNAL: Internal error from Core" (grpc/grpc#36066).
STORE_DISCARD_BYTES = 256 * MiB
STORE_DISCARD_S = 10.0
_KVCACHE = pb.DESCRIPTOR.services_by_name["KVCache"].full_name


class _ClientLeft(logging.Filter):
    """grpcio logs a batch that core refused on a call (a message, the final status) as
    an error with its traceback, unless it has already read the client's cancel
    (`_handle_exceptions` checks `client_closed`). A client that closes a FetchLayers
    stream early races that: core refuses the write because the client left, and the
    cancel is read a moment later. That is a normal end of a stream, so those records of
    FetchLayers become debug records, without the traceback."""

    prefix = f"ExecuteBatchError raised in core by servicer method [/{_KVCACHE}/FetchLayers]"

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith(self.prefix):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            record.exc_info = record.exc_text = None
        return True


_CLIENT_LEFT = _ClientLeft()


class DataServicer:
    """Store and FetchLayers of the KVCache service."""

    def __init__(self, store: ChunkStore, metrics: Metrics, inflight: InFlight) -> None:
        self.store = store
        self.metrics = metrics
        self.inflight = inflight
        logging.getLogger("grpc._cython.cygrpc").addFilter(_CLIENT_LEFT)  # kept once, however many servicers

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
            if session is not None:
                session.abort()
            refusal = await _refusal(e, messages, ahead)
            if refusal is None:
                raise
            ahead = None  # read by _refusal
            raise refusal from None
        finally:
            if ahead is not None:  # cancelled, or a bug: nobody will read what was ahead
                ahead.cancel()
            if session is not None:
                session.abort()  # no-op once finished

    @rpc
    async def StoreLocal(self, request_iterator: AsyncIterator[pb.StoreLocalRequest], context: Any) -> None:
        """Start (header + the client's staging area) -> mapped, accepted;
        StagedLayers(n) -> layers up to n written by the Store's StagedWriter thread
        (checksums computed here from the staged bytes); end of the client's stream ->
        commit as Store does -> the result. Any failure, or the client leaving, aborts
        the session: its temporary file, disk reservation and mapping go with it."""
        messages = aiter(request_iterator)
        # The start is read before any refusal: the client is then waiting for the answer,
        # not writing, so grpcio's asyncio client gets this status (grpc/grpc#36066).
        req = await anext(messages, None)
        if not self.store.cfg.local_store:
            raise FailedPrecondition("co-located Stores are off on this service (local_store = false): "
                                     "use the Store stream")
        if not staging.supported():
            raise FailedPrecondition("co-located Stores need Linux (memfd, /proc): use the Store stream")
        check_same_host(context.peer(), "use the Store stream")  # its staging area is this host's memory
        check_parsed(req)
        if req is None or req.WhichOneof("part") != "start":
            raise InvalidArgument("the first message of a StoreLocal stream must be a start (header + staging area)")
        area = req.start.staging
        begin = asyncio.ensure_future(asyncio.to_thread(
            self.store.begin_store, wire.store_header(req.start.header), (area.staging_id, area.pid, area.fd)))
        try:
            session = await asyncio.shield(begin)
        except asyncio.CancelledError:
            begin.add_done_callback(_abort_when_done)  # the client left while begin_store ran on
            raise
        writer = done = None
        try:
            writer = StagedWriter(session)  # writes layer n while the client copies layer n+1
            done = asyncio.wrap_future(writer.done)
            await context.write(pb.StoreLocalResponse(accepted=pb.StagingAccepted()))
            async for req in messages:
                check_parsed(req)
                part = req.WhichOneof("part")
                if part != "staged":
                    raise InvalidArgument(f"unexpected {part or 'empty'} message after the start")
                if done.done():  # the writer stopped on an error: raised below
                    break
                writer.stage(req.staged.layers)
            writer.end()
            await done
            result = await asyncio.to_thread(session.finish)
        except BaseException as e:
            if writer is not None:
                writer.end()
            if done is not None:  # its error, if any, is retrieved (not logged as lost)
                done.add_done_callback(lambda f: f.cancelled() or f.exception())
            session.abort()
            refusal = await _refusal(e, messages, None)  # the client may still be sending StagedLayers
            if refusal is None:
                raise
            raise refusal from None
        self.metrics.store_bytes.inc(result.bytes_stored if not result.already_present else 0)
        await context.write(pb.StoreLocalResponse(result=wire.store_response(result)))

    async def FetchLayers(self, request: pb.FetchRequest, context: Any) -> None:
        """Writes its messages with `context.write` rather than yielding them: when the
        client leaves, the failed write or the cancel is raised here, and the stream's
        holds are released at once (a generator left at its `yield` by grpcio would
        release them only once collected)."""
        with self.inflight.track():
            await self._fetch_layers(request, context)

    async def _fetch_layers(self, request: pb.FetchRequest, context: Any) -> None:
        # A server-streaming handler cannot use the unary wrapper: errors are mapped inline.
        loop = asyncio.get_running_loop()
        try:
            check_parsed(request)
            opening = asyncio.ensure_future(asyncio.to_thread(self.store.open_fetch, wire.refs(request.variants)))
            try:
                infos = await asyncio.shield(opening)
            except asyncio.CancelledError:
                # The client left while open_fetch ran on: release the holds it takes.
                opening.add_done_callback(lambda f: _release_opened(loop, f, self._end_early))
                raise
        except KVCraftError as e:
            await context.abort(*status_of(e, "FetchLayers"))
        timer = self.metrics.fetch_seconds.time()
        timer.__enter__()
        closed = False
        reading: asyncio.Future | None = None  # the next message, built on a worker thread
        try:
            last = min(i.num_layers for i in infos)
            first = request.first_layer
            end = last if request.num_layers == 0 else first + request.num_layers
            if first >= last or end > last:
                raise InvalidArgument(
                    f"layers [{first}, {end}) requested; the variants have {last} layers")
            messages = _LayerMessages(self.store, infos, first, end)
            # Variants in host memory (held: they stay there) are built here, on the event
            # loop: a slice of the slab, one copy, and grpcio's own copy of the message
            # then reads bytes this core just wrote (server CPU per 256 MiB 0.10-0.12 ->
            # 0.08 s; the loop is busy ~0.2-0.4 ms per 2 MiB layer, between writes). Reads
            # from other tiers (I/O, checksum verification, and the host copy they fill)
            # run on a worker, one message ahead of what grpcio sends.
            inline = all(_in_host_memory(self.store, i) for i in infos)
            if not inline:
                reading = loop.run_in_executor(None, messages.build, 0)
            for n in range(len(messages)):
                if inline:
                    msg = messages.build(n)
                else:
                    msg = await asyncio.shield(reading)  # a cancel never orphans a running read
                    reading = loop.run_in_executor(None, messages.build, n + 1) if n + 1 < len(messages) else None
                if n == len(infos):  # every variant's first layer went out
                    failpoints.reach("fetch:after-first-layer")
                self.metrics.fetch_bytes.inc(infos[n % len(infos)].layout.layer_bytes)
                await context.write(msg)
        except KVCraftError as e:
            closed = True
            _release_after(loop, reading, self._end_early, infos)
            await context.abort(*status_of(e, "FetchLayers"))
        else:
            # Before the status goes out, so a client that saw the stream end also
            # sees the promotion to the host tier.
            closed = True
            # Shielded: a cancel while the close waits for a worker thread would unqueue
            # it, and the variants would stay held.
            await asyncio.shield(asyncio.to_thread(self.store.close_fetch, infos))
        finally:
            timer.__exit__(None, None, None)
            if not closed:  # the client left: release without awaiting
                _release_after(loop, reading, self._end_early, infos)

    def _end_early(self, infos: list[Variant]) -> None:
        """A stream that stopped before its end (the client left, or a read failed) copies
        nothing up: the host copies its reads were filling are dropped, and no promotion
        reads the variants again for a client that is gone or will recompute."""
        self.store.close_fetch(infos, promote=False)


def _in_host_memory(store: ChunkStore, v: Variant) -> bool:
    """The fastest tier holding `v` is the host tier: a read is a slice of its slab."""
    for tier in store.tiers:
        if v.variant_id in tier:
            return tier.name == tiers.HOST and not tier.verify_reads
    return False


class _LayerMessages:
    """The serialized LayerChunks of one FetchLayers stream, layer-major (every
    variant's layer l, then l+1, ...). Each is built with one copy of the layer's bytes,
    from the tier's buffer into the message (the response serializer passes bytes
    through); reads from a verifying tier check the layer's checksum (ChunkStore.read_layer)."""

    def __init__(self, store: ChunkStore, infos: list[Variant], first: int, end: int) -> None:
        self.store = store
        self.infos = infos
        self.first = first
        self.count = (end - first) * len(infos)
        self.specs = [(wire.spec_message(i.key_spec).SerializeToString(),
                       wire.spec_message(i.value_spec).SerializeToString()) for i in infos]

    def __len__(self) -> int:
        return self.count

    def build(self, n: int) -> bytes:
        layer, idx = divmod(n, len(self.infos))
        layer += self.first
        info = self.infos[idx]
        head = codec.layer_chunk_head(layer, idx, info.variant_id, *self.specs[idx])
        k, v = self.store.read_layer(info, layer)
        return codec.encode_layer_chunk(head, k, v)


def _release_opened(loop: asyncio.AbstractEventLoop, opening: asyncio.Future, close: Any) -> None:
    """Release the holds of a fetch that opened after its client left."""
    if not opening.cancelled() and opening.exception() is None:
        loop.run_in_executor(None, close, opening.result())


def _release_after(loop: asyncio.AbstractEventLoop, reading: asyncio.Future | None,
                   close: Any, infos: list[Variant]) -> None:
    """Release a fetch's hold on its variants once no read of them runs any more (a
    read-ahead that failed or was left behind is retrieved, so it is not logged)."""
    def release(f: asyncio.Future | None = None) -> None:
        if f is not None and not f.cancelled():
            f.exception()
        loop.run_in_executor(None, close, infos)

    if reading is None:
        release()
    else:
        reading.add_done_callback(release)


async def _refusal(e: BaseException, request_iterator: AsyncIterator[Any],
                   ahead: asyncio.Future | None) -> KVCraftError | None:
    """The status a failed client stream (Store, StoreLocal) answers with, once the rest
    of what the client still sends is read and dropped (STORE_DISCARD_BYTES / _S); None
    if `e` is no refusal (a bug, or the client left): nothing is read then."""
    refusal = e if isinstance(e, KVCraftError) else storage_error(e)
    if refusal is not None:
        await _discard_rest(request_iterator, ahead)
    return refusal


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
