"""Domain errors of the service, and their one mapping to gRPC status codes.

The core raises these; the gRPC layer (kvservice.server) turns them into statuses.
Every message names what was wrong, so a client can fix its request without logs.
"""

from __future__ import annotations

import errno

import grpc


class KVCraftError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgument(KVCraftError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(KVCraftError):
    """Unknown chunk/variant/lease, or a payload that failed its checksum (dropped)."""

    code = grpc.StatusCode.NOT_FOUND


class ResourceExhausted(KVCraftError):
    """A size limit or a tier budget is exceeded; nothing already stored is lost."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(KVCraftError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Unavailable(KVCraftError):
    code = grpc.StatusCode.UNAVAILABLE


def disk_full(e: BaseException) -> bool:
    """Whether `e` says the disk is full: ENOSPC / EDQUOT from a file, or RocksDB's
    status text (rocksdict raises plain Exception with it)."""
    return (isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)) or \
        "No space left on device" in str(e)
