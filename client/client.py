"""Sync and asyncio clients of a kvcraft service: two faces of one core.

Both speak the same wire contract (proto/kvcraft/v1/kvcraft.proto) through a
kvclient.core.ClientCore, which builds every request, converts every answer, maps errors
and resolves timeouts. They have the same methods with the same parameters and
timeouts, and differ only where blocking or awaiting forces it:

- `fetch_layers`: a FetchStream to iterate (`cancel()` from any thread) / an async iterator;
- `fetch_local`: a LocalFetch (`with`) / an AsyncLocalFetch (`async with`);
- `plan_future`: a concurrent.futures.Future / an asyncio.Task, of the Plan;
- `match_prefix_future`, `release_future`: a grpc.Future of the answer message, whose
  exception is a grpc.RpcError (convert it with kvclient.errors.from_rpc_error) / an
  asyncio.Task of the same message, whose exception is a KVCraftError.

Errors arrive as kvclient.errors types (NotFoundError means: recompute).
"""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, AsyncIterator, Coroutine, Iterator, Sequence, TypeVar

import grpc
import torch

from kvclient import local_store as colocated
from kvclient.core import DEFAULT_ADDRESS, MAX_MESSAGE_BYTES, ClientCore, Face, awaited, blocking
from kvclient.errors import KVCraftError, from_rpc_error
from kvclient.messages import (ChunkLike, FetchedLayer, Layer, Lease, RefLike, fetch_request, fetched_layer,
                               plan_request, store_header, store_messages, store_requests, store_result_of)
from kvclient.plan_stream import BlockingPlanStream, PlanStream
from kvcraft.plans import Plan
from kvcraft.records import Ref, StoreResult, VariantStats
from kvcraft.v1 import kvcraft_pb2 as pb

if TYPE_CHECKING:
    from kvclient.local import AsyncLocalFetch, LocalFetch

__all__ = ["DEFAULT_ADDRESS", "MAX_MESSAGE_BYTES", "AsyncKVClient", "ChunkLike", "FetchStream", "FetchedLayer",
           "KVClient", "Layer", "Lease", "Plan", "Ref", "RefLike", "StoreResult", "fetch_request", "plan_request",
           "store_header", "store_messages", "store_requests"]

T = TypeVar("T")


def _kept(running: set[grpc.Future], call: grpc.Future) -> grpc.Future:
    """`call`, held in `running` until it ends: grpcio cancels a call whose future is
    garbage collected, so a call sent and forgotten would otherwise not happen."""
    running.add(call)
    call.add_done_callback(running.discard)
    return call


class FetchStream:
    """An open FetchLayers stream of the blocking client."""

    def __init__(self, call: grpc.Call, device: str | torch.device) -> None:
        self._call = call
        self._device = device

    def __iter__(self) -> Iterator[FetchedLayer]:
        try:
            for msg in self._call:
                yield fetched_layer(msg, self._device)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                raise from_rpc_error(e) from None
        finally:
            self._call.cancel()

    def cancel(self) -> None:
        self._call.cancel()


class KVClient(Face):
    """Blocking client. Use as a context manager or call close()."""

    def __init__(self, address: str = DEFAULT_ADDRESS, *, token: str | None = None,
                 admin_token: str | None = None, timeout: float = 30.0,
                 credentials: grpc.ChannelCredentials | None = None,
                 max_message_bytes: int = MAX_MESSAGE_BYTES, local_store: bool = True) -> None:
        """local_store: `store` tries the co-located path first (kvclient.local_store;
        the gRPC stream where it is not available); False: always the gRPC stream."""
        self.core = ClientCore(grpc, address, token=token, admin_token=admin_token, timeout=timeout,
                               credentials=credentials, max_message_bytes=max_message_bytes, local_store=local_store)
        self._releasing: set[grpc.Future] = set()  # release_future calls still running
        # Not self in these (see BlockingPlanStream): the stream's threads must not keep the client alive.
        plan_stream, release, md = self.core.kv.PlanStream, self.core.kv.Release, self.core.metadata
        releasing = self._releasing
        self._plans = BlockingPlanStream(
            lambda requests: plan_stream(requests, metadata=md),
            lambda lease_id: _kept(releasing, release.future(pb.ReleaseRequest(lease_id=lease_id), metadata=md,
                                                             timeout=timeout)))

    def __enter__(self) -> "KVClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Dropped without close(): end the PlanStream's threads, which hold the channel (not this client).
        plans = getattr(self, "_plans", None)
        if plans is not None:
            plans.close(wait=False)

    def close(self) -> None:
        self._plans.close()
        self.core.close()
        self.core.channel.close()

    # -- KVCache ----------------------------------------------------------------------
    def store(self, model_id: str, token_ids: Sequence[int], layers: Sequence[Layer], *,
              prefix_keys: Sequence[str] = (), stats: VariantStats | None = None) -> StoreResult:
        """Store one variant: through shared memory when this process is co-located with
        the service (kvclient.local_store), else over the gRPC Store stream."""
        header = self.core.colocated_header(model_id, token_ids, layers, prefix_keys, stats)
        if header is not None and (r := colocated.store(self.core, header, layers)) is not None:
            return store_result_of(r, local=True)
        return self.core.store(model_id, token_ids, layers, prefix_keys, stats).call()

    def plan(self, model_id: str, chunks: Sequence[ChunkLike], question_tokens: int, *,
             conversation_id: str = "", first_turn: bool | None = None, lease_ttl_s: float = 0.0,
             timings: pb.TimingReport | None = None, policy: str = "", adaptive: bool = False) -> Plan:
        """Plan a RAG request (chunks in retriever order): a `kvcraft.plans.Plan` record;
        Release its lease. Sent over one long-lived PlanStream call (kvclient.plan_stream)."""
        return self._plans.plan(plan_request(model_id, chunks, question_tokens, conversation_id, first_turn,
                                             lease_ttl_s, timings, policy, adaptive), self.core.deadline())

    def plan_future(self, model_id: str, chunks: Sequence[ChunkLike], question_tokens: int, *,
                    conversation_id: str = "", first_turn: bool | None = None, lease_ttl_s: float = 0.0,
                    timings: pb.TimingReport | None = None, timeout: float | None = None, policy: str = "",
                    adaptive: bool = False) -> Future:
        """Plan without blocking (the vLLM connector's scheduler side): a
        concurrent.futures.Future of the Plan, whose exception is a KVCraftError
        (DeadlineExceededError past the timeout). Cancelling it releases the lease its
        answer holds."""
        return self._plans.plan_future(plan_request(model_id, chunks, question_tokens, conversation_id, first_turn,
                                                    lease_ttl_s, timings, policy, adaptive), self.core.deadline(timeout))

    def fetch_layers(self, refs: Sequence[RefLike], *, first_layer: int = 0, num_layers: int = 0,
                     device: str | torch.device = "cpu", timeout: float | None = None) -> FetchStream:
        """Layers of the variants, layer-major, as they arrive (iterate; `cancel()` from
        any thread ends the stream)."""
        return FetchStream(self.core.open_fetch(refs, first_layer, num_layers, timeout), device)

    def fetch(self, chunk_key: str, variant_id: str = "", device: str | torch.device = "cpu") -> list[Layer]:
        """All layers of one variant as [(K, V), ...]."""
        return [(f.key, f.value) for f in self.fetch_layers([Ref(chunk_key, variant_id)], device=device)]

    lookup = blocking(ClientCore.lookup)
    match_prefix = blocking(ClientCore.match_prefix)

    def match_prefix_future(self, variant_ids: Sequence[str], timeout: float | None = None) -> grpc.Future:
        """MatchPrefix without blocking: a grpc.Future of the MatchPrefixResponse (`.done()`,
        `.cancel()`; convert its exception with kvclient.errors.from_rpc_error)."""
        return self.core.match_prefix(variant_ids, timeout).future()

    def fetch_local(self, refs: Sequence[RefLike], ttl_s: float = 0.0, timeout: float | None = None) -> "LocalFetch":
        """Same-host fast path: tensors aliasing the service's shared memory, valid until
        the returned LocalFetch is released (use it as a context manager). A client the
        service does not see on its host (not loopback, a unix socket or one of its own
        addresses) gets FailedPreconditionError: stream instead. Where the answer cannot
        be mapped here (OSError: the service runs on another host; ValueError: offsets
        outside its memory) the lease is released and the error raised."""
        from kvclient.local import LocalFetch

        r = self.core.locate(refs, ttl_s, timeout).call()
        try:
            return LocalFetch(self, r, *self.core.mappings().of(r))
        except Exception:
            with contextlib.suppress(KVCraftError):  # nothing will read these bytes: free them now, not at the ttl
                self.release(r.lease_id)
            raise

    lease = blocking(ClientCore.lease)
    release = blocking(ClientCore.release)

    def release_future(self, lease_id: str) -> grpc.Future:
        """Release without waiting (a grpc.Future of the ReleaseResponse; a lease not
        released expires by its TTL). The client keeps the call until it ends: grpcio
        cancels a call whose future is garbage collected, so a release sent and forgotten
        would otherwise not happen."""
        return _kept(self._releasing, self.core.release(lease_id).future())

    # -- Admin ------------------------------------------------------------------------
    stats = blocking(ClientCore.stats)
    list_chunks = blocking(ClientCore.list_chunks)
    get_chunk = blocking(ClientCore.get_chunk)
    evict = blocking(ClientCore.evict)
    pin = blocking(ClientCore.pin)
    unpin = blocking(ClientCore.unpin)
    flush = blocking(ClientCore.flush)
    config = blocking(ClientCore.config)


class AsyncKVClient(Face):
    """asyncio client: KVClient's methods, awaited (see the module docstring for where
    they differ). Use with `async with` or `await close()`."""

    def __init__(self, address: str = DEFAULT_ADDRESS, *, token: str | None = None,
                 admin_token: str | None = None, timeout: float = 30.0,
                 credentials: grpc.ChannelCredentials | None = None,
                 max_message_bytes: int = MAX_MESSAGE_BYTES, local_store: bool = True) -> None:
        """local_store: `store` tries the co-located path first (kvclient.local_store;
        the gRPC stream where it is not available); False: always the gRPC stream."""
        self.core = ClientCore(grpc.aio, address, token=token, admin_token=admin_token, timeout=timeout,
                               credentials=credentials, max_message_bytes=max_message_bytes, local_store=local_store)
        self._running: set[asyncio.Task] = set()  # the *_future tasks: the loop itself keeps only weak references
        self._plans = PlanStream(lambda: self.core.kv.PlanStream(metadata=self.core.metadata), self.release)

    async def __aenter__(self) -> "AsyncKVClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._plans.close()
        self.core.close()
        await self.core.channel.close()

    def _task(self, work: Coroutine[Any, Any, T], *, forgotten: bool = False) -> asyncio.Task[T]:
        """`work` as a task of the running loop, kept until it ends. forgotten: nobody
        need look at its outcome (a failed release is not logged as never retrieved)."""
        try:
            task = asyncio.get_running_loop().create_task(work)
        except RuntimeError:
            work.close()
            raise
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        if forgotten:
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return task

    # -- KVCache ----------------------------------------------------------------------
    async def store(self, model_id: str, token_ids: Sequence[int], layers: Sequence[Layer], *,
                    prefix_keys: Sequence[str] = (), stats: VariantStats | None = None) -> StoreResult:
        """As KVClient.store: shared memory when co-located, else the gRPC stream."""
        header = self.core.colocated_header(model_id, token_ids, layers, prefix_keys, stats)
        if header is not None and (r := await colocated.store_async(self.core, header, layers)) is not None:
            return store_result_of(r, local=True)
        return await self.core.store(model_id, token_ids, layers, prefix_keys, stats).call_async()

    async def plan(self, model_id: str, chunks: Sequence[ChunkLike], question_tokens: int, *,
                   conversation_id: str = "", first_turn: bool | None = None, lease_ttl_s: float = 0.0,
                   timings: pb.TimingReport | None = None, policy: str = "", adaptive: bool = False) -> Plan:
        """Plan a RAG request (chunks in retriever order): a `kvcraft.plans.Plan` record;
        Release its lease."""
        return await self._plans.plan(plan_request(model_id, chunks, question_tokens, conversation_id, first_turn,
                                                   lease_ttl_s, timings, policy, adaptive), self.core.deadline())

    def plan_future(self, model_id: str, chunks: Sequence[ChunkLike], question_tokens: int, *,
                    conversation_id: str = "", first_turn: bool | None = None, lease_ttl_s: float = 0.0,
                    timings: pb.TimingReport | None = None, timeout: float | None = None, policy: str = "",
                    adaptive: bool = False) -> asyncio.Task[Plan]:
        """Plan without awaiting it here (called in a running loop): an asyncio.Task of the
        Plan, whose exception is a KVCraftError (DeadlineExceededError past the
        timeout). Cancelling it releases the lease its answer holds."""
        return self._task(self._plans.plan(plan_request(model_id, chunks, question_tokens, conversation_id,
                                                        first_turn, lease_ttl_s, timings, policy, adaptive), self.core.deadline(timeout)))

    async def fetch_layers(self, refs: Sequence[RefLike], *, first_layer: int = 0, num_layers: int = 0,
                           device: str | torch.device = "cpu",
                           timeout: float | None = None) -> AsyncIterator[FetchedLayer]:
        """Layers of the variants, layer-major, as they arrive (`async for`)."""
        call = self.core.open_fetch(refs, first_layer, num_layers, timeout)
        try:
            async for msg in call:
                yield fetched_layer(msg, device)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        finally:
            call.cancel()

    async def fetch(self, chunk_key: str, variant_id: str = "", device: str | torch.device = "cpu") -> list[Layer]:
        """All layers of one variant as [(K, V), ...]."""
        return [(f.key, f.value) async for f in self.fetch_layers([Ref(chunk_key, variant_id)], device=device)]

    lookup = awaited(ClientCore.lookup)
    match_prefix = awaited(ClientCore.match_prefix)

    def match_prefix_future(self, variant_ids: Sequence[str],
                            timeout: float | None = None) -> asyncio.Task[pb.MatchPrefixResponse]:
        """MatchPrefix without awaiting it here (called in a running loop): an asyncio.Task
        of the MatchPrefixResponse, whose exception is a KVCraftError."""
        return self._task(self.core.match_prefix(variant_ids, timeout).answer_async())

    async def fetch_local(self, refs: Sequence[RefLike], ttl_s: float = 0.0,
                          timeout: float | None = None) -> "AsyncLocalFetch":
        """Same-host fast path: tensors aliasing the service's shared memory, valid until
        the returned AsyncLocalFetch is released (use it with `async with`). Where the
        answer cannot be mapped here the lease is released and the error raised, as in
        KVClient.fetch_local."""
        from kvclient.local import AsyncLocalFetch

        r = await self.core.locate(refs, ttl_s, timeout).call_async()
        try:
            return AsyncLocalFetch(self, r, *self.core.mappings().of(r))
        except Exception:
            with contextlib.suppress(KVCraftError):  # nothing will read these bytes: free them now, not at the ttl
                await self.release(r.lease_id)
            raise

    lease = awaited(ClientCore.lease)
    release = awaited(ClientCore.release)

    def release_future(self, lease_id: str) -> asyncio.Task[pb.ReleaseResponse]:
        """Release without awaiting it (called in a running loop): an asyncio.Task of the
        ReleaseResponse, kept by the client until it ends, so a release sent and forgotten
        still happens (a lease not released expires by its TTL)."""
        return self._task(self.core.release(lease_id).answer_async(), forgotten=True)

    # -- Admin ------------------------------------------------------------------------
    stats = awaited(ClientCore.stats)
    list_chunks = awaited(ClientCore.list_chunks)
    get_chunk = awaited(ClientCore.get_chunk)
    evict = awaited(ClientCore.evict)
    pin = awaited(ClientCore.pin)
    unpin = awaited(ClientCore.unpin)
    flush = awaited(ClientCore.flush)
    config = awaited(ClientCore.config)
