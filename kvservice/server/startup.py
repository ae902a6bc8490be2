"""Starting the server (options, auth, TLS, health, reflection), serving until a signal,
and the SIGTERM drain."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvcraft.v1 import kvcraft_pb2 as pb
from kvservice.config import Config
from kvservice.metrics import Metrics
from kvservice.planner import PlannerConfig
from kvservice.planning import PlanningService
from kvservice.server.admin import AdminServicer
from kvservice.server.codecs import add_service
from kvservice.server.data import DataServicer
from kvservice.server.heap import Freezer, IdleTrim
from kvservice.server.lookup import LookupServicer
from kvservice.server.status import InFlight
from kvservice.store import ChunkStore

log = logging.getLogger("kvcraft.server")

SERVICE_NAMES = (
    pb.DESCRIPTOR.services_by_name["KVCache"].full_name,
    pb.DESCRIPTOR.services_by_name["Admin"].full_name,
)


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


IDLE_GRACE_S = 1.0  # the drain's last grace once no RPC runs (RunningServer.drain)


@dataclass
class RunningServer:
    server: grpc.aio.Server
    store: ChunkStore
    port: int
    health: health.aio.HealthServicer
    metrics: Metrics
    inflight: InFlight
    heap: Freezer  # `kvcraft serve` freezes the recovered index (kvservice.server.heap)

    async def drain(self, drain_s: float) -> None:
        """SIGTERM: report NOT_SERVING at once while still accepting connections (so a
        health probe sees it, not "connection refused"), let running RPCs finish for up
        to `drain_s`, then stop."""
        deadline = time.monotonic() + drain_s
        await self.health.enter_graceful_shutdown()
        idle = await self.inflight.wait_idle(drain_s)
        left = max(0.0, deadline - time.monotonic())
        # Once nothing runs, what is still open is streams between requests (PlanStream
        # calls live as long as their clients): a second's grace for RPCs that arrive
        # meanwhile, not the rest of drain_s.
        await self.stop(min(IDLE_GRACE_S, left) if idle else left)

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
    metrics: Metrics | None = None
    try:  # a start refused past this point releases the store (its shared memory) and the metrics port
        metrics = Metrics(store, cfg.metrics_port, cfg.host)
        options = [
            ("grpc.max_receive_message_length", cfg.max_message_bytes),
            ("grpc.max_send_message_length", cfg.max_message_bytes),
            # No BDP probing on what clients send: its growing receive windows let grpcio
            # buffer far ahead of a Store stream the server is still writing (8 Stores of
            # 8 MiB layers peaked at +1.2 GiB RSS with it, +0.2 GiB without; Store
            # throughput unchanged). A stream then holds about the layer it is receiving.
            ("grpc.http2.bdp_probe", 0),
            # A second service on this port would share it (grpc sets SO_REUSEPORT) and the kernel
            # would spread clients over two stores: its start fails instead.
            ("grpc.so_reuseport", 0),
        ]
        interceptors = [_AuthInterceptor(cfg)] if (cfg.auth_token or cfg.admin_token) else []
        server = grpc.aio.server(options=options, interceptors=interceptors)
        inflight = InFlight()
        heap = Freezer(lambda: len(store.index))
        inflight.on_idle = IdleTrim(inflight, heap)  # freed layer buffers back to the OS when idle
        planning = PlanningService(store, PlannerConfig(alpha=cfg.cfo_alpha,
                                                        max_conversation_chunks=cfg.max_conversation_chunks))
        add_service(server, "KVCache", DataServicer(store, metrics, inflight), LookupServicer(store, planning, inflight))
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
        try:  # (grpcio raises RuntimeError where the port cannot be bound; some versions answer 0)
            if cfg.tls_cert:
                with open(cfg.tls_key, "rb") as k, open(cfg.tls_cert, "rb") as c:
                    pair = [(k.read(), c.read())]
                ca = open(cfg.tls_client_ca, "rb").read() if cfg.tls_client_ca else None
                creds = grpc.ssl_server_credentials(pair, root_certificates=ca, require_client_auth=ca is not None)
                port = server.add_secure_port(address, creds)
            else:
                port = server.add_insecure_port(address)
        except RuntimeError:
            port = 0
        if port == 0:
            raise OSError(f"cannot listen on {address}: the port is in use (another service?) or the host is not "
                          "one of this machine's addresses")
        if store.cluster is not None and not cfg.remote_advertise:  # the bound port, for the cluster view
            from kvservice.tiers.remote import advertise

            store.cluster.view.holder = advertise(cfg, store.cluster.view.client.settings.local_hostname, port)
        await server.start()
    except BaseException:
        if metrics is not None:
            metrics.stop()
        store.close()
        raise
    return RunningServer(server, store, port, health_servicer, metrics, inflight, heap)


WATCH_S = 1.0  # how often `serve` checks that it still owns its data dir (and its parent lives)
LOST_DATA_DIR_EXIT = 3  # `kvcraft serve`'s exit code when its data dir was removed under it


async def _watch(store: ChunkStore, stop: asyncio.Event, parent: int | None) -> None:
    """Every WATCH_S: a data dir removed (or replaced) under the running service ends it at
    once, writing nothing more: RocksDB and the tiers open files by path, so going on (even
    a drain's flush) would write into whatever dir now has that name, which the lock no
    longer keeps from a second service. With `parent` (exit_with_parent), the process that
    started the service having exited starts the SIGTERM drain."""
    while True:
        await asyncio.sleep(WATCH_S)
        lost = store.data_dir_lost()
        if lost:
            log.critical("%s: stopping now, writing nothing more (exit code %d): the data dir that has its name "
                         "now may belong to another service", lost, LOST_DATA_DIR_EXIT)
            logging.shutdown()
            os._exit(LOST_DATA_DIR_EXIT)
        if parent is not None and os.getppid() != parent:
            log.warning("the process that started this service (pid %d) has exited: draining (exit_with_parent)",
                        parent)
            stop.set()
            return


async def serve(cfg: Config, on_ready: Callable[[RunningServer], None] | None = None,
                parent: int | None = None) -> None:
    """Run until SIGTERM/SIGINT, then drain in-flight RPCs for up to cfg.drain_s. parent: the
    process that started this one, taken when the process began (with cfg.exit_with_parent:
    its exit starts the drain; taken after the ready line, a starter killed right after reading
    it would go unnoticed)."""
    running = await start_server(cfg)
    rep = running.store.recovery
    frozen = running.heap.freeze()
    log.info("recovered %d variants (%d dropped, %d adopted from their payload files, %d set aside in lost+found); "
             "%d start-up objects frozen out of the garbage collector's scans", rep.variants, rep.dropped_metadata,
             rep.adopted_payloads, rep.orphan_payloads, frozen)
    if on_ready:
        on_ready(running)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # (SIGHUP: the terminal it ran in closed)
        loop.add_signal_handler(sig, stop.set)
    watch = asyncio.create_task(_watch(running.store, stop, parent if cfg.exit_with_parent else None))
    await stop.wait()
    watch.cancel()
    log.info("draining: health NOT_SERVING, %d RPCs running, waiting up to %.1fs",
             running.inflight.active, cfg.drain_s)
    await running.drain(cfg.drain_s)
