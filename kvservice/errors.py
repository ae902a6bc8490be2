"""Domain errors of the service, and their one mapping to gRPC status codes.

The core raises these; the gRPC layer (kvservice.server) turns them into statuses.
Every message names what was wrong, so a client can fix its request without logs.
"""

from __future__ import annotations

import errno

import grpc

from kvcraft.keys import is_key


class KVCraftError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgument(KVCraftError):
    code = grpc.StatusCode.INVALID_ARGUMENT


def check_key(field: str, value: str, hint: str = "") -> None:
    """InvalidArgument naming `field` unless `value` is a key (a chunk key, variant id or model
    fingerprint: `kvcraft.keys.is_key`); the value quoted to 40 characters, `hint` after it."""
    if not is_key(value):
        raise InvalidArgument(f"{field} {value[:40]!r} is not 32 lowercase hex chars{hint}")


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


# Errors of the moment, not of the payload read: the process is out of file descriptors or
# memory, or the call was interrupted. A read that fails so is answered UNAVAILABLE (retry);
# only an error of the file itself drops its variant.
TRANSIENT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS, errno.EAGAIN, errno.EINTR})


def transient(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in TRANSIENT_ERRNOS


def read_only(e: BaseException) -> bool:
    """Whether `e` says the data directory's filesystem takes no writes: EROFS from a file
    (mounted read-only, or remounted so by the kernel after disk errors), or RocksDB's status
    text."""
    return (isinstance(e, OSError) and e.errno == errno.EROFS) or "Read-only file system" in str(e)


def disk_full(e: BaseException) -> bool:
    """Whether `e` says the disk is full: ENOSPC / EDQUOT from a file, or RocksDB's
    status text (rocksdict raises plain Exception with it)."""
    return (isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)) or \
        "No space left on device" in str(e)
