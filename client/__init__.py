"""kvcraft client library (import name `kvclient`).

`kvclient.keys` and `kvclient.types` are light (no torch, no grpc) and shared with the
service; the clients themselves load torch and grpc on first use.
"""

from __future__ import annotations

from typing import Any

_LAZY = {
    "KVClient": "kvclient.client",
    "AsyncKVClient": "kvclient.client",
    "Ref": "kvclient.client",
    "StoreResult": "kvclient.client",
    "FetchedLayer": "kvclient.client",
    "Lease": "kvclient.client",
    "ModelSpec": "kvclient.keys",
    "chunk_key": "kvclient.keys",
    "variant_id": "kvclient.keys",
    "VariantStats": "kvclient.types",
    "KVCraftError": "kvclient.errors",
    "NotFoundError": "kvclient.errors",
    "InvalidArgumentError": "kvclient.errors",
    "ResourceExhaustedError": "kvclient.errors",
    "UnavailableError": "kvclient.errors",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvclient' has no attribute {name!r}")
