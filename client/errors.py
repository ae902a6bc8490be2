"""Typed client errors, one per status code the service uses."""

from __future__ import annotations

import grpc


class KVCraftError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class NotFoundError(KVCraftError):
    """The chunk/variant is not stored (or was corrupt and dropped): recompute it."""


class InvalidArgumentError(KVCraftError):
    pass


class ResourceExhaustedError(KVCraftError):
    pass


class FailedPreconditionError(KVCraftError):
    """The service will not do this for this client as things are: e.g. Locate or
    StoreLocal from a client on another host (its shared memory is not reachable from
    there: stream instead), or StoreLocal turned off."""


class UnavailableError(KVCraftError):
    """The service cannot be reached (down, or the deadline passed)."""


class DeadlineExceededError(UnavailableError):
    """The service did not answer within the call's timeout (it may be slow, not down)."""


_BY_CODE = {
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
}


# What grpcio's asyncio client reports when a write races the end of the RPC
# (grpc/grpc#36066): the server's own status is lost on the client side.
_CORE_WRITE_RACE = "Internal error from Core"


def from_rpc_error(e: grpc.RpcError) -> KVCraftError:
    code = e.code() if callable(getattr(e, "code", None)) else grpc.StatusCode.UNKNOWN
    details = e.details() if callable(getattr(e, "details", None)) else str(e)
    if code == grpc.StatusCode.INTERNAL and details and _CORE_WRITE_RACE in details:
        details += (" (grpcio asyncio client, grpc/grpc#36066: the server ended the stream while this "
                    "client was still writing, and its status was lost; nothing was stored. The server "
                    "reads up to 256 MiB of a refused Store before answering, so this only happens past "
                    "that; the server log names the reason)")
    return _BY_CODE.get(code, KVCraftError)(code, details or "")


_CODES = {c.value[0]: c for c in grpc.StatusCode}


def from_status(code: int, message: str) -> KVCraftError:
    """The error a stream answers one of its requests with (kvcraft.v1.CallError)."""
    status = _CODES.get(code, grpc.StatusCode.UNKNOWN)
    return _BY_CODE.get(status, KVCraftError)(status, message)
