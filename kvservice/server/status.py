"""Domain errors -> gRPC status codes in one place, and the count of running RPCs."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from typing import Any, Awaitable, Callable, Iterator

import grpc

from kvservice.errors import (FailedPrecondition, KVCraftError, ResourceExhausted, Unavailable, disk_full, read_only,
                              transient)
from kvservice.server.codecs import check_parsed

log = logging.getLogger("kvcraft.server")


class InFlight:
    """Counts running RPCs, so a SIGTERM drain can wait for them to finish."""

    def __init__(self) -> None:
        self.active = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.on_idle: Callable[[], None] | None = None  # called (on the loop) when the last running RPC ends

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
                if self.on_idle is not None:
                    self.on_idle()

    async def wait_idle(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True


def rpc(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Map domain errors to status codes; never leak a stack trace to the client.
    For methods of a servicer with an `inflight` (InFlight) that return their response
    or write it with `context.write` (StoreLocal); not for async generators."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            with self.inflight.track():
                check_parsed(request)
                return await fn(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            await context.abort(*status_of(e, fn.__name__))

    return wrapper


# A status's message travels in a trailer, percent-encoded past printable ASCII (a byte: up to
# 3 chars), and a grpc client refuses trailers past 8-16 KiB: it would see RESOURCE_EXHAUSTED
# "metadata size exceeds hard limit", not the problem. So a message is cut to this many bytes.
MAX_MESSAGE_BYTES = 2000


def status_of(e: Exception, method: str) -> tuple[grpc.StatusCode, str]:
    """The status a call that raised `e` ends with: a domain error's own, a full disk's
    (`storage_error`), else INTERNAL naming only the kind (a bug: logged whole here, so
    call it inside the `except`). A message is cut to MAX_MESSAGE_BYTES of UTF-8."""
    if isinstance(e, KVCraftError):
        return e.code, _bounded(str(e))
    known = storage_error(e)
    if known is not None:
        return known.code, _bounded(str(known))
    log.exception("%s failed", method)
    return grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(e).__name__}"


def _bounded(message: str) -> str:
    raw = message.encode()
    if len(raw) <= MAX_MESSAGE_BYTES:
        return message
    return raw[:MAX_MESSAGE_BYTES - 40].decode(errors="ignore") + f"... (cut from {len(raw):,} bytes)"


def storage_error(e: BaseException) -> KVCraftError | None:
    """A full disk (ENOSPC / EDQUOT from a payload file, or RocksDB's "No space left on
    device") is RESOURCE_EXHAUSTED naming the disk, a read-only one (EROFS) FAILED_PRECONDITION,
    a process out of descriptors or memory for now UNAVAILABLE: states of the machine, not bugs."""
    where = f" ({e.filename})" if isinstance(e, OSError) and e.filename else ""
    if transient(e):
        return Unavailable(f"the service is short of file descriptors or memory for now ({e.strerror}): nothing "
                           "was stored or changed; retry")
    if read_only(e):
        return FailedPrecondition(f"the filesystem under the data directory is read-only{where} (mounted so, or "
                                  "remounted read-only by the kernel after disk errors: see its log): nothing was "
                                  "stored or changed; reads of stored variants go on")
    if not disk_full(e):
        return None
    return ResourceExhausted(f"the disk under the data directory is full{where}: nothing was stored or changed; "
                             "free space there (or lower disk_budget_bytes below what the disk holds); "
                             "reads of stored variants go on")
