"""The Admin service: stats, listing, eviction, pins, flush, the running config."""

from __future__ import annotations

import asyncio
from typing import Any

from kvcraft.v1 import kvcraft_pb2 as pb
from kvservice import wire
from kvservice.config import Config
from kvservice.errors import check_key
from kvservice.records import Selector
from kvservice.server.status import InFlight, rpc
from kvservice.store import ChunkStore


class AdminServicer:
    def __init__(self, store: ChunkStore, cfg: Config, inflight: InFlight) -> None:
        self.store = store
        self.cfg = cfg
        self.inflight = inflight

    @rpc
    async def Stats(self, request: pb.StatsRequest, context: Any) -> pb.StatsResponse:
        book = self.store.fidelity
        return wire.stats_response(self.store.stats(), book.tallies(), book.choices(), book.target)

    @rpc
    async def ListChunks(self, request: pb.ListChunksRequest, context: Any) -> pb.ListChunksResponse:
        if request.model_id:  # (a filter no chunk can match would read the whole index for nothing)
            check_key("model_id", request.model_id)
        return wire.list_chunks_response(*self.store.list_chunks(request.model_id, request.page_size,
                                                                 request.page_token))

    @rpc
    async def GetChunk(self, request: pb.GetChunkRequest, context: Any) -> pb.GetChunkResponse:
        check_key("chunk_key", request.chunk_key)
        return pb.GetChunkResponse(variants=[wire.variant_message(v, self.store.leased(v.variant_id))
                                             for v in self.store.get_chunk(request.chunk_key)])

    @rpc
    async def Evict(self, request: pb.VariantSelector, context: Any) -> pb.EvictResponse:
        evicted, skipped = await asyncio.to_thread(self.store.evict, _selector(request))
        return pb.EvictResponse(evicted=evicted, skipped_protected=skipped)

    @rpc
    async def Pin(self, request: pb.VariantSelector, context: Any) -> pb.PinResponse:
        return pb.PinResponse(variants=await asyncio.to_thread(self.store.set_pinned, _selector(request), True))

    @rpc
    async def Unpin(self, request: pb.VariantSelector, context: Any) -> pb.PinResponse:
        return pb.PinResponse(variants=await asyncio.to_thread(self.store.set_pinned, _selector(request), False))

    @rpc
    async def Flush(self, request: pb.FlushRequest, context: Any) -> pb.FlushResponse:
        evicted, skipped = await asyncio.to_thread(self.store.flush)
        return pb.FlushResponse(evicted=evicted, skipped_protected=skipped)

    @rpc
    async def Config(self, request: pb.ConfigRequest, context: Any) -> pb.ConfigResponse:
        return pb.ConfigResponse(toml=self.cfg.to_toml())


def _selector(msg: pb.VariantSelector) -> Selector:
    """The variants an Evict, Pin or Unpin names (its key checked: a malformed one is not
    merely absent)."""
    which = msg.WhichOneof("target")
    if which is not None:
        check_key(which, getattr(msg, which))
    return wire.selector(msg)
