"""Finding and holding variants (KVCache service): Plan, Lookup, MatchPrefix, Locate,
Lease, Release."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator

from kvcraft.keys import chunk_key
from kvcraft.v1 import kvcraft_pb2 as pb
from kvservice import wire
from kvservice.errors import InvalidArgument, ResourceExhausted, check_key
from kvservice.planning import PlanningService
from kvservice.server.checks import check_plan_request, check_ttl
from kvservice.server.codecs import check_parsed
from kvservice.server.peers import check_same_host
from kvservice.server.status import InFlight, rpc, status_of
from kvservice.store import ChunkStore


class LookupServicer:
    def __init__(self, store: ChunkStore, planning: PlanningService, inflight: InFlight) -> None:
        self.store = store
        self.planning = planning
        self.inflight = inflight
        self._preload = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvcraft-preload")

    @rpc
    async def Plan(self, request: pb.PlanRequest, context: Any) -> pb.PlanResponse:
        return await self._plan(request)

    async def PlanStream(self, request_iterator: AsyncIterator[pb.PlanRequest],
                         context: Any) -> AsyncIterator[pb.PlanStreamResponse]:
        """Plan each request of a long-lived stream, answers in order. A refused request
        is answered with its status in `error` (what Plan would end with) and the stream
        goes on; only a message between requests counts as running (a SIGTERM drain
        does not wait for an idle stream)."""
        async for request in request_iterator:
            with self.inflight.track():
                try:
                    check_parsed(request)
                    answer = pb.PlanStreamResponse(plan=await self._plan(request))
                except Exception as e:
                    code, message = status_of(e, "PlanStream")
                    answer = pb.PlanStreamResponse(error=pb.CallError(code=code.value[0], message=message))
            yield answer

    async def _plan(self, request: pb.PlanRequest) -> pb.PlanResponse:
        check_plan_request(request, self.store.cfg)
        if self.store.cluster is None:
            # CPU only, tens of µs (the lease takes the store lock, as Lookup and Release
            # do here): a worker-thread hop would cost more than the plan itself.
            return self.planning.plan(request, self._preload)
        return await asyncio.to_thread(self.planning.plan, request, self._preload)  # asks the cluster: I/O

    @rpc
    async def Lookup(self, request: pb.LookupRequest, context: Any) -> pb.LookupResponse:
        which = request.WhichOneof("target")
        if which == "chunk_key":
            key = request.chunk_key
            check_key("chunk_key", key)
        elif which == "tokens":
            t = request.tokens
            check_key("tokens.model_id", t.model_id)
            if not t.token_ids:
                raise InvalidArgument("tokens.token_ids is empty")
            if len(t.token_ids) > self.store.cfg.max_chunk_tokens:
                raise ResourceExhausted(f"tokens.token_ids has {len(t.token_ids)} tokens; "
                                        f"max_chunk_tokens is {self.store.cfg.max_chunk_tokens}")
            key = await asyncio.to_thread(chunk_key, t.model_id, t.token_ids)
        else:
            raise InvalidArgument("give chunk_key or tokens")
        variants = [wire.variant_message(v, self.store.leased(v.variant_id)) for v in self.store.lookup(key)]
        return pb.LookupResponse(found=bool(variants), chunk_key=key, variants=variants)

    @rpc
    async def MatchPrefix(self, request: pb.MatchPrefixRequest, context: Any) -> pb.MatchPrefixResponse:
        if len(request.variant_ids) > self.store.cfg.max_fetch_variants:
            raise InvalidArgument(f"{len(request.variant_ids)} variant ids; at most {self.store.cfg.max_fetch_variants}")
        return pb.MatchPrefixResponse(matched=self.store.match_prefix(request.variant_ids))

    @rpc
    async def Locate(self, request: pb.LocateRequest, context: Any) -> pb.LocateResponse:
        # Its answer is mappings of this host's shared memory: only for a client on this host.
        check_same_host(context.peer(), "stream the layers (FetchLayers)")
        check_ttl("lease_ttl_s", request.lease_ttl_s, self.store.cfg)
        located = await asyncio.to_thread(self.store.locate, wire.refs(request.variants), request.lease_ttl_s)
        return wire.locate_response(located)

    @rpc
    async def Lease(self, request: pb.LeaseRequest, context: Any) -> pb.LeaseResponse:
        check_ttl("ttl_s", request.ttl_s, self.store.cfg)
        lease_id, vids, expires = await asyncio.to_thread(self.store.take_lease, wire.refs(request.variants),
                                                          request.ttl_s)
        return pb.LeaseResponse(lease_id=lease_id, variant_ids=vids, expires_unix_ms=int(expires * 1000))

    @rpc
    async def Release(self, request: pb.ReleaseRequest, context: Any) -> pb.ReleaseResponse:
        if not request.lease_id:
            raise InvalidArgument("lease_id is empty")
        return pb.ReleaseResponse(released=self.store.release(request.lease_id))
