"""gRPC adapter around the store: KVCache + Admin services, health, reflection, auth.

Servicers are thin: validate the shape of a request, call the store in a worker
thread (its I/O blocks), map domain errors to status codes in one place (`_rpc`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import math
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator

import grpc
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvcraft.keys import chunk_key, is_key
from kvcraft.v1 import kvcraft_pb2 as pb
from kvcraft.v1 import kvcraft_pb2_grpc as pb_grpc
from kvservice import failpoints
from kvservice.config import Config, MiB
from kvservice.errors import InvalidArgument, KVCraftError, ResourceExhausted
from kvservice.metrics import Metrics
from kvservice.planner import PlannerConfig
from kvservice.planner.catalog import TIERS
from kvservice.planning import PlanningService
from kvservice.store import ChunkStore
from kvservice import wire
from kvservice.index import Variant
from kvcraft import codec
from kvcraft.codec import StoreLayer

log = logging.getLogger("kvcraft.server")

SERVICE_NAMES = (
    pb.DESCRIPTOR.services_by_name["KVCache"].full_name,
    pb.DESCRIPTOR.services_by_name["Admin"].full_name,
)


@dataclass(frozen=True)
class _Malformed:
    """What the deserializer hands a handler for bytes that are not the request type:
    the handler answers INVALID_ARGUMENT (grpcio would answer UNKNOWN and log a
    traceback per request)."""

    problem: str


def _parser(cls: type) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        msg = cls()
        try:
            msg.ParseFromString(data)
        except (DecodeError, RecursionError) as e:
            return _Malformed(f"the request is not a valid {cls.DESCRIPTOR.full_name} message: {e}")
        return msg

    return parse


def _store_parser(data: bytes) -> Any:
    """Store stream messages: a layer as views of the received bytes (`kvcraft.codec`,
    no copy), anything else through protobuf."""
    return codec.decode_store_layer(data) or _STORE_REQUEST(data)


_STORE_REQUEST = _parser(pb.StoreRequest)
# Per method: (request deserializer, response serializer) that replace protobuf's.
# FetchLayers yields LayerChunk messages it serialized itself (`kvcraft.codec`).
_CODECS: dict[str, tuple[Callable[[bytes], Any] | None, Callable[[Any], bytes] | None]] = {
    "Store": (_store_parser, None),
    "FetchLayers": (None, bytes),
}


def _as_message(req: Any) -> Any:
    if isinstance(req, StoreLayer):
        return pb.StoreRequest(layer=pb.LayerPayload(layer=req.layer, key=bytes(req.key), value=bytes(req.value)))
    return req


def _check_parsed(request: Any) -> None:
    if isinstance(request, _Malformed):
        raise InvalidArgument(request.problem)


def add_service(server: grpc.aio.Server, service: str, servicer: Any) -> None:
    """Register `servicer` for `service` of kvcraft.proto, with deserializers that turn
    bytes that do not parse into INVALID_ARGUMENT instead of UNKNOWN."""
    desc = pb.DESCRIPTOR.services_by_name[service]
    make = {(False, False): grpc.unary_unary_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler}
    handlers = {
        m.name: make[(m.client_streaming, m.server_streaming)](
            getattr(servicer, m.name),
            request_deserializer=_CODECS.get(m.name, (None,))[0] or _parser(GetMessageClass(m.input_type)),
            response_serializer=_CODECS.get(m.name, (None, None))[1] or GetMessageClass(m.output_type).SerializeToString)
        for m in desc.methods
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(desc.full_name, handlers),))


class InFlight:
    """Counts running RPCs, so a SIGTERM drain can wait for them to finish."""

    def __init__(self) -> None:
        self.active = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        self.active += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.active -= 1
            if self.active == 0:
                self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True


def check_ttl(name: str, ttl_s: float, cfg: Config) -> None:
    """A lease ttl must be finite and within max_lease_ttl_s, checked before any lease
    exists (a NaN ttl would never expire and hold its variants forever)."""
    if not 0 <= ttl_s <= cfg.max_lease_ttl_s:
        raise InvalidArgument(f"{name} is {ttl_s}; expected 0 (lease_timeout_s) .. max_lease_ttl_s "
                              f"({cfg.max_lease_ttl_s:g}) seconds")


# Bounds on engine-reported timings: far beyond any real layer, far below overflow of
# the estimators' sums of squares.
_MAX_TIMING = {"bytes_per_layer": float(1 << 50), "tokens_per_layer": float(1 << 32), "seconds": 3600.0}


def _check_timing(where: str, t: Any, fields: tuple[str, ...]) -> None:
    for f in fields:
        v = getattr(t, f)
        if not (math.isfinite(v) and 0 <= v <= _MAX_TIMING[f]):
            raise InvalidArgument(f"{where}.{f} is {v}; expected a finite number in [0, {_MAX_TIMING[f]:g}]")


def check_plan_request(req: pb.PlanRequest, cfg: Config) -> None:
    """Bounds of a Plan request the planner itself does not know (limits, ttl, timings)."""
    check_ttl("lease_ttl_s", req.lease_ttl_s, cfg)
    if len(req.chunks) > cfg.max_fetch_variants:
        raise InvalidArgument(f"{len(req.chunks)} chunks; at most max_fetch_variants={cfg.max_fetch_variants}")
    for i, c in enumerate(req.chunks):
        n = len(c.token_ids) or c.token_count
        if n > cfg.max_chunk_tokens:
            raise ResourceExhausted(f"chunks[{i}] has {n} tokens; max_chunk_tokens is {cfg.max_chunk_tokens}")
    for i, t in enumerate(req.timings.loads):
        if t.tier not in TIERS:
            raise InvalidArgument(f"timings.loads[{i}].tier is {t.tier[:40]!r}; expected one of {', '.join(TIERS)}")
        _check_timing(f"timings.loads[{i}]", t, ("bytes_per_layer", "seconds"))
    for i, t in enumerate(req.timings.computes):
        _check_timing(f"timings.computes[{i}]", t, ("tokens_per_layer", "seconds"))


def _rpc(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Map domain errors to status codes; never leak a stack trace to the client."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            with self.inflight.track():
                _check_parsed(request)
                return await fn(self, request, context)
        except grpc.aio.AbortError:
            raise
        except KVCraftError as e:
            await context.abort(e.code, str(e))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            known = storage_error(e)
            if known is not None:
                await context.abort(known.code, str(known))
            log.exception("%s failed", fn.__name__)  # a bug: log it whole, tell the client what kind
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {fn.__name__}: {type(e).__name__}")

    return wrapper


def storage_error(e: BaseException) -> KVCraftError | None:
    """A full disk (ENOSPC / EDQUOT from a payload file, or RocksDB's "No space left on
    device") is RESOURCE_EXHAUSTED naming the disk, not a bug."""
    full = (isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)) or \
        "No space left on device" in str(e)
    if not full:
        return None
    where = f" ({e.filename})" if isinstance(e, OSError) and e.filename else ""
    return ResourceExhausted(f"the disk under the data directory is full{where}: nothing was stored; "
                             "free space there (or lower disk_budget_bytes below what the disk holds); "
                             "reads of stored variants go on")


class KVCacheServicer(pb_grpc.KVCacheServicer):
    def __init__(self, store: ChunkStore, planning: PlanningService, metrics: Metrics,
                 inflight: InFlight) -> None:
        self.store = store
        self.planning = planning
        self.metrics = metrics
        self.inflight = inflight
        self._preload = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvcraft-preload")

    @_rpc
    async def Plan(self, request: pb.PlanRequest, context: Any) -> pb.PlanResponse:
        check_plan_request(request, self.store.cfg)
        return await asyncio.to_thread(self.planning.plan, request, self._preload)

    @_rpc
    async def Store(self, request_iterator: AsyncIterator[pb.StoreRequest], context: Any) -> pb.StoreResponse:
        session = None
        try:
            async for req in request_iterator:
                if isinstance(req, StoreLayer) and session is not None:  # the hot path: views of the message
                    await asyncio.to_thread(session.add_layer, req.layer, req.key, req.value)
                    continue
                req = _as_message(req)
                _check_parsed(req)
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
            await _discard_rest(request_iterator)
            raise refusal from None
        finally:
            if session is not None:
                session.abort()  # no-op once finished

    async def FetchLayers(self, request: pb.FetchRequest, context: Any) -> AsyncIterator[pb.LayerChunk]:
        with self.inflight.track():
            async for chunk in self._fetch_layers(request, context):
                yield chunk

    async def _fetch_layers(self, request: pb.FetchRequest, context: Any) -> AsyncIterator[pb.LayerChunk]:
        # A server-streaming handler cannot use the unary wrapper: errors are mapped inline.
        try:
            _check_parsed(request)
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

    @_rpc
    async def Lookup(self, request: pb.LookupRequest, context: Any) -> pb.LookupResponse:
        which = request.WhichOneof("target")
        if which == "chunk_key":
            key = request.chunk_key
            if not is_key(key):
                raise InvalidArgument(f"chunk_key {key[:40]!r} is not 32 lowercase hex chars")
        elif which == "tokens":
            t = request.tokens
            if not is_key(t.model_id):
                raise InvalidArgument(f"tokens.model_id {t.model_id[:40]!r} is not 32 lowercase hex chars")
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

    @_rpc
    async def MatchPrefix(self, request: pb.MatchPrefixRequest, context: Any) -> pb.MatchPrefixResponse:
        if len(request.variant_ids) > self.store.cfg.max_fetch_variants:
            raise InvalidArgument(f"{len(request.variant_ids)} variant ids; at most {self.store.cfg.max_fetch_variants}")
        return pb.MatchPrefixResponse(matched=self.store.match_prefix(request.variant_ids))

    @_rpc
    async def Locate(self, request: pb.LocateRequest, context: Any) -> pb.LocateResponse:
        check_ttl("lease_ttl_s", request.lease_ttl_s, self.store.cfg)
        located = await asyncio.to_thread(self.store.locate, wire.refs(request.variants), request.lease_ttl_s)
        return wire.locate_response(located)

    @_rpc
    async def Lease(self, request: pb.LeaseRequest, context: Any) -> pb.LeaseResponse:
        check_ttl("ttl_s", request.ttl_s, self.store.cfg)
        lease_id, vids, expires = await asyncio.to_thread(self.store.take_lease, wire.refs(request.variants),
                                                          request.ttl_s)
        return pb.LeaseResponse(lease_id=lease_id, variant_ids=vids, expires_unix_ms=int(expires * 1000))

    @_rpc
    async def Release(self, request: pb.ReleaseRequest, context: Any) -> pb.ReleaseResponse:
        if not request.lease_id:
            raise InvalidArgument("lease_id is empty")
        return pb.ReleaseResponse(released=self.store.release(request.lease_id))


# A refused Store reads (and drops) up to this much of what the client still sends
# before it answers: a status sent while the client is still writing can reach a grpcio
# asyncio client as "INTERNAL: Internal error from Core" (grpc/grpc#36066).
STORE_DISCARD_BYTES = 256 * MiB
STORE_DISCARD_S = 10.0


async def _discard_rest(request_iterator: AsyncIterator[Any]) -> None:
    async def discard() -> None:
        seen = 0
        async for req in request_iterator:
            seen += (0 if isinstance(req, _Malformed) else
                     req.key.nbytes + req.value.nbytes if isinstance(req, StoreLayer) else req.ByteSize())
            if seen > STORE_DISCARD_BYTES:
                return

    with contextlib.suppress(TimeoutError, grpc.RpcError, asyncio.InvalidStateError):
        await asyncio.wait_for(discard(), STORE_DISCARD_S)


def _abort_when_done(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is None:
        fut.result().abort()


class AdminServicer(pb_grpc.AdminServicer):
    def __init__(self, store: ChunkStore, cfg: Config, inflight: InFlight) -> None:
        self.store = store
        self.cfg = cfg
        self.inflight = inflight

    @_rpc
    async def Stats(self, request: pb.StatsRequest, context: Any) -> pb.StatsResponse:
        return wire.stats_response(self.store.stats())

    @_rpc
    async def ListChunks(self, request: pb.ListChunksRequest, context: Any) -> pb.ListChunksResponse:
        return wire.list_chunks_response(*self.store.list_chunks(request.model_id, request.page_size,
                                                                 request.page_token))

    @_rpc
    async def GetChunk(self, request: pb.GetChunkRequest, context: Any) -> pb.GetChunkResponse:
        if not is_key(request.chunk_key):
            raise InvalidArgument(f"chunk_key {request.chunk_key[:40]!r} is not 32 lowercase hex chars")
        return pb.GetChunkResponse(variants=[wire.variant_message(v, self.store.leased(v.variant_id))
                                             for v in self.store.get_chunk(request.chunk_key)])

    @_rpc
    async def Evict(self, request: pb.VariantSelector, context: Any) -> pb.EvictResponse:
        evicted, skipped = await asyncio.to_thread(self.store.evict, wire.selector(request))
        return pb.EvictResponse(evicted=evicted, skipped_protected=skipped)

    @_rpc
    async def Pin(self, request: pb.VariantSelector, context: Any) -> pb.PinResponse:
        return pb.PinResponse(variants=await asyncio.to_thread(self.store.set_pinned, wire.selector(request), True))

    @_rpc
    async def Unpin(self, request: pb.VariantSelector, context: Any) -> pb.PinResponse:
        return pb.PinResponse(variants=await asyncio.to_thread(self.store.set_pinned, wire.selector(request), False))

    @_rpc
    async def Flush(self, request: pb.FlushRequest, context: Any) -> pb.FlushResponse:
        evicted, skipped = await asyncio.to_thread(self.store.flush)
        return pb.FlushResponse(evicted=evicted, skipped_protected=skipped)

    @_rpc
    async def Config(self, request: pb.ConfigRequest, context: Any) -> pb.ConfigResponse:
        return pb.ConfigResponse(toml=self.cfg.to_toml())


class _AuthInterceptor(grpc.aio.ServerInterceptor):
    """Bearer tokens: `auth_token` for KVCache, `admin_token` for Admin (health and
    reflection stay open so probes and grpcurl discovery work)."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        method = details.method
        if method.startswith("/kvcraft.v1.Admin/"):
            need = self.cfg.admin_token
        elif method.startswith("/kvcraft.v1.KVCache/"):
            need = self.cfg.auth_token
        else:
            need = ""
        if need:
            got = dict(details.invocation_metadata or ()).get("authorization", "")
            if got != f"Bearer {need}":
                code = grpc.StatusCode.UNAUTHENTICATED if not got else grpc.StatusCode.PERMISSION_DENIED
                return _deny(code, f"{method} needs 'authorization: Bearer <token>' metadata")
        return await continuation(details)


def _deny(code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    async def abort(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    return grpc.unary_unary_rpc_method_handler(abort)


@dataclass
class RunningServer:
    server: grpc.aio.Server
    store: ChunkStore
    port: int
    health: health.aio.HealthServicer
    metrics: Metrics
    inflight: InFlight

    async def drain(self, drain_s: float) -> None:
        """SIGTERM: report NOT_SERVING at once while still accepting connections (so a
        health probe sees it, not "connection refused"), let running RPCs finish for up
        to `drain_s`, then stop."""
        deadline = time.monotonic() + drain_s
        await self.health.enter_graceful_shutdown()
        await self.inflight.wait_idle(drain_s)
        await self.stop(max(0.0, deadline - time.monotonic()))

    async def stop(self, grace: float | None) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        self.metrics.stop()
        self.store.close()


# Worker threads for the store's blocking calls (asyncio.to_thread). The default pool
# (cores + 4) lets a few Stores waiting on fsync stall every fetch behind them.
IO_THREADS = 64


async def start_server(cfg: Config) -> RunningServer:
    cfg.check_tls_files()
    asyncio.get_running_loop().set_default_executor(
        ThreadPoolExecutor(max_workers=IO_THREADS, thread_name_prefix="kvcraft-io"))
    store = ChunkStore(cfg)
    metrics = Metrics(store, cfg.metrics_port, cfg.host)
    options = [
        ("grpc.max_receive_message_length", cfg.max_message_bytes),
        ("grpc.max_send_message_length", cfg.max_message_bytes),
    ]
    interceptors = [_AuthInterceptor(cfg)] if (cfg.auth_token or cfg.admin_token) else []
    server = grpc.aio.server(options=options, interceptors=interceptors)
    inflight = InFlight()
    planning = PlanningService(store, PlannerConfig(alpha=cfg.cfo_alpha,
                                                    max_conversation_chunks=cfg.max_conversation_chunks))
    add_service(server, "KVCache", KVCacheServicer(store, planning, metrics, inflight))
    add_service(server, "Admin", AdminServicer(store, cfg, inflight))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", *SERVICE_NAMES):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        (*SERVICE_NAMES, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    address = f"{cfg.host}:{cfg.port}"
    if cfg.tls_cert:
        with open(cfg.tls_key, "rb") as k, open(cfg.tls_cert, "rb") as c:
            pair = [(k.read(), c.read())]
        ca = open(cfg.tls_client_ca, "rb").read() if cfg.tls_client_ca else None
        creds = grpc.ssl_server_credentials(pair, root_certificates=ca, require_client_auth=ca is not None)
        port = server.add_secure_port(address, creds)
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        store.close()
        raise OSError(f"cannot listen on {address}")
    if store.cluster is not None and not cfg.remote_advertise:
        store.cluster.view.holder = f"{cfg.host}:{port}"  # the bound port, for the cluster view
    await server.start()
    return RunningServer(server, store, port, health_servicer, metrics, inflight)


async def serve(cfg: Config, on_ready: Callable[[RunningServer], None] | None = None) -> None:
    """Run until SIGTERM/SIGINT, then drain in-flight RPCs for up to cfg.drain_s."""
    running = await start_server(cfg)
    rep = running.store.recovery
    log.info("recovered %d variants (%d dropped, %d adopted from their payload files, %d set aside in lost+found)",
             rep.variants, rep.dropped_metadata, rep.adopted_payloads, rep.orphan_payloads)
    if on_ready:
        on_ready(running)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("draining: health NOT_SERVING, %d RPCs running, waiting up to %.1fs",
             running.inflight.active, cfg.drain_s)
    await running.drain(cfg.drain_s)
